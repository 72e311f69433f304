"""``gyre check``: a synthetic run directory (real replay dir, journals written by the real writers) passes,
and each planted violation is reported as exactly that kind, naming what broke."""

import hashlib
import json
from pathlib import Path

import pytest

from gyre.learner.run_journal import LearnerJournal
from gyre.proto.journal import Journal
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.cli.invariants import KINDS, RunDirError, check_run
from gyre.services.common.replay_links import acked_event
from tests.fakes import group_table


def _resume(step, rejected=(), mode="auto"):
    return {"event": "resume", "step": step, "policy_version": step, "path": None if step == 0 else f"global_step_{step}",
            "mode": mode, "newest_committed_seen": None, "rejected": [{"step": s, "path": "x", "error": "corrupt"}
                                                                     for s in rejected]}


def make_run(root: Path, ack_second: bool = True, replay_cfg: dict | None = None) -> Path:
    """Six groups (prompts 0-5) from two rollouts; the learner commits step 1 (0-0, 1-0, acked) and
    step 2 (2-0, 3-0; acked unless ``ack_second`` is False: a crash between commit and ack), then restarts
    and resumes from step 2. Groups 4-0 and 5-0 stay pooled in replay."""
    run = root / "run"
    cfg = dict(replay_cfg or {})
    (run / "rollouts").mkdir(parents=True)
    (run / "recipe.json").write_text(json.dumps({"name": "run", "replay": cfg}))
    buf = TrajectoryBuffer(ReplayConfig(**cfg, dir=str(run / "replay")))
    journals = {r: Journal(run / "rollouts" / f"{r}.jsonl") for r in ("rollout-0", "rollout-1")}
    for r, j in journals.items():
        j.append({"event": "weights", "version": 0, "pid": 100 + int(r[-1])})
    for p in range(6):
        table = group_table(p)
        journals["rollout-0" if p < 3 else "rollout-1"].append(acked_event(table, buf.insert(table)))
    retry = group_table(1)  # a retried insert: replay answers duplicates
    journals["rollout-0"].append(acked_event(retry, buf.insert(retry)))
    journals["rollout-0"].append({"event": "weights", "version": 1, "pid": 100})
    learner = LearnerJournal(run / "learner_journal.jsonl")
    learner.journal.append(_resume(0))
    for step in (1, 2):
        lease, table = buf.sample(2, step - 1, consumer="learner")
        groups = sorted(set(table.column("group_id").to_pylist()))
        learner.save_begin(step, step, groups)
        learner.commit(Path(f"global_step_{step}"), groups)
        if step == 1 or ack_second:
            buf.ack([lease])
    learner.journal.append(_resume(2))
    buf.close()
    return run


def only(report, kind):
    assert [v.kind for v in report.violations] == [kind], report.to_json()
    return report.violations[0].detail


def test_a_clean_run_passes_with_exact_counts(tmp_path):
    report = check_run(make_run(tmp_path))
    assert report.ok, report.to_json()
    c = report.counts
    assert (c["acknowledged_groups"], c["trained_groups"], c["in_replay_groups"], c["lost_groups"]) == (6, 4, 2, 0)
    assert (c["duplicates_trained"], c["prompts_completed"], c["resumes"], c["rollout_version_events"]) == (0, 6, 2, 3)
    assert c["duplicate_acks"] == 1 and c["commits"] == 2
    assert json.loads(report.to_json())["ok"] is True


def test_prompts_still_leased_when_replay_stopped_are_listed_with_their_holder(tmp_path):
    # A rollout killed with prompts leased (not expired yet when the run ended): a resumed run issues them again.
    # The partial-restart e2e reads this to tell such a prompt from a lost one.
    from gyre.services.cli.run_records import load_run

    run = make_run(tmp_path)
    buf = TrajectoryBuffer(ReplayConfig(dir=str(run / "replay")))
    issued = [i for i, _ in buf.lease_prompts("rollout-1", 2, ttl_s=600)]
    buf.close()
    assert len(issued) == 2
    assert load_run(run).ledger_leased == {i: "rollout-1" for i in issued}
    assert load_run(make_run(tmp_path / "clean")).ledger_leased == {}


