"""The learner's determinism seam (``learner.versions``): the loop leases, publishes and starts only through it.

Lockstep: step s leases exactly prompts ``[s·P, (s+1)·P)`` in order (not the groups replay would offer first),
every published version lands in the version store, and the timeline is the shared one. Streamed: no lease
bounds, nothing on disk, a fresh random timeline per incarnation."""

from pathlib import Path

from gyre.learner.versions import LockstepPublishing, StreamedPublishing
from gyre.proto.lockstep import LockstepConfig, VersionStore
from gyre.proto.timeline import SHARED
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from tests.fakes import group_table
from tests.unit.learner.test_learner_loop import FakeLearnerEngine, make_loop


class RecordingReplay:
    """``FakeReplay`` over a buffer that records each ``sample``'s ``prompt_indices``."""

    def __init__(self, buffer: TrajectoryBuffer) -> None:
        self.buffer, self.asked = buffer, []

    def sample(self, num_groups, learner_version, timeout_s, consumer="", prompt_indices=None, request_id=""):
        self.asked.append(prompt_indices)
        return self.buffer.sample(num_groups, learner_version, timeout_s, consumer, prompt_indices, request_id)

    def ack(self, lease_ids):
        self.buffer.ack(lease_ids)

    def rejoin(self, consumer, learner_version, timeline=0):
        return 0


def _loop(tmp_path: Path, lockstep: LockstepConfig | None):
    buf = TrajectoryBuffer(ReplayConfig())
    for i in (5, 4, 3, 2, 1, 0):  # inserted newest prompt first: an unbounded lease would take 5 and 4 first
        buf.insert(group_table(i, rewards=[0.0, 1.0, 1.0, 0.0]))
    loop, pub = make_loop(buf, checkpoint_dir=None, lockstep=lockstep, resume="none")
    loop.replay = RecordingReplay(buf)
    return loop


def test_a_lockstep_learner_leases_its_steps_prompts_in_order_and_stores_every_version(tmp_path):
    cfg = LockstepConfig(lag=1, groups_per_step=2, seed=0, weights_dir=str(tmp_path / "weights"))
    loop = _loop(tmp_path, cfg)
    assert isinstance(loop.versions, LockstepPublishing) and loop.timeline == SHARED
    loop.resume()
    loop.publish_current()
    for _ in range(3):
        loop.step()
    assert loop.replay.asked == [[0, 1], [2, 3], [4, 5]]
    assert VersionStore(cfg.weights_dir, keep=3).versions() == [1, 2, 3]  # keep = lag + 2
    assert len(loop.engine.batches) == 3


def test_a_streamed_learner_leases_unbounded_on_its_own_timeline_and_writes_nothing(tmp_path):
    loop = _loop(tmp_path, None)
    assert isinstance(loop.versions, StreamedPublishing) and loop.timeline != SHARED
    assert _loop(tmp_path, None).timeline != loop.timeline  # each incarnation its own
    loop.resume()
    loop.publish_current()
    loop.step()
    assert loop.replay.asked == [None]
    assert not (tmp_path / "weights").exists()
    assert len(loop.engine.batches) == 1 and isinstance(loop.engine, FakeLearnerEngine)
