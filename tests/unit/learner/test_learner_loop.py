import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from gyre.learner.checkpoint.request import CheckpointRequest, commit_request
from gyre.learner.config import LearnerConfig
from gyre.learner.loop import LearnerLoop, LearnerLoopConfig, NoDataError
from gyre.learner.publisher import WeightPublisher
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from tests.fakes import FakeReplay, group_table
from tests.tiny_model import SMOLLM2_DIR


def checked(request) -> CheckpointRequest:
    """``request`` if it is what the production engines take (``LearnerEngine`` and, with several ranks,
    ``LeaderEngine``: ``save_checkpoint(request: CheckpointRequest)``), so the test engines cannot drift."""
    assert isinstance(request, CheckpointRequest), f"save_checkpoint got {type(request).__name__}"
    return request


class FakeLearnerEngine:
    """Records each save as ``(step, pending_lease_ids, acked_lease_count)`` in ``saves``; with a ``saver``
    it returns a ``Future`` the test settles."""

    def __init__(self):
        self.step = self.version = 0
        self.batches, self.saves = [], []
        self.futures, self.future_paths = [], []

    def train_step(self, batch):
        self.batches.append(batch)
        self.step += 1
        self.version += 1
        return {"loss": 0.5, "reward_mean": float(batch.rewards.mean())}

    def load_checkpoint(self, path, fingerprint="", force=False):
        from gyre.learner.checkpoint.store import verify

        meta = verify(path)
        self.step, self.version = meta.step, meta.policy_version
        return meta

    def save_checkpoint(self, request: CheckpointRequest):
        """The production engines' signature (``checked``)."""
        call = checked(request)
        self.saves.append((self.step, list(call.pending_lease_ids), call.acked_lease_count))
        path = call.root / f"global_step_{self.step}"
        if call.saver is None:
            return path
        self.futures.append(Future())  # the test completes (or fails) it: the background write
        self.future_paths.append(path)
        return self.futures[-1]

    def capture_weights(self):
        return [("w", torch.full((4,), float(self.version)))]


def make_loop(buf, checkpoint_dir=Path("/ckpt"), **kw):
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, **kw)
    pub = WeightPublisher()
    loop = LearnerLoop(cfg, FakeLearnerEngine(), FakeReplay(buf), pub, pad_token_id=0, checkpoint_dir=checkpoint_dir)
    return loop, pub


def filled_buffer(groups: int = 4) -> TrajectoryBuffer:
    buf = TrajectoryBuffer(ReplayConfig())
    for i in range(groups):
        buf.insert(group_table(i, rewards=[0.0, 1.0, 1.0, 0.0]))
    return buf


def test_step_trains_publishes_next_version_and_acks_after_checkpoint():
    buf = filled_buffer()
    loop, pub = make_loop(buf, save_interval=1)
    loop.publish_current()
    assert pub.version == 0
    row = loop.step()
    assert (row["step"], row["version"], row["trajectories"]) == (1, 1, 8) and row["checkpoint_committed"] == 1.0
    loop.background.flush()  # published behind the step
    assert pub.version == 1 and pub.wait_newer(0, 0)[1][0].data == torch.full((4,), 1.0).numpy().tobytes()
    assert buf.info()["acked_groups_total"] == 2 and buf.info()["leased_groups"] == 0
    loop.step()
    loop.background.flush()
    assert pub.version == 2 and buf.info()["acked_groups_total"] == 4
    assert [s[0] for s in loop.engine.saves] == [1, 2]


def test_lease_is_not_acked_before_the_checkpoint_that_holds_it():
    buf = filled_buffer(6)
    loop, _ = make_loop(buf, save_interval=2)
    row = loop.step()
    assert loop.engine.saves == [] and row["pending_leases"] == 1
    assert buf.info()["acked_groups_total"] == 0 and buf.info()["leased_groups"] == 2
    loop.step()  # step 2: checkpoint commits both steps' leases, then acks them
    (saved_step, saved_pending, _), = loop.engine.saves
    assert saved_step == 2 and len(saved_pending) == 2
    assert buf.info()["acked_groups_total"] == 4 and buf.info()["leased_groups"] == 0
    loop.step()
    assert buf.info()["acked_groups_total"] == 4 and loop.pending_lease_ids
    loop.checkpoint()  # the final checkpoint acks the rest
    assert buf.info()["acked_groups_total"] == 6 and loop.acked_lease_count == 3
    loop.checkpoint()  # nothing new: no second save of step 3
    assert [s[0] for s in loop.engine.saves] == [2, 3]


def test_without_checkpoint_dir_nothing_is_acked():
    buf = filled_buffer()
    loop, _ = make_loop(buf, checkpoint_dir=None, save_interval=1)
    loop.step()
    assert buf.info()["acked_groups_total"] == 0 and loop.engine.saves == []
    with pytest.raises(RuntimeError, match="no checkpoint_dir"):
        loop.checkpoint()


