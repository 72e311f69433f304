"""``bench.pipeline``'s arithmetic: throughput windows, the sync decomposition, ideal overlap, recovery."""

import pytest

from bench.pipeline import build_result, ideal_speedup, recovery_s, step_intervals, step_rows, sync_times


def row(step, time, step_s=1.0, sample_wait_s=0.4, restarts=0):
    return {"step": step, "time": time, "step_s": step_s, "sample_wait_s": sample_wait_s, "loss": 0.1,
            "learner_restarts": restarts}


def test_step_rows_keep_training_rows_by_step_and_the_last_of_a_retrained_step():
    rows = [row(2, 20.0), {"step": 0, "heldout_accuracy": 0.5}, row(1, 10.0), row(2, 25.0, restarts=1)]
    assert [(r["step"], r["time"]) for r in step_rows(rows)] == [(1, 10.0), (2, 25.0)]


def test_step_intervals_cover_the_window_after_warmup():
    rows = [row(s, t) for s, t in [(1, 5.0), (2, 6.0), (3, 8.0), (4, 9.0), (5, 14.0)]]
    assert step_intervals(rows, warmup=2, steps=3) == [2.0, 1.0, 5.0]
    assert step_intervals(rows, warmup=1, steps=1) == [1.0]
    with pytest.raises(ValueError, match=r"steps \[6, 7\] missing"):
        step_intervals(rows, warmup=3, steps=4)
    with pytest.raises(ValueError, match=r"warmup \(0\)"):
        step_intervals(rows, warmup=0, steps=4)


def test_sync_times_split_each_step_into_waiting_and_training():
    rows = [row(1, 1.0, step_s=9.0, sample_wait_s=8.0)] + [
        row(s, float(s), step_s=1.0 + w, sample_wait_s=w) for s, w in [(2, 0.5), (3, 0.7), (4, 0.6)]]
    assert sync_times(rows, warmup=1, steps=3) == (pytest.approx(0.6), pytest.approx(1.0))


def test_ideal_speedup_is_two_when_balanced_and_one_when_one_side_vanishes():
    assert ideal_speedup(1.0, 1.0) == 2.0
    assert ideal_speedup(1.0, 3.0) == pytest.approx(4 / 3)
    assert ideal_speedup(3.0, 1.0) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match=r"T_gen \(0.0\)"):
        ideal_speedup(0.0, 1.0)


def test_recovery_counts_to_the_first_step_that_needed_the_replacement():
    # step_s 1.0, sample_wait_s 0.4: a step ending at t was sampled at t - 0.6.
    rows = [row(10, 100.0), row(11, 101.0), row(12, 107.0), row(13, 108.0), row(13, 130.0, restarts=1)]
    # replay killed at 100.5: step 11 was sampled at 100.4 (old replay), step 12 at 106.4 (restarted replay).
    assert recovery_s(rows, "replay", killed_at=100.5, back_at=103.0) == pytest.approx(6.5)
    # rollout back at 106.5: step 12's batch was sampled before, step 13's (107.4) after.
    assert recovery_s(rows, "rollout", killed_at=100.5, back_at=106.5) == pytest.approx(7.5)
    # learner: the first row of the restarted learner.
    assert recovery_s(rows, "learner", killed_at=109.0, back_at=120.0) == pytest.approx(21.0)
    assert recovery_s(rows, "replay", killed_at=200.0, back_at=201.0) is None
    # A learner restarted before this kill: only a newer restart counts; rows without "loss" are ignored.
    rows += [row(14, 140.0, restarts=1), {"step": 15, "time": 150.0}, row(15, 160.0, restarts=2)]
    assert recovery_s(rows, "learner", killed_at=135.0, back_at=150.0) == pytest.approx(25.0)


def test_build_result_divides_the_measured_speedup_by_the_ideal():
    # sync: 2 s per step (1 s waiting + 1 s training); async: 1.25 s per step but one 3.25 s hiccup (step 4);
    # medians: speedup 1.6, ideal 2, efficiency 0.8; window totals: 8 s / 7 s.
    sync = [row(s, 2.0 * s, step_s=2.0, sample_wait_s=1.0) for s in range(1, 6)]
    asyn = [row(s, 1.25 * s + (2.0 if s >= 4 else 0.0), step_s=1.25, sample_wait_s=0.2) for s in range(1, 12)]
    asyn.append(row(12, 30.0, restarts=1))
    kills = {"replay": (7.5, 8.0), "learner": (20.0, 25.0), "rollout-0": (9.0, 11.0)}
    got = build_result(sync, asyn, warmup=1, steps=4, kills=kills, sim_gen_s=0.9)
    assert got["async_speedup"] == 1.6 and got["ideal_speedup"] == 2.0 and got["overlap_efficiency"] == 0.8
    assert (got["t_gen_s"], got["t_train_s"], got["async_t_train_s"]) == (1.0, 1.0, 1.05)
    assert got["sync_steps_per_s"] == 0.5 and got["async_steps_per_s"] == 0.8
    assert got["async_speedup_wall"] == 1.143
    # replay: step 5 (ends 8.25) was sampled at 7.2 < 7.5, step 6 (9.5) at 8.45; rollout: step 7 (10.75) was
    # sampled at 9.7 < 11, step 8 (12.0) at 10.95 < 11, step 9 (13.25) at 12.2; learner: its step ends at 30.
    assert (got["recovery_s_replay"], got["recovery_s_rollout"], got["recovery_s_learner"]) == (2.0, 4.25, 10.0)
    assert (got["restart_s_replay"], got["restart_s_rollout"], got["restart_s_learner"]) == (0.5, 2.0, 5.0)
    partial = build_result(sync, asyn, warmup=1, steps=4, kills={"replay": (7.5, 8.0)}, sim_gen_s=0.9)
    assert partial["recovery_s_replay"] == 2.0 and partial["recovery_s_learner"] is partial["restart_s_rollout"] is None
