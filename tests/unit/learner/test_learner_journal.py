"""The learner's run journal (``learner.run_journal``) as written by ``LearnerLoop``."""

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.config import LearnerConfig
from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
from gyre.learner.publisher import WeightPublisher
from gyre.learner.run_journal import LearnerJournal
from gyre.proto.journal import read_journal
from tests.fakes import FakeReplay
from tests.tiny_model import SMOLLM2_DIR
from tests.unit.learner.test_learner_loop import CommittingEngine, filled_buffer, make_loop


class JournalCheckingReplay(FakeReplay):
    """Records, at every ack, the journal's last event: the commit must be journaled before the ack."""

    def __init__(self, buffer, journal_path) -> None:
        super().__init__(buffer)
        self.journal_path, self.last_event_at_ack = journal_path, []

    def ack(self, lease_ids):
        self.last_event_at_ack.append(read_journal(self.journal_path).events[-1])
        return super().ack(lease_ids)


class GroupStoringEngine(CommittingEngine):
    """``CommittingEngine`` that also stores ``pending_group_ids`` in the checkpoint metadata (as
    ``LearnerEngine`` does)."""

    stores_group_ids = True


def committing_loop(buf, tmp_path, engine_cls=CommittingEngine, **kw):
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, save_interval=1, **kw)
    journal = tmp_path / "learner_journal.jsonl"
    replay = JournalCheckingReplay(buf, journal)
    loop = LearnerLoop(cfg, engine_cls(), replay, WeightPublisher(), 0, tmp_path / "checkpoints", journal)
    return loop, replay, journal


def events(path, kind=None):
    return [e for e in read_journal(path).events if kind is None or e["event"] == kind]


def test_commit_events_carry_the_trained_group_ids_and_precede_the_ack(tmp_path):
    buf = filled_buffer(4)
    loop, replay, journal = committing_loop(buf, tmp_path)
    loop.step()
    loop.step()
    commits = events(journal, "commit")
    assert [(c["step"], c["policy_version"], c["groups"]) for c in commits] == [(1, 1, ["0-0", "1-0"]),
                                                                               (2, 2, ["2-0", "3-0"])]
    assert [e["event"] for e in events(journal)] == ["save_begin", "commit", "save_begin", "commit"]
    assert [(e["event"], e["step"]) for e in replay.last_event_at_ack] == [("commit", 1), ("commit", 2)]
    assert buf.info()["acked_groups_total"] == 4


def test_groups_of_several_steps_go_into_the_checkpoint_that_covers_them(tmp_path):
    buf = filled_buffer(6)
    loop, _, journal = committing_loop(buf, tmp_path)
    loop.config = loop.config.model_copy(update={"save_interval": 3})
    for _ in range(3):
        loop.step()
    (commit,) = events(journal, "commit")
    assert commit["step"] == 3 and commit["groups"] == ["0-0", "1-0", "2-0", "3-0", "4-0", "5-0"]


def test_resume_reappends_a_commit_event_a_crash_cut_off(tmp_path):
    buf = filled_buffer(4)
    loop, _, journal = committing_loop(buf, tmp_path)
    loop.step()
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))  # the crash came between the commit and its journal append
    fresh, _, _ = committing_loop(buf, tmp_path)
    assert fresh.resume() == tmp_path / "checkpoints" / "global_step_1"
    tail = events(journal)[-2:]
    assert (tail[0]["event"], tail[0]["step"], tail[0]["groups"], tail[0]["reappended"]) == ("commit", 1, ["0-0", "1-0"],
                                                                                            True)
    assert (tail[1]["event"], tail[1]["step"], tail[1]["rejected"], tail[1]["newest_committed_seen"]) == \
        ("resume", 1, [], 1)
    again, _, _ = committing_loop(buf, tmp_path)  # the journal has it now: not appended twice
    again.resume()
    assert len(events(journal, "commit")) == 1 and len(events(journal, "resume")) == 2


def test_resume_reappends_from_the_checkpoint_metadata_when_the_journal_has_nothing(tmp_path):
    buf = filled_buffer(4)
    loop, _, journal = committing_loop(buf, tmp_path, engine_cls=GroupStoringEngine)
    loop.step()
    assert ckpt.verify(tmp_path / "checkpoints" / "global_step_1").pending_group_ids == ["0-0", "1-0"]
    journal.write_text("")  # neither save_begin nor commit reached the disk
    fresh, _, _ = committing_loop(buf, tmp_path, engine_cls=GroupStoringEngine)
    fresh.resume()
    (commit,) = events(journal, "commit")
    assert commit["step"] == 1 and commit["groups"] == ["0-0", "1-0"]


def test_resume_names_the_newer_checkpoints_that_failed_verification(tmp_path):
    buf = filled_buffer(4)
    loop, _, journal = committing_loop(buf, tmp_path)
    loop.step()
    loop.step()
    (tmp_path / "checkpoints" / "global_step_2" / "deepspeed" / "model.pt").write_bytes(b"x" * 1024)
    fresh, _, _ = committing_loop(buf, tmp_path)
    assert fresh.resume() == tmp_path / "checkpoints" / "global_step_1"
    resume = events(journal, "resume")[-1]
    assert (resume["step"], resume["policy_version"], resume["newest_committed_seen"]) == (1, 1, 2)
    (rejected,) = resume["rejected"]
    assert rejected["step"] == 2 and "model.pt sha256 does not match" in rejected["error"]


def test_cold_start_journals_a_resume_at_step_zero(tmp_path):
    buf = filled_buffer(2)
    loop, _, journal = committing_loop(buf, tmp_path)
    assert loop.resume() is None
    (resume,) = events(journal)
    assert {k: resume[k] for k in ("event", "step", "policy_version", "path", "mode", "rejected")} == \
        {"event": "resume", "step": 0, "policy_version": 0, "path": None, "mode": "auto", "rejected": []}


def test_async_save_journals_the_commit_only_after_the_background_commit(tmp_path):
    buf = filled_buffer(6)
    journal = tmp_path / "learner_journal.jsonl"
    loop, _ = make_loop(buf, save_interval=2, async_save=True, sample_timeout_s=5)
    loop.journal = LearnerJournal(journal)  # make_loop's fake engine has no real checkpoint dir
    loop.step()
    loop.step()  # the save of step 2 starts in the background
    assert [e["event"] for e in events(journal)] == ["save_begin"]
    loop.engine.futures[0].set_result(loop.engine.future_paths[0])
    loop.step()  # its commit finished: journaled, then acked
    (commit,) = events(journal, "commit")
    assert (commit["step"], commit["groups"]) == (2, ["0-0", "1-0", "2-0", "3-0"])
    assert buf.info()["acked_groups_total"] == 4
