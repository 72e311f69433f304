"""The rollout's version gate (``RolloutConfig.max_groups_per_version``): the synchronous on-policy mode."""

import asyncio

import pytest
from pydantic import ValidationError

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.config import EngineConfig, RolloutConfig, SamplingConfig
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.rollout.worker import RolloutWorker
from tests.fakes import FakeEngine, FakeReplay, FakeTokenizer, SlowEngine, until

TASK = TaskSource(TaskConfig(params={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                                     "allow_parentheses": False, "allow_negation": False}, heldout_size=4))


def make_worker(engine, buffer, gate, groups_in_flight=4, max_ready_groups=100):
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=groups_in_flight,
        max_ready_groups=max_ready_groups, retry_backoff_s=0.01, num_workers=1,
        max_groups_per_version=gate)
    return RolloutWorker("r0", config, TASK, engine, FakeReplay(buffer), FakeTokenizer(), seed=3)


def gate_closed_since(worker, waits: int) -> bool:
    """The version gate turned a group away after ``waits`` (``stats.gate_waits`` then) with none in flight:
    every group started with the current version has finished and no other can start before a newer one."""
    return worker.stats.gate_waits > waits and worker.stats.groups_in_flight == 0


def test_gate_stops_after_n_groups_per_version_until_a_newer_version_arrives():
    buf = TrajectoryBuffer(ReplayConfig())
    engine = FakeEngine(["7"])
    worker = make_worker(engine, buf, gate=2)

    async def scenario():
        task = asyncio.create_task(worker.run())
        counts = []
        for version in (1, 2, None):
            waits = worker.stats.gate_waits
            await until(lambda: gate_closed_since(worker, waits), f"the gate to close at version {engine.version}")
            counts.append(worker.stats.groups)
            if version is not None:
                await worker.apply_weights(version, [])
        worker.stop()
        await task
        return counts

    assert asyncio.run(scenario()) == [2, 4, 6]
    assert buf.info()["prompts_completed"] == 6
    assert engine.updates == [1, 2]


def test_gate_counts_groups_started_not_finished():
    buf = TrajectoryBuffer(ReplayConfig())
    engine = SlowEngine(["7"], delay_s=60.0)  # nothing finishes: run() cancels the groups on stop
    worker = make_worker(engine, buf, gate=2, groups_in_flight=4)

    async def scenario():
        task = asyncio.create_task(worker.run())
        await until(lambda: worker.stats.gate_waits > 0, "the gate to close at version 0")
        in_flight_v0 = worker.stats.groups_in_flight
        await worker.apply_weights(1, [])
        waits = worker.stats.gate_waits
        await until(lambda: worker.stats.gate_waits > waits, "the gate to close at version 1")
        in_flight_both = worker.stats.groups_in_flight
        worker.stop()
        await task
        return in_flight_v0, in_flight_both, worker.stats.groups

    # Two groups start with version 0 while they generate; version 1 lets two more start beside them.
    assert asyncio.run(scenario()) == (2, 4, 0)


def test_no_gate_keeps_generating_until_backpressure():
    buf = TrajectoryBuffer(ReplayConfig())
    worker = make_worker(FakeEngine(["7"]), buf, gate=None, groups_in_flight=2, max_ready_groups=5)

    async def scenario():
        task = asyncio.create_task(worker.run())
        # replay holds max_ready_groups and nothing is in flight: no lease can follow (nobody samples)
        await until(lambda: buf.info()["size_groups"] >= 5 and worker.stats.groups_in_flight == 0,
                    "backpressure to stop generation")
        worker.stop()
        await task

    asyncio.run(scenario())
    assert 5 <= buf.info()["size_groups"] <= 5 + 2  # only backpressure stopped it, at version 0
    assert worker.stats.gate_waits == 0 and worker.engine.version == 0


def test_gate_must_be_positive():
    engine = EngineConfig.model_construct(model="unused")
    assert RolloutConfig(engine=engine).max_groups_per_version is None
    with pytest.raises(ValidationError, match="max_groups_per_version"):
        RolloutConfig(engine=engine, max_groups_per_version=0)
