import json

import pytest

from gyre.proto.journal import Journal, JournalError, read_journal


def test_append_writes_one_json_line_per_event_and_reads_back(tmp_path):
    path = tmp_path / "sub" / "j.jsonl"
    j = Journal(path)
    j.append({"event": "commit", "step": 2, "groups": ["0-0", "1-0"]})
    j.append({"event": "resume", "step": 2, "path": None})
    j.close()
    assert path.read_text().splitlines() == ['{"event":"commit","step":2,"groups":["0-0","1-0"]}',
                                             '{"event":"resume","step":2,"path":null}']
    got = read_journal(path)
    assert got.events == [{"event": "commit", "step": 2, "groups": ["0-0", "1-0"]},
                          {"event": "resume", "step": 2, "path": None}]
    assert got.torn_tail is False


def test_an_event_without_a_string_event_key_is_refused(tmp_path):
    j = Journal(tmp_path / "j.jsonl")
    with pytest.raises(ValueError, match="must have a string 'event' key"):
        j.append({"step": 1})
    with pytest.raises(ValueError):
        j.append({"event": "x", "v": float("nan")})
    assert (tmp_path / "j.jsonl").read_bytes() == b""


def test_a_torn_last_line_is_skipped_and_cut_off_when_the_journal_reopens(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"event":"acked","accepted":4}\n{"event":"wei')
    got = read_journal(path)
    assert got.events == [{"event": "acked", "accepted": 4}] and got.torn_tail is True
    j = Journal(path)  # a restarted writer: the torn tail must not glue onto the next line
    assert j.truncated_bytes == len(b'{"event":"wei')
    j.append({"event": "weights", "version": 3, "pid": 7})
    got = read_journal(path)
    assert [e["event"] for e in got.events] == ["acked", "weights"] and got.torn_tail is False


def test_an_unterminated_last_line_does_not_count_even_if_it_parses(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"event":"a"}\n{"event":"b"}')
    got = read_journal(path)
    assert got.events == [{"event": "a"}] and got.torn_tail


def test_a_garbage_line_in_the_middle_is_a_named_error(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"event":"a"}\n\x00\x13garbage\n{"event":"b"}\n')
    with pytest.raises(JournalError, match=r"j.jsonl: line 2 is not valid JSON"):
        read_journal(path)
    path.write_bytes(b'{"event":"a"}\n[1, 2]\n')
    with pytest.raises(JournalError, match=r"line 2 is not an event object"):
        read_journal(path)


def test_lines_are_plain_json(tmp_path):
    path = tmp_path / "j.jsonl"
    Journal(path).append({"event": "weights", "version": 1, "pid": 9})
    assert json.loads(path.read_text()) == {"event": "weights", "version": 1, "pid": 9}


def test_a_rollouts_replay_link_journals_each_acknowledged_insert(tmp_path):
    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig
    from gyre.services.common.replay_links import TrackedReplay
    from tests.fakes import FakeReplay, group_table

    buf = TrajectoryBuffer(ReplayConfig(max_staleness=0))
    link = TrackedReplay(FakeReplay(buf), Journal(tmp_path / "rollout-0.jsonl"), connect=lambda address: None)
    link.insert(group_table(3, spans=([0, 1], [0, 2])))
    link.insert(group_table(3))  # a retry: replay answers duplicates
    buf.sample(1, 5)  # learner version 5: a version-0 group is now too stale at insert
    link.insert(group_table(4))
    events = read_journal(tmp_path / "rollout-0.jsonl").events
    assert [(e["accepted"], e["duplicates"], e["dropped_stale"]) for e in events] == [(4, 0, 0), (0, 4, 0), (0, 0, 4)]
    assert [{k: g[k] for k in ("group_id", "prompt_index", "rows", "newest_version", "status")}
            for e in events for g in e["groups"]] == [
        {"group_id": "3-0", "prompt_index": 3, "rows": 4, "newest_version": 2, "status": "accepted"},
        {"group_id": "3-0", "prompt_index": 3, "rows": 4, "newest_version": 0, "status": "duplicate"},
        {"group_id": "4-0", "prompt_index": 4, "rows": 4, "newest_version": 0, "status": "dropped_stale"}]