def test_no_batch_within_timeout_is_a_clear_error():
    loop, _ = make_loop(TrajectoryBuffer(ReplayConfig()), sample_timeout_s=0.3)
    with pytest.raises(NoDataError, match="no batch of 2 groups within 0.3s at learner version 0"):
        loop.step()


def test_restore_acks_the_checkpoints_pending_leases_and_skips_unknown_ones():
    from gyre.learner.checkpoint.store import CheckpointMetadata

    buf = filled_buffer()
    lease_id, _ = buf.sample(2, 0)
    loop, _ = make_loop(buf)
    loop.restore(CheckpointMetadata(step=5, policy_version=5, pending_lease_ids=[lease_id, "gone"],
                                    acked_lease_count=4))
    assert buf.info()["acked_groups_total"] == 2 and loop.acked_lease_count == 5


def test_sigusr1_checkpoints_and_continues_sigterm_checkpoints_and_stops():
    import os
    import signal

    from gyre.learner.loop import StopRequested

    buf = filled_buffer(6)
    loop, _ = make_loop(buf, save_interval=100)
    previous = loop.install_signal_handlers()
    try:
        loop.step()
        assert loop.engine.saves == []
        os.kill(os.getpid(), signal.SIGUSR1)
        loop.step()  # the step in flight finishes, then the emergency checkpoint commits and acks
        assert [s[0] for s in loop.engine.saves] == [2] and buf.info()["acked_groups_total"] == 4
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(StopRequested) as stop:
            loop.step()
        assert stop.value.code == 0
        assert [s[0] for s in loop.engine.saves] == [2, 3] and buf.info()["acked_groups_total"] == 6
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_resume_auto_loads_the_newest_verified_checkpoint_and_acks_its_pending_leases(tmp_path):
    from gyre.learner.checkpoint import store as ckpt

    buf = filled_buffer()
    lease_id, _ = buf.sample(2, 0)
    loop, _ = make_loop(buf, checkpoint_dir=tmp_path)
    assert loop.resume() is None and loop.engine.version == 0  # nothing there: cold start
    tmp = ckpt.temp_path(tmp_path, 7)
    tmp.mkdir(parents=True)
    ckpt.commit(tmp, ckpt.checkpoint_path(tmp_path, 7),
                ckpt.CheckpointMetadata(step=7, policy_version=7, pending_lease_ids=[lease_id]))
    assert loop.resume() == tmp_path / "global_step_7"
    assert loop.engine.version == 7 and buf.info()["acked_groups_total"] == 0  # resume talks to no replay
    assert loop.rejoin_replay() == 0  # the first step does this: ack the checkpoint's leases, then rejoin
    assert buf.info()["acked_groups_total"] == 2
    none_loop, _ = make_loop(buf, checkpoint_dir=tmp_path, resume="none")
    assert none_loop.resume() is None and none_loop.engine.version == 0


def test_resume_from_an_older_checkpoint_rejoins_replay_so_training_goes_on(tmp_path):
    """The learner trained to version 5, checkpointed at 3 and crashed: replay must follow it back to 3
    (else groups generated at version 3 are dropped as stale: a stall) and free the lease it took after."""
    from gyre.learner.checkpoint import store as ckpt

    buf = TrajectoryBuffer(ReplayConfig(max_staleness=1))
    buf.insert(group_table(0, version=4))
    orphan, _ = buf.sample(1, 5, consumer="learner")  # taken after the checkpoint, never acked
    tmp = ckpt.temp_path(tmp_path, 3)
    tmp.mkdir(parents=True)
    ckpt.commit(tmp, ckpt.checkpoint_path(tmp_path, 3), ckpt.CheckpointMetadata(step=3, policy_version=3))
    loop, _ = make_loop(buf, checkpoint_dir=tmp_path)
    assert loop.resume() == tmp_path / "global_step_3"
    assert loop.rejoin_replay() == 1
    assert buf.info()["learner_version"] == 3 and buf.info()["active_leases"] == 0
    assert buf.insert(group_table(1, version=2)).dropped_stale == 0
    loop.step()  # both groups (the released one and the fresh one) are trainable at version 3
    assert loop.engine.version == 4 and len(loop.engine.batches) == 1


def test_async_save_acks_its_leases_only_after_the_background_commit():
    buf = filled_buffer(6)
    loop, _ = make_loop(buf, save_interval=2, async_save=True, sample_timeout_s=5)
    engine = loop.engine
    loop.step()
    row = loop.step()  # step 2: the save starts in the background; training is not blocked on it
    assert [s[0] for s in engine.saves] == [2] and len(engine.saves[0][1]) == 2
    assert buf.info()["acked_groups_total"] == 0 and "checkpoint_write_s" not in row
    assert loop.last_checkpoint is None and not loop.pending_lease_ids
    engine.futures[0].set_result(engine.future_paths[0])
    row = loop.step()  # step 3: the commit has finished -> its 2 leases are acked, step 3's stays pending
    assert "checkpoint_write_s" in row and buf.info()["acked_groups_total"] == 4
    assert row["checkpoint_committed"] == 1.0
    assert loop.last_checkpoint.name == "global_step_2" and len(loop.pending_lease_ids) == 1