def test_a_crash_between_commit_and_ack_is_not_a_violation(tmp_path):
    report = check_run(make_run(tmp_path, ack_second=False))
    assert report.ok and report.counts["in_replay_groups"] == 4


def test_lost_group_is_reported(tmp_path):
    run = make_run(tmp_path)
    _rewrite(run / "learner_journal.jsonl", lambda e: {**e, "groups": ["2-0"]} if e.get("step") == 2 and
             e["event"] == "commit" else e)
    detail = only(check_run(run), "lost")
    assert "group 3-0 (prompt 3, acked to rollout-1)" in detail


def test_a_rolled_back_acked_group_is_lost(tmp_path):
    run = make_run(tmp_path)
    Journal(run / "learner_journal.jsonl").append(_resume(1, rejected=[2]))  # newest rejected: allowed resume
    report = check_run(run)
    assert sorted(v.detail for v in report.violations) == [
        f"group {g} (prompt {p}, acked to {r}) is not in replay: trained in checkpoint step 2, rolled back by "
        "resume #3 to step 1" for g, p, r in (("2-0", 2, "rollout-0"), ("3-0", 3, "rollout-1"))]
    assert {v.kind for v in report.violations} == {"lost"} and report.counts["lost_groups"] == 2


def test_trained_twice_is_reported(tmp_path):
    run = make_run(tmp_path)
    Journal(run / "learner_journal.jsonl").append({"event": "commit", "step": 3, "policy_version": 3,
                                                   "groups": ["0-0"]})
    detail = only(check_run(run), "trained_twice")
    assert detail == "group 0-0 trained 2 times (checkpoint steps [1, 3]); replay allows max_times_sampled=1"


def test_a_prompt_accepted_twice_is_reported(tmp_path):
    run = make_run(tmp_path)
    Journal(run / "rollouts" / "rollout-1.jsonl").append(
        {"event": "acked", "groups": [{"group_id": "5-0", "prompt_index": 5, "rows": 4, "newest_version": 0,
                                       "status": "accepted"}], "accepted": 4, "duplicates": 0, "dropped_stale": 0})
    detail = only(check_run(run), "prompt_not_once")
    assert detail == "prompt 5 completed 2 times: 5-0 accepted from rollout-1; 5-0 accepted from rollout-1"


def test_a_prompt_completed_in_the_ledger_with_no_group_is_reported(tmp_path):
    run = make_run(tmp_path)
    buf = TrajectoryBuffer(ReplayConfig(dir=str(run / "replay"), selector="recency"))
    buf.insert(group_table(6))  # nobody journaled this insert, and its group is consumed untrained
    lease, table = buf.sample(1, 2)
    assert table.column("group_id")[0].as_py() == "6-0"
    buf.ack([lease])
    buf.close()
    detail = only(check_run(run), "prompt_not_once")
    assert detail == ("prompt 6 is complete in replay's ledger but no rollout journaled a group for it, replay "
                      "holds none and none was trained")


def test_version_regressed_is_reported(tmp_path):
    run = make_run(tmp_path)
    j = Journal(run / "rollouts" / "rollout-0.jsonl")
    j.append({"event": "weights", "version": 3, "pid": 100})
    j.append({"event": "weights", "version": 2, "pid": 100})
    j.append({"event": "weights", "version": 1, "pid": 555})  # a restarted process may start lower
    assert only(check_run(run), "version_regressed") == ("rollout-0 pid 100 applied policy version 2 after version "
                                                          "3 (timeline 0)")


def test_a_lower_version_of_another_timeline_is_no_regression(tmp_path):
    """A learner resumed from an older checkpoint publishes on a new timeline: a rollout takes its lower
    version (proto.timeline). Within that timeline versions still only rise."""
    run = make_run(tmp_path)
    j = Journal(run / "rollouts" / "rollout-0.jsonl")
    j.append({"event": "weights", "version": 7, "timeline": 111, "pid": 100})
    j.append({"event": "weights", "version": 4, "timeline": 222, "pid": 100})  # the rewind
    j.append({"event": "weights", "version": 5, "timeline": 222, "pid": 100})
    assert check_run(run).ok
    j.append({"event": "weights", "version": 3, "timeline": 222, "pid": 100})
    assert only(check_run(run), "version_regressed") == ("rollout-0 pid 100 applied policy version 3 after version "
                                                          "5 (timeline 222)")


