"""Prometheus metrics of the learner and rollout services: real HTTP servers on port 0, scraped with
urllib and parsed with prometheus-client's own text parser."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gyre.rollout.spool import Spool
from gyre.rollout.stats import RolloutStats
from gyre.services.common.observability import (
    STALENESS_BUCKETS, LearnerMetrics, ReplayStateCollector, RolloutMetrics, serve, stop,
)
from gyre.services.replay.metrics import replay_registry
from tests.fakes import FakeClock, group_table

RUN = "run-7"


@pytest.fixture
def served():
    """``served(registry) -> scrape()``: serve on port 0; every server is stopped after the test."""
    ports = []

    def start(registry):
        port = serve(registry, "127.0.0.1", 0)
        assert port > 0
        ports.append(port)
        return lambda: scrape(port)

    yield start
    for port in ports:
        stop(port)


def scrape(port: int) -> dict[tuple[str, str], float]:
    """``{(sample name, service label): value}`` of one scrape (histogram buckets keyed ``name{le}``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = f"{s.name}{{le={s.labels['le']}}}" if "le" in s.labels else s.name
            out[(name, s.labels.get("service", ""))] = s.value
            if s.labels.get("service"):
                assert s.labels["run_id"] == RUN, s
    return out


def learner_row(version: int, **kw) -> dict:
    row = {"loss": 0.25, "grad_norm": 1.5, "tokens": 640.0, "tokens_per_s": 320.0, "step_time_s": 2.0,
           "is_ratio_mean": 1.01, "is_ratio_max": 3.5, "tis_clip_frac": 0.125, "ppo_clip_frac": 0.0625,
           "is_ess_frac": 0.875, "approx_kl": 0.002, "reward_mean": 0.5, "step": version, "version": version,
           "trajectories": 8, "sample_wait_s": 0.5, "publish_s": 0.25, "checkpoint_s": 0.0, "pending_leases": 3,
           "step_s": 3.0, "time": 1.0e9, **{f"staleness_hist_{k}": 0.0 for k in range(STALENESS_BUCKETS + 1)}}
    row.update(kw)
    return row


def test_learner_step_rows_become_exact_metrics(served):
    clock = FakeClock(1000.0)
    metrics = LearnerMetrics(RUN, clock=clock)
    get = served(metrics.registry)
    metrics.observe_step(learner_row(1, staleness_hist_0=5.0, staleness_hist_1=2.0, staleness_hist_8=1.0))
    metrics.observe_step(learner_row(2, loss=0.125, staleness_hist_2=4.0, pending_leases=0))
    m = get()
    assert m[("gyre_policy_version", "learner")] == 2
    assert m[("gyre_learner_loss", "learner")] == 0.125
    assert m[("gyre_learner_grad_norm", "learner")] == 1.5
    assert m[("gyre_learner_is_ratio_max", "learner")] == 3.5
    assert m[("gyre_learner_tis_clip_fraction", "learner")] == 0.125
    assert m[("gyre_learner_is_ess_fraction", "learner")] == 0.875
    assert m[("gyre_learner_tokens_per_second", "learner")] == 320.0
    assert m[("gyre_learner_pending_leases", "learner")] == 0
    assert m[("gyre_learner_steps_total", "learner")] == 2
    assert m[("gyre_learner_tokens_total", "learner")] == 1280.0
    assert m[("gyre_learner_trajectories_total", "learner")] == 16
    assert ("gyre_learner_kl_to_ref", "learner") not in m  # no row carried it
    buckets = [m[(f"gyre_learner_trajectory_staleness_bucket{{le={le}}}", "learner")]
               for le in ("0.0", "1.0", "2.0", "7.0", "+Inf")]
    assert buckets == [5, 7, 11, 11, 12]
    assert m[("gyre_learner_trajectory_staleness_sum", "learner")] == 0 * 5 + 1 * 2 + 2 * 4 + 8 * 1
    assert m[("gyre_checkpoints_total", "learner")] == 0


def test_checkpoint_age_grows_at_scrape_time_and_resets_on_a_commit(served):
    clock = FakeClock(1000.0)
    metrics = LearnerMetrics(RUN, clock=clock)
    get = served(metrics.registry)
    clock.advance(30.0)  # no save yet: counts from the service start
    assert get()[("checkpoint_last_save_seconds_ago", "learner")] == 30.0
    metrics.observe_step(learner_row(1, checkpoint_s=4.5))  # a synchronous save committed in this step
    clock.advance(7.0)
    m = get()
    assert m[("checkpoint_last_save_seconds_ago", "learner")] == 7.0
    assert m[("runtime_state_age_seconds", "learner")] == 7.0
    assert m[("gyre_checkpoint_last_save_duration_seconds", "learner")] == 4.5
    assert m[("gyre_checkpoints_total", "learner")] == 1
    clock.advance(100.0)
    assert get()[("checkpoint_last_save_seconds_ago", "learner")] == 107.0
    metrics.observe_resume(40, saved_at=1130.0)  # a resumed checkpoint committed 7 s before "now"
    m = get()
    assert m[("checkpoint_last_save_seconds_ago", "learner")] == 7.0 and m[("gyre_policy_version", "learner")] == 40
    assert m[("gyre_checkpoints_total", "learner")] == 1


def test_async_save_counts_the_commit_not_the_capture():
    clock = FakeClock(0.0)
    metrics = LearnerMetrics(RUN, async_save=True, clock=clock)
    clock.advance(50.0)
    metrics.observe_step(learner_row(1, checkpoint_s=0.3))  # capture only: not committed yet
    assert metrics.checkpoints._value.get() == 0 and metrics.seconds_since_save() == 50.0
    clock.advance(10.0)
    metrics.observe_step(learner_row(2, checkpoint_write_s=9.0))  # the background write committed
    metrics.observe_step(learner_row(3, checkpoint_failed=1.0))
    assert metrics.checkpoints._value.get() == 1 and metrics.checkpoint_failures._value.get() == 1
    assert metrics.save_duration._value.get() == 9.0 and metrics.seconds_since_save() == 0.0


def test_rows_of_the_real_learner_loop_are_accepted():
    from tests.unit.learner.test_learner_loop import filled_buffer, make_loop

    loop, _ = make_loop(filled_buffer(4), save_interval=2)
    metrics = LearnerMetrics(RUN)
    for _ in range(2):
        metrics.observe_step(loop.step())
    assert metrics._gauges["version"].labels("learner", RUN)._value.get() == 2
    assert metrics._gauges["pending_leases"].labels("learner", RUN)._value.get() == 0  # acked at step 2's save
    assert metrics.steps._value.get() == 2 and metrics.checkpoints._value.get() == 1


def test_bad_learner_rows_are_clear_errors():
    metrics = LearnerMetrics(RUN)
    with pytest.raises(ValueError, match="dict with 'version'"):
        metrics.observe_step({"loss": 1.0})
    with pytest.raises(ValueError, match="'loss' must be a number; got 'nan!'"):
        metrics.observe_step(learner_row(1, loss="nan!"))
    with pytest.raises(ValueError, match=r"staleness_hist_3 must be a non-negative integer count; got 2\.5"):
        metrics.observe_step(learner_row(1, staleness_hist_3=2.5))
    with pytest.raises(ValueError, match="run_id must be a non-empty string"):
        LearnerMetrics("")
    with pytest.raises(ValueError, match="policy version must be an int >= 0; got -1"):
        metrics.observe_resume(-1)


def spool_with(tmp_path, clock, groups: int) -> Spool:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30, max_groups=64, clock=clock)
    for i in range(groups):
        spool.put(group_table(i))
        clock.advance(10.0)
    return spool