def test_a_failed_async_save_returns_its_leases_to_the_next_checkpoint():
    buf = filled_buffer(6)
    loop, _ = make_loop(buf, save_interval=2, async_save=True, sample_timeout_s=5)
    engine = loop.engine
    loop.step()
    loop.step()
    first_leases = engine.saves[0][1]
    engine.futures[0].set_exception(OSError(28, "No space left on device"))
    row = loop.step()
    assert row["checkpoint_failed"] == 1.0 and buf.info()["acked_groups_total"] == 0
    assert loop.pending_lease_ids[:2] == first_leases and loop.last_checkpoint is None
    _complete_soon(engine, 1)
    loop.checkpoint()  # the final (waited-for) checkpoint covers all three steps' leases
    assert engine.saves[1][1][:2] == first_leases and len(engine.saves[1][1]) == 3
    assert buf.info()["acked_groups_total"] == 6 and loop.last_checkpoint.name == "global_step_3"


def test_checkpoint_wait_raises_what_the_background_write_raised():
    buf = filled_buffer(4)
    loop, _ = make_loop(buf, save_interval=100, async_save=True, sample_timeout_s=5)
    loop.step()
    _complete_soon(loop.engine, 0, OSError(5, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error"):
        loop.checkpoint(wait=True)
    assert loop.pending_lease_ids and buf.info()["acked_groups_total"] == 0


def _complete_soon(engine, index: int, error: Exception | None = None) -> None:
    """From another thread, finish the ``index``-th background save once it exists (as the writer would)."""
    import threading

    def finish():
        while len(engine.futures) <= index:
            time.sleep(0.01)
        if error is None:
            engine.futures[index].set_result(engine.future_paths[index])
        else:
            engine.futures[index].set_exception(error)

    threading.Thread(target=finish, daemon=True).start()


def test_save_schedule_changes_the_interval_by_step_range():
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), save_interval=10,
                            save_schedule=[{"from_step": 0, "interval": 2}, {"from_step": 6, "interval": 5}])
    due = [s for s in range(1, 21) if s % cfg.save_interval_at(s) == 0]
    assert due == [2, 4, 10, 15, 20]
    plain = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), save_interval=10)
    assert [s for s in range(1, 31) if s % plain.save_interval_at(s) == 0] == [10, 20, 30]
    with pytest.raises(ValueError, match=r"save_schedule from_step values \[5, 0\] must be strictly increasing"):
        LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)),
                          save_schedule=[{"from_step": 5, "interval": 2}, {"from_step": 0, "interval": 5}])


class CommittingEngine(FakeLearnerEngine):
    """Commits a real (tiny) checkpoint with the real protocol, so mirror/archive/resume act on real files.
    Its metadata has ``pending_group_ids`` only with ``stores_group_ids`` (else: as written before that field)."""

    stores_group_ids = False

    def save_checkpoint(self, request: CheckpointRequest):
        from gyre.learner.checkpoint import store as ckpt

        call = checked(request)
        root, leases = call.root, list(call.pending_lease_ids)
        self.saves.append((self.step, leases, call.acked_lease_count))
        tmp = ckpt.temp_path(root, self.step)
        (tmp / "deepspeed").mkdir(parents=True)
        (tmp / "deepspeed" / "model.pt").write_bytes(bytes([self.step]) * 1024)
        groups = list(call.pending_group_ids) if self.stores_group_ids else []
        return commit_request(tmp, ckpt.checkpoint_path(root, self.step),
                              ckpt.CheckpointMetadata(step=self.step, policy_version=self.version,
                                                      pending_lease_ids=leases, pending_group_ids=groups), call)


