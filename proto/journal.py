"""Run journals: append-only JSON Lines files that services write and ``gyre check`` reads.

A journal is a file contract (like the ``.proto`` files next to it), so replay, rollout and learner may
import it without importing ``services``. One event per line, a JSON object with an ``"event"`` string;
no pickle. Every ``Journal.append`` writes one whole line with a single ``write`` on an ``O_APPEND``
descriptor and fsyncs it before returning, so an event the caller went on past is on disk.

A crash can only tear the *last* line (a write cut short: no trailing newline). An event counts only
once its newline is written: ``read_journal`` skips an unterminated last line (``JournalRead.torn_tail``)
and ``Journal`` truncates it when it reopens the file, so the next event never glues onto it. Any
terminated line that does not parse is corruption: ``JournalError`` names the file and line number.

Events (what each writer appends; extra keys are allowed, readers ignore what they do not know):

- learner (``{run}/learner_journal.jsonl``): ``save_begin`` {step, policy_version, groups} before a
  checkpoint save starts; ``commit`` {step, policy_version, groups} once it committed, before its leases
  are acked; ``resume`` {step, policy_version, path, newest_committed_seen, rejected: [{step, path,
  error}]} on every start (cold start: step 0, path null).
- rollout (``{run}/rollouts/{rollout_id}.jsonl``): ``acked`` {groups: [{group_id, prompt_index, rows,
  newest_version, status}], accepted, duplicates, dropped_stale} after replay acknowledged an insert
  (counts in rows; ``status``: accepted | duplicate | dropped_stale | mixed); ``weights`` {version, timeline, pid}
  at setup and each time a new policy version is applied.
- controller (``{run}/reward_swaps.jsonl``, ``services.control.commands.reward_swaps``): ``reward_swap`` {id, rewards:
  {task: [reward config]}, versions: {task: reward_fn_version}, time} once every running rollout accepted a
  ``gyre reward swap``, before any applies it; read by every later driver of the run.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from gyre.utils.durable import fsync_path as _fsync_dir

__all__ = ["Journal", "JournalError", "JournalRead", "read_journal"]


class JournalError(ValueError):
    """A newline-terminated journal line is not a JSON event object; the message names the file and
    the 1-based line number."""


@dataclass
class JournalRead:
    """What ``read_journal`` found."""

    events: list[dict] = field(default_factory=list)
    """Every complete event, in file order."""
    torn_tail: bool = False
    """The file ended in an unterminated line (a crash mid-append); it was skipped."""




def _truncate_torn_tail(fd: int) -> int:
    """Cut a partial last line (no trailing newline) off the file open at ``fd``; returns bytes cut."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return 0
    end, pos = 0, size
    while pos > 0 and not end:
        start = max(0, pos - 65536)
        chunk = os.pread(fd, pos - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            end = start + i + 1
        pos = start
    os.ftruncate(fd, end)
    os.fsync(fd)
    return size - end


class Journal:
    """Appends events to the journal at ``path`` (created with its parent directories if missing).

    Thread-safe within a process (a lock around each append). One writing process per file at a time
    (a restarted service reopens the file after its predecessor died).

    Raises:
        OSError: the file cannot be created or opened for appending.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        created = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.truncated_bytes = 0
        """Bytes of a torn last line cut off at open (a previous writer crashed mid-append)."""
        rfd = os.open(self.path, os.O_RDWR)
        try:
            self.truncated_bytes = _truncate_torn_tail(rfd)
        finally:
            os.close(rfd)
        if created:
            _fsync_dir(self.path.parent)
        self._lock = threading.Lock()

    def append(self, event: dict) -> None:
        """Write ``event`` as one JSON line and fsync it.

        Raises:
            ValueError: ``event`` has no string ``"event"`` key, or is not JSON-serialisable.
            OSError: the write or fsync failed (the event may not be durable).
        """
        if not isinstance(event.get("event"), str):
            raise ValueError(f"journal event {event!r} must have a string 'event' key")
        line = (json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"journal {self.path}: short write ({written} of {len(line)} bytes)")
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:  # interpreter shutdown: nothing left to do
            pass


def _parse(line: bytes, path: Path, lineno: int) -> dict:
    try:
        event = json.loads(line)
    except ValueError as exc:  # bad UTF-8 or bad JSON
        raise JournalError(f"journal {path}: line {lineno} is not valid JSON ({exc}): {line[:120]!r}") from None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise JournalError(f"journal {path}: line {lineno} is not an event object with a string 'event' key: "
                           f"{line[:120]!r}")
    return event


def read_journal(path: str | Path) -> JournalRead:
    """Every event in the journal at ``path``, tolerating a torn last line.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        JournalError: a newline-terminated line does not parse (the message names file and line).
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    out = JournalRead()
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            out.events.append(_parse(line, path, lineno))
    out.torn_tail = bool(tail)  # an append cut short by a crash (even if what is there parses)
    return out
