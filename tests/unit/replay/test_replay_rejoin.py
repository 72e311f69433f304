"""A learner resumed from an older checkpoint rejoins replay: its leftover leases go back to the pool
and replay's learner version follows the checkpoint down, so fresh groups are not dropped as stale."""

import pytest

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def test_rejoin_lowers_the_learner_version_so_fresh_groups_are_accepted_again():
    buf = TrajectoryBuffer(ReplayConfig(max_staleness=1))
    buf.insert(group_table(0, version=4))
    assert buf.sample(1, learner_version=5, consumer="learner") is not None  # learner reached version 5
    late = buf.insert(group_table(1, version=3))
    assert late.dropped_stale == late_rows(late) and buf.info()["learner_version"] == 5
    # the learner crashes and resumes from its step-3 checkpoint: version 3 groups are fresh again
    assert buf.rejoin("learner", 3) == 1  # the lease it took at version 5 was never trained on
    assert buf.info()["learner_version"] == 3 and buf.info()["active_leases"] == 0
    fresh = buf.insert(group_table(2, version=3))
    assert fresh.accepted == group_table(2).num_rows and fresh.dropped_stale == 0
    assert buf.sample(1, learner_version=3, consumer="learner") is not None


def late_rows(result) -> int:
    return result.dropped_stale + result.accepted


def test_rejoin_releases_only_that_consumers_leases():
    buf = TrajectoryBuffer(ReplayConfig())
    for i in range(3):
        buf.insert(group_table(i))
    mine, _ = buf.sample(1, 0, consumer="learner")
    buf.sample(1, 0, consumer="evaluator")
    assert buf.rejoin("learner", 0) == 1
    assert buf.info()["active_leases"] == 1 and buf.info()["leased_groups"] == 1
    with pytest.raises(KeyError, match=mine):  # the released lease can no longer be acked
        buf.ack([mine])
    assert buf.rejoin("learner", 0) == 0  # idempotent


@pytest.mark.parametrize("consumer, version, match", [("", 1, "consumer"), ("learner", -1, r"learner_version \(-1\)")])
def test_rejoin_refuses_bad_input_and_changes_nothing(consumer, version, match):
    buf = TrajectoryBuffer(ReplayConfig())
    buf.insert(group_table(0))
    buf.sample(1, 4, consumer="learner")
    before = buf.info()
    with pytest.raises(ValueError, match=match):
        buf.rejoin(consumer, version)
    after = buf.info()
    assert {k: v for k, v in after.items() if not k.endswith("_per_s")} == \
        {k: v for k, v in before.items() if not k.endswith("_per_s")}


def test_rejoin_is_durable_across_a_replay_restart(tmp_path):
    cfg = ReplayConfig(dir=str(tmp_path), seed=0, max_staleness=1, snapshot=NO_AUTO)
    buf = TrajectoryBuffer(cfg)
    buf.insert(group_table(0))
    buf.sample(1, 6, consumer="learner")
    buf.rejoin("learner", 2)
    buf.close()
    restored = TrajectoryBuffer(cfg)
    info = restored.info()
    assert info["learner_version"] == 2 and info["active_leases"] == 0
    assert restored.insert(group_table(1, version=1)).dropped_stale == 0  # lag 1 at version 2: fresh
    restored.close()


def test_an_ack_repeated_after_a_restart_is_idempotent(tmp_path):
    """Replay logged an ack and died before answering; the learner retries it against the restarted replay:
    answered 0 (not NOT_FOUND, which used to fail the learner), and nothing changes."""
    cfg = ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO)
    buf = TrajectoryBuffer(cfg)
    buf.insert(group_table(0))
    buf.insert(group_table(1))
    lease, _ = buf.sample(1, 0, consumer="learner")
    assert buf.ack([lease]) == 1
    buf.snapshot()  # remembered through a snapshot as well as the WAL
    buf.close()
    restored = TrajectoryBuffer(cfg)
    before = restored.info()["acked_groups_total"]
    assert restored.ack([lease]) == 0 and restored.ack([lease, lease]) == 0
    assert restored.info()["acked_groups_total"] == before == 1
    with pytest.raises(KeyError, match="unknown lease id 'never-issued'"):
        restored.ack([lease, "never-issued"])
    with pytest.raises(KeyError, match="unknown lease id"):
        restored.release([lease])  # a release of an acked lease is still an error
    restored.close()


def test_a_new_learner_timeline_drops_the_crashed_learners_later_versions_durably(tmp_path):
    """Learner A (timeline 111) crashes after version 7; B (222) resumes from A's step-4 checkpoint. A's groups
    above version 4 were sampled by weights B never had (same numbers, other weights): deleted at B's rejoin and
    dropped when they arrive late; A's groups up to 4 (B's history), version 0 and B's own are kept. The
    retirement survives a replay restart (snapshot, then WAL)."""
    A, B, NEXT = 111, 222, 333
    cfg = ReplayConfig(dir=str(tmp_path), seed=0, max_staleness=10, snapshot=NO_AUTO)
    buf = TrajectoryBuffer(cfg)
    buf.rejoin("learner", 0, timeline=A)
    for prompt, version, timeline in [(0, 2, A), (1, 5, A), (2, 0, 0), (3, 7, A)]:
        buf.insert(group_table(prompt, version=version, timeline=timeline))
    buf.snapshot()
    buf.rejoin("learner", 4, timeline=B)
    rows = group_table(0).num_rows
    assert buf.info()["dead_timeline_total"] == 2 * rows and buf.info()["stored_groups"] == 2  # prompts 1, 3 gone
    late = buf.insert(group_table(4, version=6, timeline=A))
    assert (late.accepted, late.dropped_stale) == (0, rows)
    for prompt, version, timeline in [(5, 3, A), (6, 5, B), (7, 9, NEXT)]:  # ancestor, current, not yet rejoined
        assert buf.insert(group_table(prompt, version=version, timeline=timeline)).accepted == rows
    buf.close()
    restored = TrajectoryBuffer(cfg)  # the snapshot (A current), then the WAL: B's rejoin retires A again
    assert restored.info()["stored_groups"] == 5 and restored.info()["dead_timeline_total"] == 3 * rows
    assert restored.insert(group_table(8, version=5, timeline=A)).dropped_stale == rows
    restored.snapshot()
    restored.close()
    again = TrajectoryBuffer(cfg)  # from the snapshot alone
    assert again.insert(group_table(9, version=5, timeline=A)).dropped_stale == rows
    assert again.insert(group_table(10, version=4, timeline=A)).accepted == rows
    again.close()
