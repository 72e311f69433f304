"""Where a rollout's time goes: ``rollout.stats.BusyClock`` and the worker's cumulative ``generate_s``,
``score_s``, ``insert_s``, ``weight_apply_s`` (``RolloutStats.as_dict``)."""

import asyncio
import time

from gyre.rollout import worker as rollout_worker
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.stats import BusyClock, RolloutStats
from tests.fakes import FakeClock, FakeEngine, FakeReplay
from tests.unit.rollout.test_rollout_worker import make_worker, run_until

GENERATE_S, SCORE_S, INSERT_S = 2.0, 0.25, 0.5
"""Fake-clock seconds of one group's generation, scoring and insert."""


def test_busy_clock_counts_overlapping_tasks_once(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    busy = BusyClock()
    with busy:
        clock.advance(1.0)
        with busy:  # a second group overlaps the first for 2 s
            clock.advance(2.0)
        assert busy.seconds() == 3.0  # the open span counts
        clock.advance(1.0)
    clock.advance(5.0)  # idle: not counted
    with busy:
        clock.advance(0.5)
    assert busy.seconds() == busy.total_s == 4.5 and busy.active == 0


class TimedEngine(FakeEngine):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__(["7"])
        self.clock, self.calls = clock, 0

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        self.calls += 1
        self.clock.advance(GENERATE_S)
        return await super().generate(prompt_token_ids, n, sampling, request_id, seed)


class TimedReplay(FakeReplay):
    def __init__(self, buffer, clock: FakeClock) -> None:
        super().__init__(buffer)
        self.clock = clock

    def insert(self, table):
        self.clock.advance(INSERT_S)
        return super().insert(table)


def test_worker_counts_generate_score_insert_and_weight_apply_in_their_own_buckets(monkeypatch):
    clock, scored = FakeClock(), []
    monkeypatch.setattr(time, "perf_counter", clock)
    score = rollout_worker.score_groups

    async def timed_score(items):
        scored.append(len(items))
        clock.advance(SCORE_S)
        return await score(items)

    monkeypatch.setattr(rollout_worker, "score_groups", timed_score)
    buf = TrajectoryBuffer(ReplayConfig())
    engine, replay = TimedEngine(clock), TimedReplay(buf, clock)
    worker = make_worker(replay, engine=engine, groups_in_flight=1)
    asyncio.run(worker.apply_weights(1, []))  # FakeEngine.update_weights: 0.01 s paused
    asyncio.run(run_until(worker, lambda: worker.stats.groups >= 3, "3 groups"))
    stats = worker.stats.as_dict(engine.version)
    assert engine.calls >= 3 and replay.insert_calls >= 3  # one group at a time: the buckets never overlap
    assert stats["generate_s"] == GENERATE_S * engine.calls
    assert stats["score_s"] == SCORE_S * len(scored)
    assert stats["insert_s"] == INSERT_S * replay.insert_calls
    assert stats["weight_apply_s"] == 0.01


def test_weight_loads_outside_apply_weights_are_added():
    stats = RolloutStats(weight_apply_s=0.5, other_weight_loads=lambda: 1.25)  # lockstep's gate loads
    assert stats.as_dict(0)["weight_apply_s"] == 1.75
    assert RolloutStats().as_dict(0)["weight_apply_s"] == 0.0


def test_a_lockstep_workers_gate_loads_count_as_weight_apply(tmp_path):
    from gyre.proto.lockstep import LockstepConfig
    from gyre.rollout.versions import LockstepVersions

    versions = LockstepVersions(LockstepConfig(groups_per_step=2, weights_dir=str(tmp_path)))
    worker = make_worker(FakeReplay(TrajectoryBuffer(ReplayConfig())), engine=FakeEngine(["7"], version=-1))
    worker = type(worker)("r0", worker.config, worker.task, worker.engine, worker.replay, worker.tokenizer,
                          versions=versions)
    versions.gate.load_s = 0.75  # what LockstepGate._load adds per load (tests/unit/proto/test_lockstep.py)
    assert worker.stats.as_dict(0)["weight_apply_s"] == 0.75
