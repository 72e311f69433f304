"""``bench.fleet``'s arithmetic: hosts per fleet, how many to kill for 10%, the stall around the kills, the learner's
idle share and the figures drawn from a run's summary."""

import pytest

from bench.fleet import figures, hosts_to_kill, learner_idle, per_process, stall, step_times


def row(step, time, step_s=1.0, sample_wait_s=0.25):
    return {"step": step, "time": time, "step_s": step_s, "sample_wait_s": sample_wait_s, "loss": 0.1}


def test_the_fleet_fits_sixteen_processes_and_ten_percent_is_whole_processes():
    assert [per_process(n) for n in (4, 16, 64, 256)] == [2, 2, 4, 16]
    assert hosts_to_kill(16, 2) == 1 and hosts_to_kill(64, 4) == 2 and hosts_to_kill(256, 16) == 2
    assert hosts_to_kill(4, 2) == 1  # at least one


def test_the_stall_is_the_longest_gap_from_the_kill_on_against_the_median_before():
    rows = [row(s, t) for s, t in [(1, 10.0), (2, 12.0), (3, 14.0), (4, 16.5), (5, 23.0), (6, 25.0)]]
    rows.insert(3, {"step": 3, "heldout_accuracy": 0.5})  # not a training row
    assert step_times(rows)[:2] == [(1, 10.0), (2, 12.0)]
    # killed at 17: the gap 16.5 -> 23.0 spans it; before: gaps ending at 14.0 and 16.5 (the first is warm-up)
    assert stall(rows, killed_at=17.0) == (6.5, 2.25)
    with pytest.raises(ValueError, match="before and after the kill"):
        stall(rows, killed_at=30.0)


def test_learner_idle_leaves_out_the_first_step():
    rows = [row(1, 1.0, step_s=9.0, sample_wait_s=8.0), row(2, 2.0), row(3, 3.0, step_s=2.0, sample_wait_s=1.25)]
    assert learner_idle(rows) == pytest.approx(1.5 / 3.0)
    assert learner_idle([row(1, 1.0)]) == 0.0


def test_figures_come_from_the_summary_and_the_step_window():
    summary = {"replay": {"inserted_total": 400, "dropped_stale_total": 8, "wal_bytes": 2_000_000,
                          "insert_latency_p50_s": 0.002, "insert_latency_p99_s": 0.01,
                          "lease_prompts_latency_p50_s": 0.001, "lease_prompts_latency_p99_s": 0.05},
               "supervisor": {"ticks": 30, "tick_p50_s": 0.02, "tick_p99_s": 0.5, "tick_max_s": 0.9}}
    rows = [row(1, 100.0), row(2, 110.0)]
    got = figures(summary, rows, group_size=2)
    assert got["ingest_groups_per_s"] == 20.0 and got["ingest_mb_per_s"] == 0.2  # 200 groups, 2 MB in 10 s
    assert got["stale_drop_fraction"] == 0.02 and got["tick_p99_s"] == 0.5 and got["insert_p99_s"] == 0.01
    assert got["steps"] == 2 and got["train_window_s"] == 10.0
