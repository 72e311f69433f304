"""Lockstep (``determinism: lockstep``): the schedule, the version store, exact-prompt sampling in replay,
the rollout's version gate, and how a recipe hands the settings to rollouts and the learner."""

import asyncio
import os

import pytest
import torch

from gyre.proto.lockstep import LockstepConfig, VersionMismatchError, VersionStore, weights_sha256
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.lockstep_gate import LockstepGate
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def lock(tmp_path, lag=1, p=2) -> LockstepConfig:
    return LockstepConfig(lag=lag, groups_per_step=p, seed=7, weights_dir=str(tmp_path / "weights"))


def test_schedule_maps_prompts_to_steps_versions_and_seeds(tmp_path):
    cfg = lock(tmp_path, lag=1, p=2)
    assert [cfg.version_for(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert cfg.prompts_of_step(3) == [6, 7] and cfg.step_of(7) == 3
    assert cfg.seed_for(5) == cfg.seed_for(5) != cfg.seed_for(6)
    assert lock(tmp_path, lag=0, p=2).version_for(5) == 2


def test_version_store_round_trips_prunes_and_rewrites_an_older_version(tmp_path):
    store = VersionStore(tmp_path, keep=2)
    for v in range(4):
        store.write(v, [("b", torch.full((2,), float(v))), ("a", torch.zeros(3))])
    assert store.versions() == [2, 3] and store.read(0) is None
    names = [n for n, _ in store.read(3)]
    assert names == ["a", "b"] and torch.equal(store.read(3)[1][1], torch.full((2,), 3.0))
    store.write(1, [("a", torch.ones(3))])  # a learner resumed at an older checkpoint re-publishes
    assert store.versions() == [1, 2, 3]  # nothing at or above the re-written version is pruned
    with pytest.raises(ValueError, match=r"tensor 'a' appears twice"):
        store.write(5, [("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match=r"version \(-1\)"):
        store.write(-1, [])


def test_replay_leases_exactly_the_requested_prompts_in_order(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO))
    for i in (3, 0, 2):
        buf.insert(group_table(i))
    assert buf.sample(2, 0, prompt_indices=[1, 0]) is None  # prompt 1 is not in yet
    buf.insert(group_table(1))
    lease, table = buf.sample(2, 0, prompt_indices=[2, 0])
    assert table.column("prompt_index").to_pylist() == [2] * 4 + [0] * 4
    with pytest.raises(ValueError, match=r"must be num_groups \(2\) distinct indices"):
        buf.sample(2, 0, prompt_indices=[1, 1])
    buf.close()
    restored = TrajectoryBuffer(ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO))
    assert restored.info()["active_leases"] == 1 and restored.ack([lease]) == 2
    restored.close()


class GateEngine:
    """Records every load; generation just sleeps."""

    def __init__(self, version=-1):
        self.version, self.loads, self.active = version, [], set()

    async def update_weights(self, version, tensors, rewind=False):
        assert not self.active, "weights changed while a generation held the engine"
        self.loads.append((version, rewind, float(tensors[0][1][0])))
        self.version = version
        return 0.125


def test_gate_shares_a_version_switches_when_idle_and_rewinds_for_a_reissued_prompt(tmp_path):
    cfg = lock(tmp_path)
    store = VersionStore(cfg.weights_dir, keep=3)
    engine = GateEngine()
    gate = LockstepGate(engine, cfg, poll_s=0.01)
    seen = []

    async def generate(name, version, delay):
        async with gate.hold(version):
            engine.active.add(name)
            assert engine.version == version
            await asyncio.sleep(delay)
            seen.append((name, engine.version))
            engine.active.discard(name)

    async def main():
        store.write(0, [("w", torch.zeros(1))])
        first = [asyncio.create_task(generate(f"p{i}", 0, 0.05)) for i in range(3)]
        later = asyncio.create_task(generate("p4", 1, 0.0))  # needs version 1: not written yet
        await asyncio.sleep(0.2)
        assert len(seen) == 3 and not later.done()  # waits for the learner
        store.write(1, [("w", torch.ones(1))])
        await later
        await generate("reissued-p0", 0, 0.0)  # an old prompt re-issued: the engine goes back once
        await asyncio.gather(*first)

    asyncio.run(main())
    assert engine.loads == [(0, False, 0.0), (1, False, 1.0), (0, True, 0.0)]
    assert gate.switches == 3 and gate.rewinds == 1 and gate.load_s == 3 * 0.125  # -> rollout weight_apply_s
    assert seen[-2:] == [("p4", 1), ("reissued-p0", 0)]


def test_recipe_hands_lockstep_to_rollout_and_learner(tmp_path, tiny_llama):
    from gyre.services.control.recipe.schema import Recipe

    base = {"name": "ls", "model": str(tiny_llama), "run_dir": str(tmp_path), "seed": 3,
            "rollout": {}, "learner": {"groups_per_step": 2}, "replay": {"max_staleness": 1}}
    r = Recipe(**base, determinism="lockstep", lockstep_lag=1)
    assert r.rollout.lockstep == r.learner.lockstep == LockstepConfig(
        lag=1, groups_per_step=2, seed=3, weights_dir=str(tmp_path / "ls" / "weights"))
    assert Recipe(**base).rollout.lockstep is None
    with pytest.raises(ValueError, match=r"replay.max_staleness \(1\) must be >= lockstep_lag \(2\)"):
        Recipe(**base, determinism="lockstep", lockstep_lag=2)
    with pytest.raises(ValueError, match=r"max_groups_per_version \(2\) cannot be combined"):
        Recipe(**{**base, "rollout": {"max_groups_per_version": 2}}, determinism="lockstep")
    with pytest.raises(ValueError, match="rollout.lockstep is set from the top-level"):
        Recipe(**{**base, "rollout": {"lockstep": {"groups_per_step": 1, "weights_dir": "x"}}})


def test_prompt_leases_stay_below_the_limit_reissues_included():
    buf = TrajectoryBuffer(ReplayConfig(prompt_lease_ttl_s=0.05))
    assert buf.lease_prompts("r", 5, below=3) == [(0, 0), (1, 0), (2, 0)]
    assert buf.lease_prompts("r", 5, below=3) == []  # nothing new below 3
    import time
    time.sleep(0.1)  # the three leases expire and are re-issued with attempt 1, still below the limit only
    assert buf.lease_prompts("r", 2, below=2) == [(0, 1), (1, 1)]
    assert buf.lease_prompts("r", 5, below=5) == [(2, 1), (3, 0), (4, 0)]


def test_a_rewritten_version_must_match_the_stored_one_and_later_versions_wait_aside(tmp_path):
    store = VersionStore(tmp_path, keep=4)
    for v in range(4):  # a crashed learner's versions 0..3
        store.write(v, [("w", torch.full((2,), float(v)))])
    assert store.set_aside_after(1) == [2, 3]  # the resumed learner starts at version 1
    assert store.versions() == [0, 1] and store.read(2) is None  # no rollout loads an unchecked version
    store.write(2, [("w", torch.full((2,), 2.0))])  # re-produced exactly: checked, stored, aside copy gone
    assert store.versions() == [0, 1, 2] and not store.aside_path(2).exists()
    with pytest.raises(VersionMismatchError, match=r"policy version 3 re-written with other weights"):
        store.write(3, [("w", torch.full((2,), 3.5))])
    assert store.read(3) is None and store.aside_path(3).exists()  # the mismatch published nothing
    with pytest.raises(VersionMismatchError, match=r"than the stored v1.safetensors"):
        store.write(1, [("w", torch.zeros(2, dtype=torch.bfloat16))])
    assert torch.equal(store.read(1)[0][1], torch.full((2,), 1.0))
    assert weights_sha256([("a", torch.ones(1)), ("b", torch.zeros(1))]) == \
        weights_sha256([("b", torch.zeros(1)), ("a", torch.ones(1))])


def test_a_resumed_lockstep_learner_checks_its_predecessors_versions_before_rollouts_see_them(tmp_path):
    from gyre.learner.config import LearnerConfig
    from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
    from gyre.learner.publisher import WeightPublisher
    from tests.fakes import FakeReplay
    from tests.tiny_model import SMOLLM2_DIR

    class Engine:  # what resume (cold start) and publish_current read
        step = version = 0

        def capture_weights(self):
            return [("w", torch.full((4,), float(self.version)))]

    cfg = lock(tmp_path, lag=1, p=2)
    store = VersionStore(cfg.weights_dir, keep=3)
    store.write(0, [("w", torch.full((4,), 0.0))])
    store.write(1, [("w", torch.full((4,), 9.0))])  # the crashed learner's version 1: not reproducible
    loop_cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, lockstep=cfg,
                                 resume="none")
    loop = LearnerLoop(loop_cfg, Engine(), FakeReplay(TrajectoryBuffer(ReplayConfig())),
                       WeightPublisher(), pad_token_id=0, checkpoint_dir=tmp_path / "ckpt")
    assert loop.resume() is None and store.versions() == [0]  # version 1 is set aside at once
    loop.publish_current()  # version 0 matches
    loop.engine.version = 1  # what the next step would publish
    with pytest.raises(VersionMismatchError, match="policy version 1"):
        loop.publish_current()
    assert store.versions() == [0] and loop.publisher.version == 0


def test_lockstep_learner_process_runs_deterministic_kernels(monkeypatch, tmp_path):
    from gyre.learner.config import LearnerConfig
    from gyre.learner.loop_config import LearnerLoopConfig
    from gyre.learner.versions import prepare_learner_process
    from tests.tiny_model import SMOLLM2_DIR

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    base = {"engine": LearnerConfig(model=str(SMOLLM2_DIR)), "groups_per_step": 2}
    try:
        torch.use_deterministic_algorithms(False)
        prepare_learner_process(LearnerLoopConfig(**base))  # async: nothing changes
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.are_deterministic_algorithms_enabled()
        prepare_learner_process(LearnerLoopConfig(**base, lockstep=lock(tmp_path)))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        with pytest.raises(RuntimeError, match=r"CUBLAS_WORKSPACE_CONFIG is ':0:0'"):
            prepare_learner_process(LearnerLoopConfig(**base, lockstep=lock(tmp_path)))
    finally:
        torch.use_deterministic_algorithms(before)