def test_resume_not_newest_is_reported_unless_the_newer_step_was_rejected(tmp_path):
    run = make_run(tmp_path, ack_second=False)  # step 2's groups are still leased: rolling back loses nothing
    Journal(run / "learner_journal.jsonl").append(_resume(1))
    detail = only(check_run(run), "resume_not_newest")
    assert detail == ("resume #3 (mode auto) loaded step 1 but checkpoint step 2 was committed before it and is "
                      "not among the rejected steps []")
    other = make_run(tmp_path / "b", ack_second=False)
    Journal(other / "learner_journal.jsonl").append(_resume(1, rejected=[2]))
    assert check_run(other).ok


def test_groups_dropped_by_the_staleness_gate_are_excused_by_replays_counters(tmp_path):
    run = make_run(tmp_path)
    buf = TrajectoryBuffer(ReplayConfig(dir=str(run / "replay")))
    buf.sample(1, 10)  # learner version 10: pooled groups 4-0 and 5-0 (version 0) are dropped as stale
    buf.close()
    report = check_run(run)
    assert report.ok, report.to_json()
    assert report.counts["dropped_stale_groups"] == 2 and report.counts["replay_dropped_stale_rows"] == 8


def test_groups_of_a_crashed_learners_timeline_deleted_at_rejoin_are_excused_in_exclude_mode(tmp_path):
    run = make_run(tmp_path, replay_cfg={"staleness_mode": "exclude"})
    buf = TrajectoryBuffer(ReplayConfig(staleness_mode="exclude", dir=str(run / "replay")))
    buf.rejoin("learner", 2, timeline=111)
    table = group_table(6, version=5, timeline=111)  # sampled by timeline 111's version 5
    Journal(run / "rollouts" / "rollout-1.jsonl").append(acked_event(table, buf.insert(table)))
    buf.rejoin("learner", 3, timeline=222)  # resumed from step 3: 111's version 5 is dead, deleted
    buf.close()
    report = check_run(run)
    assert report.ok, report.to_json()
    assert report.counts["dropped_stale_groups"] == 1


def test_a_torn_journal_tail_is_tolerated_and_a_garbage_middle_line_is_named(tmp_path):
    run = make_run(tmp_path)
    with open(run / "rollouts" / "rollout-1.jsonl", "ab") as f:
        f.write(b'{"event":"acked","gro')
    report = check_run(run)
    assert report.ok and report.counts["torn_journal_tails"] == 1
    lines = (run / "learner_journal.jsonl").read_bytes().split(b"\n")
    lines.insert(2, b"\x00\x00garbage")
    (run / "learner_journal.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(RunDirError, match=r"learner_journal.jsonl: line 3 is not valid JSON"):
        check_run(run)


def test_checking_does_not_change_the_run_dir(tmp_path):
    run = make_run(tmp_path)
    before = _tree_digest(run)
    check_run(run)
    assert _tree_digest(run) == before


def test_not_a_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(RunDirError, match="is not a run directory"):
        check_run(tmp_path / "nope")
    with pytest.raises(RunDirError, match="no recipe.json"):
        check_run(tmp_path)


def test_cli_check_exit_codes(tmp_path, capsys):
    from gyre.services.cli import main as cli

    run = make_run(tmp_path)
    capsys.readouterr()  # drop what building the run logged
    assert cli.main(["check", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    Journal(run / "rollouts" / "rollout-0.jsonl").append({"event": "weights", "version": 0, "pid": 100})
    assert cli.main(["check", str(run)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [v["kind"] for v in out["violations"]] == ["version_regressed"]
    assert cli.main(["check", str(tmp_path / "missing")]) == 2
    assert "is not a run directory" in capsys.readouterr().out


def test_kinds_are_the_contract():
    assert KINDS == ("lost", "trained_twice", "prompt_not_once", "version_regressed", "resume_not_newest")


def _rewrite(path: Path, change) -> None:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(e)) + "\n" for e in events))


def _tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}
