"""``rollout.versions``: the seam that says which policy version a group is generated with."""

import asyncio
import zlib

import torch

from gyre.proto.lockstep import LockstepConfig, VersionStore
from gyre.proto.timeline import SHARED
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.versions import LockstepVersions, StreamedVersions, version_source
from gyre.rollout.worker import RolloutWorker
from tests.fakes import FakeEngine, FakeReplay, FakeTokenizer, until
from tests.unit.rollout.test_rollout_worker import TASK


class RecordingEngine(FakeEngine):
    """Records ``(prompt_index, engine version, seed)`` of every generation."""

    def __init__(self, version: int) -> None:
        super().__init__(["7"], version=version)
        self.generated: list[tuple[int, int, int]] = []

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        self.generated.append((int(request_id.split("-")[0]), self.version, seed))
        return await super().generate(prompt_token_ids, n, sampling, request_id, seed)


def config(lockstep: LockstepConfig | None) -> RolloutConfig:
    return RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=2, max_ready_groups=100,
        retry_backoff_s=0.01, num_workers=1, lockstep=lockstep)


def test_a_lockstep_worker_leases_only_published_prompts_and_generates_each_with_its_exact_version(tmp_path):
    lock = LockstepConfig(lag=1, groups_per_step=2, seed=7, weights_dir=str(tmp_path / "weights"))
    store = VersionStore(lock.weights_dir, keep=3)
    engine = RecordingEngine(version=LockstepVersions.initial_engine_version)
    buf = TrajectoryBuffer(ReplayConfig())
    worker = RolloutWorker("r0", config(lock), TASK, engine, FakeReplay(buf), FakeTokenizer(), seed=3)
    assert isinstance(worker.versions, LockstepVersions) and worker.versions.lease_args() == (0.0, 2)  # lag 1

    async def scenario():
        store.write(0, [("w", torch.zeros(1))])
        store.write(1, [("w", torch.ones(1))])
        await worker.apply_weights(0, [("w", torch.zeros(1))])  # only noted: nothing loaded yet
        assert engine.updates == [] and worker.versions.served() == 0 and worker.serves(0, SHARED)
        assert worker.versions.lease_args() == (0.0, 4)  # prompts 0-3 need version 0
        run = asyncio.create_task(worker.run())
        await until(lambda: run.done() or buf.info()["size_groups"] >= 4, "4 groups of version 0")
        await asyncio.sleep(0.3)  # a lease past the bound would show now (the worker polls every 0.2 s)
        assert sorted(p for p, _, _ in engine.generated) == [0, 1, 2, 3]
        await worker.apply_weights(1, [])
        assert worker.versions.lease_args() == (0.0, 6)
        await until(lambda: run.done() or buf.info()["size_groups"] >= 6, "6 groups")
        worker.stop()
        await run

    asyncio.run(scenario())
    assert sorted(engine.generated) == [(i, i // 2 - 1 if i >= 4 else 0, lock.seed_for(i)) for i in range(6)]
    assert engine.updates == [0, 1]  # each version loaded from the store once, by the gate


def test_lockstep_evaluation_holds_the_newest_offered_version(tmp_path):
    lock = LockstepConfig(lag=1, groups_per_step=2, weights_dir=str(tmp_path / "weights"))
    VersionStore(lock.weights_dir).write(2, [("w", torch.ones(1))])
    engine = FakeEngine(["7"], version=-1)
    versions = LockstepVersions(lock).bind(engine)
    assert not versions.offer(2) and not versions.offer(1)
    unlagged = LockstepVersions(lock.model_copy(update={"lag": 0})).bind(engine)
    assert unlagged.lease_args() is None  # nothing offered, no lag: no prompt's version is published

    async def evaluate():
        async with versions.evaluating():
            return engine.version

    assert asyncio.run(evaluate()) == 2 == versions.served()


def test_a_lockstep_evaluation_before_any_offer_is_of_version_0_from_the_store(tmp_path):
    """The evaluation before training, when the learner has offered nothing yet: version 0, loaded exactly from the
    store, never the engine's -1 (the model folder's weights, recorded as version -1 in metrics.jsonl)."""
    lock = LockstepConfig(lag=2, groups_per_step=2, weights_dir=str(tmp_path / "weights"))
    engine = FakeEngine(["7"], version=LockstepVersions.initial_engine_version)
    versions = LockstepVersions(lock).bind(engine)

    async def evaluate():
        async def write_v0_later():
            await asyncio.sleep(0.3)  # the learner writes version 0 after the evaluation asked for it
            VersionStore(lock.weights_dir).write(0, [("w", torch.zeros(1))])

        writer = asyncio.create_task(write_v0_later())
        async with versions.evaluating():
            version = engine.version
        await writer
        return version

    assert asyncio.run(evaluate()) == 0 and engine.updates == [0]


def test_streamed_versions_apply_offers_and_leave_leases_unbounded():
    engine = FakeEngine(["7"], version=3)
    versions = version_source(config(None)).bind(engine)
    assert isinstance(versions, StreamedVersions) and versions.initial_engine_version == 0
    assert versions.offer(1) and versions.served() == 3 and versions.lease_args() == ()
    assert versions.serves(3, 5, 5) and not versions.serves(3, 5, 4) and not versions.serves(4, 5, 5)
    assert versions.sampling_seed(9, "9-0", 3) == zlib.crc32(b"3-9-0")