def test_rollout_stats_become_exact_metrics_and_spool_age_grows(served, tmp_path):
    clock = FakeClock(5000.0)
    spool = spool_with(tmp_path, clock, groups=3)  # oldest entry put at 5000, now 5030
    stats = RolloutStats(groups=7, trajectories=28, tokens=1400, reward_sum=14.0, weight_updates=3,
                         last_update_s=0.75, insert_retries=2, spool=spool)
    metrics = RolloutMetrics(RUN, "rollout-0", clock=clock)
    get = served(metrics.registry)
    assert get() == {}  # nothing before the first observation
    metrics.observe({**stats.as_dict(5), "groups_in_flight": 4, "learner_version": 8, "reward_errors": 1})
    clock.advance(15.0)
    m = get()
    assert m[("gyre_policy_version", "rollout-0")] == 5
    assert m[("gyre_rollout_policy_lag", "rollout-0")] == 3
    assert m[("gyre_rollout_groups_total", "rollout-0")] == 7
    assert m[("gyre_rollout_trajectories_total", "rollout-0")] == 28
    assert m[("gyre_rollout_tokens_total", "rollout-0")] == 1400
    assert m[("gyre_rollout_reward_mean", "rollout-0")] == 0.5
    assert m[("gyre_rollout_weight_updates_total", "rollout-0")] == 3
    assert m[("gyre_rollout_last_weight_apply_seconds", "rollout-0")] == 0.75
    assert m[("gyre_rollout_insert_retries_total", "rollout-0")] == 2
    assert m[("gyre_rollout_reward_errors_total", "rollout-0")] == 1
    assert m[("gyre_rollout_spool_pending_groups", "rollout-0")] == 3
    assert m[("gyre_rollout_spool_pending_bytes", "rollout-0")] == sum(e.nbytes for e in spool.pending())
    assert m[("rollout_queue_length", "rollout-0")] == 4 + 3
    assert m[("runtime_state_age_seconds", "rollout-0")] == 30.0 + 15.0
    assert m[("gyre_rollout_spool_oldest_pending_age_seconds", "rollout-0")] == 45.0