def test_checkpoints_are_mirrored_before_the_ack_and_archived_after(tmp_path):
    import shutil

    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.archive import list_archived

    buf = filled_buffer(6)
    archive = {"url": f"file://{tmp_path / 'archive'}", "keep_last_n": 2}
    cfg = dict(save_interval=1, keep_last_n=2, mirror_dir=str(tmp_path / "mirror"), archive=archive)
    loop = LearnerLoop(LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, **cfg),
                       CommittingEngine(), FakeReplay(buf), WeightPublisher(), 0, tmp_path / "primary")
    for _ in range(3):
        loop.step()
    loop.wait_for_uploads(60)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "mirror")] == ["global_step_2", "global_step_3"]
    assert ckpt.verify(tmp_path / "mirror" / "global_step_3").step == 3
    assert list_archived(loop.config.archive) == [2, 3] and loop.tier_failures == 0
    assert buf.info()["acked_groups_total"] == 6

    # The primary copy of step 3 is corrupt: resume picks the mirror's and repairs the primary.
    (tmp_path / "primary" / "global_step_3" / "deepspeed" / "model.pt").write_bytes(b"x" * 1024)
    fresh = LearnerLoop(loop.config, CommittingEngine(), FakeReplay(buf), WeightPublisher(), 0, tmp_path / "primary")
    assert fresh.resume() == tmp_path / "primary" / "global_step_3" and fresh.engine.step == 3
    ckpt.verify(tmp_path / "primary" / "global_step_3")

    # No local copy at all: resume fetches the newest archived checkpoint.
    shutil.rmtree(tmp_path / "primary")
    shutil.rmtree(tmp_path / "mirror")
    fresh = LearnerLoop(loop.config, CommittingEngine(), FakeReplay(buf), WeightPublisher(), 0, tmp_path / "primary")
    assert fresh.resume() == tmp_path / "primary" / "global_step_3" and fresh.engine.version == 3


def test_a_failing_mirror_is_logged_and_training_goes_on(tmp_path):
    buf = filled_buffer(4)
    (tmp_path / "not-a-dir").write_text("a file where the mirror directory should be")
    cfg = dict(save_interval=1, mirror_dir=str(tmp_path / "not-a-dir"))
    loop = LearnerLoop(LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, **cfg),
                       CommittingEngine(), FakeReplay(buf), WeightPublisher(), 0, tmp_path / "primary")
    loop.step()
    assert loop.tier_failures == 1 and buf.info()["acked_groups_total"] == 2


def test_rejoin_waits_for_replay_and_never_releases_a_lease_the_checkpoint_trained_on(tmp_path):
    """Replay is down when the restarted learner first steps: the ack fails, so nothing is released (the
    lease the checkpoint covers must be acked, not returned to the pool); the next attempt does both."""
    from gyre.learner.checkpoint import store as ckpt

    buf = filled_buffer()
    trained, _ = buf.sample(2, 0, consumer="learner")  # committed in the checkpoint, ack lost in the crash
    tmp = ckpt.temp_path(tmp_path, 1)
    tmp.mkdir(parents=True)
    ckpt.commit(tmp, ckpt.checkpoint_path(tmp_path, 1),
                ckpt.CheckpointMetadata(step=1, policy_version=1, pending_lease_ids=[trained]))
    loop, _ = make_loop(buf, checkpoint_dir=tmp_path)
    loop.resume()
    real_ack = loop.replay.ack
    loop.replay.ack = lambda ids: (_ for _ in ()).throw(ConnectionError("replay down"))
    with pytest.raises(ConnectionError):
        loop.step()
    assert buf.info()["active_leases"] == 1 and buf.info()["acked_groups_total"] == 0  # nothing released
    loop.replay.ack = real_ack
    loop.step()
    assert buf.info()["acked_groups_total"] == 2 and loop.engine.version == 2


def test_an_archive_upload_slower_than_training_still_finds_its_checkpoint(tmp_path, monkeypatch):
    # The archive uploader lags three steps behind (as on a loaded machine, or a slow bucket): with keep_last_n 2
    # the primary used to prune global_step_1 before its upload read it ("manifest.json is missing"), a tier
    # failure; test_checkpoints_are_mirrored_before_the_ack_and_archived_after failed that way under load. The
    # primary now keeps a checkpoint until its upload ended; a later commit's prune takes it.
    import threading

    from gyre.learner.checkpoint import archive as archive_mod
    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.archive import list_archived

    gate, real = threading.Event(), archive_mod.archive_checkpoint

    def held(path, cfg):
        gate.wait(30)
        return real(path, cfg)

    monkeypatch.setattr(archive_mod, "archive_checkpoint", held)
    buf = filled_buffer(6)
    archive = {"url": f"file://{tmp_path / 'archive'}", "keep_last_n": 4}
    config = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, save_interval=1,
                               keep_last_n=2, archive=archive)
    loop = LearnerLoop(config, CommittingEngine(), FakeReplay(buf), WeightPublisher(), 0, tmp_path / "primary")
    for _ in range(3):
        loop.step()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "primary")] == [f"global_step_{i}" for i in (1, 2, 3)]
    gate.set()
    loop.wait_for_uploads(60)
    assert loop.tier_failures == 0 and list_archived(loop.config.archive) == [1, 2, 3]
    assert loop.checkpoints.archive.pending() == frozenset()  # the next commit's prune may take global_step_1 now
    assert [p.name for p in ckpt.prune(tmp_path / "primary", 2, loop.checkpoints.archive.pending())] == ["global_step_1"]
