"""``LearnerLoop.keep_row``: a checkpointed step's metrics row is kept before its checkpoint commits.

The commit is journaled, then the step's leases are acked; an ack that raises (the replay died) or a kill in
between ended ``step`` with the step trained and committed but its row never returned, so no driver and no
``learner_rows.jsonl`` had it, and a resumed run's ``metrics.jsonl`` lacked the step for good (the sweep e2e test
once ended with rows ``[1, 2]`` of 3: ``tests/e2e/test_sweep.py``).
"""

import json

import pytest

from gyre.learner.config import LearnerConfig
from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
from gyre.learner.publisher import WeightPublisher
from tests.fakes import FakeReplay
from tests.tiny_model import SMOLLM2_DIR
from tests.unit.learner.test_learner_loop import FakeLearnerEngine, filled_buffer


class DyingReplay(FakeReplay):
    """Serves batches; ``ack`` raises like a client whose replay was killed."""

    def ack(self, lease_ids):
        raise ConnectionError("replay unreachable (scripted)")


def _loop(tmp_path, save_interval: int) -> tuple[LearnerLoop, list[dict]]:
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, save_interval=save_interval)
    loop = LearnerLoop(cfg, FakeLearnerEngine(), DyingReplay(filled_buffer(6)), WeightPublisher(), pad_token_id=0,
                       checkpoint_dir=tmp_path / "ckpt", journal_path=tmp_path / "learner_journal.jsonl")
    kept: list[dict] = []
    loop.keep_row = kept.append
    return loop, kept


def test_a_step_whose_ack_fails_after_the_commit_has_kept_its_row(tmp_path):
    loop, kept = _loop(tmp_path, save_interval=1)
    with pytest.raises(ConnectionError):
        loop.step()
    journal = [json.loads(line) for line in (tmp_path / "learner_journal.jsonl").read_text().splitlines()]
    assert [e["step"] for e in journal if e["event"] == "commit"] == [1]  # the step is committed…
    (row,) = kept  # …and its row was kept before: a resumed run recovers it
    assert (row["step"], row["version"], row["loss"], row["before_checkpoint"]) == (1, 1, 0.5, True)
    assert "checkpoint_s" not in row


def test_a_step_without_a_checkpoint_keeps_no_early_row(tmp_path):
    loop, kept = _loop(tmp_path, save_interval=2)
    row = loop.step()  # no checkpoint due: the actor keeps the returned row, once
    assert kept == [] and row["step"] == 1 and "before_checkpoint" not in row