def test_rollout_source_is_pulled_at_scrape_time(served, tmp_path):
    clock = FakeClock(0.0)
    spool = spool_with(tmp_path, clock, groups=2)
    stats = RolloutStats(groups=2, trajectories=8, spool=spool)
    metrics = RolloutMetrics(RUN, "rollout-1", source=lambda: stats.as_dict(1), clock=clock)
    get = served(metrics.registry)
    m = get()
    assert m[("rollout_queue_length", "rollout-1")] == 2 and m[("runtime_state_age_seconds", "rollout-1")] == 20.0
    for entry in spool.pending():
        spool.ack(entry)
    stats.groups = 3
    m = get()
    assert m[("rollout_queue_length", "rollout-1")] == 0 and m[("runtime_state_age_seconds", "rollout-1")] == 0.0
    assert m[("gyre_rollout_groups_total", "rollout-1")] == 3
    assert ("gyre_rollout_policy_lag", "rollout-1") not in m  # no learner version known


def test_rollout_without_spool_has_no_state_age():
    metrics = RolloutMetrics(RUN, "rollout-2")
    metrics.observe({**RolloutStats(groups=1).as_dict(0), "groups_in_flight": 2})
    names = {s.name: s.value for f in metrics.registry.collect() for s in f.samples}
    assert names["rollout_queue_length"] == 2 and "runtime_state_age_seconds" not in names


def test_bad_rollout_stats_are_clear_errors():
    metrics = RolloutMetrics(RUN, "rollout-0")
    with pytest.raises(ValueError, match=r"rollout stats lack \['tokens_per_s'"):
        metrics.observe({"version": 0, "groups": 1, "trajectories": 4, "tokens": 10})
    with pytest.raises(ValueError, match="'groups_in_flight' must be a number; got 'many'"):
        metrics.observe({**RolloutStats().as_dict(0), "groups_in_flight": "many"})


class _Info:
    def __init__(self, age: float) -> None:
        self.age = age

    def info(self) -> dict:
        return {"last_snapshot_age_s": self.age}


def test_replay_state_age_is_the_snapshot_age():
    def samples(buffer):
        return {(s.name, s.labels["service"]): s.value for f in ReplayStateCollector(buffer, RUN).collect()
                for s in f.samples}

    assert samples(_Info(12.5)) == {("runtime_state_age_seconds", "replay"): 12.5}
    assert samples(_Info(-1)) == {}  # no snapshot yet


def test_replay_registry_keeps_the_replay_metrics(served):
    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig

    buf = TrajectoryBuffer(ReplayConfig())
    buf.insert(group_table(0))
    m = served(replay_registry(buf, RUN))()
    assert m[("gyre_replay_inserted_total", "")] == 4 and m[("gyre_replay_size_groups", "")] == 1


def test_staleness_buckets_match_the_learner():
    from gyre.learner.step_metrics import STALENESS_BUCKETS as LEARNER_BUCKETS

    assert STALENESS_BUCKETS == LEARNER_BUCKETS


def test_serve_refuses_a_bad_port_and_stop_an_unknown_one():
    with pytest.raises(ValueError, match="0..65535 .0 = any free port.; got 70000"):
        serve(LearnerMetrics(RUN).registry, "127.0.0.1", 70000)
    with pytest.raises(KeyError, match="no metrics server started by serve"):
        stop(1)
