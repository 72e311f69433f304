"""Named fault points: a test (or a crash-matrix recipe) makes a service die, or one I/O call fail, at a
named phase instead of hoping a random kill lands there (torchft's ``EventInjector``; storage engines kill
the writer at every point of a commit).

Arming (read at every hit, so a test may set the variable in-process; unarmed a hit is one dict lookup):

- ``GYRE_FAULT_POINT=name`` kills the process at the first hit of ``name``; ``name#n`` at the n-th hit.
  The kill is ``SIGKILL`` to itself: no ``finally``, no ``atexit``, no flush — like a power cut of the
  process. Several points may be armed at once, comma-separated (``a#2,b``).
- ``GYRE_FAULT_POINT=name:ENOSPC`` (or ``name#n:EIO``, any ``errno`` name): from the n-th hit on, the
  point raises ``OSError(errno.ENOSPC, ...)`` instead, as the system call after it would.
- In-process tests use ``inject_error(name, errno)`` / ``clear_errors()`` for the same.
- A recipe arms points per incarnation: ``faults: {learner: ["learner.ckpt.mid_write#2",
  "learner.publish.mid_stream"]}``; the supervisor passes the i-th spec to the i-th process it creates for
  that service (``ServiceFactory.fault_env``); later incarnations run clean.

Every point is listed in ``POINTS``; ``parse_spec`` refuses a name that is not (a typo would otherwise arm
nothing and the crash test would pass without a crash).

Fire log (proof that a point fired, not only that the process died): with ``GYRE_FAULT_LOG=path`` set, a point
that fires first appends one JSON line ``{point, service, incarnation, pid, hit, action, time}`` to that file and
fsyncs it, then kills (or raises). ``service`` and ``incarnation`` come from ``GYRE_FAULT_SERVICE`` and
``GYRE_FAULT_INCARNATION``; the supervisor sets all three for every armed incarnation (``armed_env``), into
``{run_dir}/faults_fired.jsonl``. A crash test compares ``read_fire_log`` with what it armed: a health-check
restart of a hung service, or a kill from elsewhere, leaves no line.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "GYRE_FAULT_POINT"
LOG_ENV = "GYRE_FAULT_LOG"
"""Path of the fire log (JSON lines); unset: fired points are not logged."""
SERVICE_ENV = "GYRE_FAULT_SERVICE"
INCARNATION_ENV = "GYRE_FAULT_INCARNATION"

POINTS: dict[str, str] = {
    # replay (replay/wal.py, replay/snapshot.py, replay/durable.py)
    "replay.wal.before_write": "before a WAL record's bytes are written (errors: the write fails)",
    "replay.wal.after_append": "after a record is appended, before it is fsync'd",
    "replay.wal.before_fsync": "before a WAL segment's fsync (errors: the fsync fails)",
    "replay.wal.after_roll": "after a new WAL segment was opened",
    "replay.snapshot.files_written": "snapshot files written into the temp dir, no manifest yet",
    "replay.snapshot.before_rename": "snapshot complete in its temp dir, not yet renamed into place",
    "replay.snapshot.after_rename": "snapshot committed, older ones not yet pruned",
    "replay.snapshot.before_wal_delete": "snapshot committed, WAL segments it covers not yet deleted",
    # learner (learner/checkpoint/store.py, async_save.py, mirror.py, archive.py, publisher.py)
    "learner.ckpt.mid_write": "background checkpoint write half done (async save)",
    "learner.ckpt.files_written": "checkpoint files written into the temp dir, no manifest yet",
    "learner.ckpt.before_manifest": "checkpoint files fsync'd, manifest not written",
    "learner.ckpt.before_rename": "checkpoint complete in its temp dir, not yet renamed into place",
    "learner.ckpt.after_rename": "checkpoint committed, its leases not yet acked to replay",
    "learner.mirror.before_manifest": "mirror copy written, its manifest not yet",
    "learner.mirror.before_rename": "mirror copy complete, not yet renamed into place",
    "learner.archive.before_manifest": "archive objects uploaded, manifest object not yet",
    "learner.publish.mid_stream": "a new policy version half published (some tensor chunks encoded)",
    # rollout (rollout/spool.py, rollout/worker.py)
    "rollout.spool.before_rename": "spool entry written to its temp name, not yet renamed",
    "rollout.spool.after_rename": "spool entry committed, not yet sent to replay",
    "rollout.spool.flush": "a spooled group is being re-sent to replay after a restart",
    "rollout.apply_weights": "a new policy version received, not yet loaded into the engine",
    # reward model (services/reward_model/server.py)
    "reward_model.batch_scored": "a batch of responses scored by the reward-model service, replies not yet sent",
}
"""Every fault point: name → where it fires."""


@dataclass(frozen=True)
class Armed:
    """One armed point: kill (or raise ``OSError(errno)``) from its ``nth`` hit on."""

    name: str
    nth: int = 1
    errno: int | None = None


def parse_spec(spec: str) -> dict[str, Armed]:
    """Parse a ``GYRE_FAULT_POINT`` value (``name[#n][:ERRNO]``, comma-separated) into armed points.

    Raises:
        ValueError: an unknown point name, a hit count that is not a positive integer, or an unknown
            errno name — each named, with what was expected.
    """
    out: dict[str, Armed] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, errname = item.partition(":")
        name, _, nth = point.partition("#")
        if name not in POINTS:
            raise ValueError(f"fault point {name!r} (in {spec!r}) is not one of: {', '.join(sorted(POINTS))}")
        if nth and not (nth.isdigit() and int(nth) >= 1):
            raise ValueError(f"fault point {item!r}: hit count {nth!r} must be a positive integer")
        code = getattr(_errno, errname, None) if errname else None
        if errname and not isinstance(code, int):
            raise ValueError(f"fault point {item!r}: {errname!r} is not an errno name (expected e.g. ENOSPC, EIO)")
        out[name] = Armed(name, int(nth or 1), code)
    return out


_parsed: tuple[str, dict[str, Armed]] = ("", {})
_hits: dict[str, int] = {}
_errors: dict[str, int] = {}
"""Fault point name → errno to raise there (armed in-process by ``inject_error``)."""


def _armed() -> dict[str, Armed]:
    global _parsed
    spec = os.environ.get(ENV, "")
    if spec != _parsed[0]:
        _parsed = (spec, parse_spec(spec))
    return _parsed[1]


def inject_error(name: str, code: int = _errno.ENOSPC) -> None:
    """Make every later hit of fault point ``name`` raise ``OSError(code)`` (until ``clear_errors``).

    Raises:
        ValueError: ``name`` is not in ``POINTS``.
    """
    if name not in POINTS:
        raise ValueError(f"fault point {name!r} is not one of: {', '.join(sorted(POINTS))}")
    _errors[name] = code


def clear_errors() -> None:
    """Disarm every error armed by ``inject_error``."""
    _errors.clear()


def _raise(name: str, code: int) -> None:
    raise OSError(code, f"{os.strerror(code)} (injected at fault point {name!r})")


def armed_env(spec: str, log: str | os.PathLike, service: str, incarnation: int) -> dict[str, str]:
    """Environment variables that arm ``spec`` in a service process and log its fires to ``log``.

    Args:
        spec: a ``GYRE_FAULT_POINT`` value (``parse_spec``); ``""`` gives ``{}`` (a clean incarnation).
        log: the fire log's path (JSON lines, appended by every armed process of a run).
        service: the service name recorded with each fire (``replay``, ``learner``, ``rollout-<i>``).
        incarnation: 0-based index of the process among that service's processes.
    """
    if not spec:
        return {}
    return {ENV: spec, LOG_ENV: str(log), SERVICE_ENV: service, INCARNATION_ENV: str(incarnation)}


def read_fire_log(path: str | os.PathLike) -> list[dict]:
    """The fire log's records in the order written (``[]`` if the file does not exist).

    Each record: ``point`` (str), ``service`` (str, ``""`` if unset), ``incarnation`` (int, -1 if unset),
    ``pid`` (int), ``hit`` (int, the hit that fired), ``action`` (``"SIGKILL"`` or an errno name) and
    ``time`` (float, Unix seconds).

    Raises:
        ValueError: a line that is not a JSON object (the log is fsync'd line by line, so a torn last line
            means something other than a fault point wrote the file).
    """
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"fire log {path}: line {n} is not JSON ({exc}): {line[:200]!r}") from exc
        if not isinstance(row, dict):
            raise ValueError(f"fire log {path}: line {n} is not a JSON object: {line[:200]!r}")
        out.append(row)
    return out


def _log_fire(name: str, hit: int, action: str) -> None:
    """Append this fire to ``GYRE_FAULT_LOG`` (one ``write`` of one line, O_APPEND) and fsync it."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    row = {"point": name, "service": os.environ.get(SERVICE_ENV, ""),
           "incarnation": int(os.environ.get(INCARNATION_ENV) or -1), "pid": os.getpid(), "hit": hit,
           "action": action, "time": time.time()}
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def fault_point(name: str) -> None:
    """SIGKILL this process, or raise ``OSError``, if ``name`` is armed and its hit count is reached; the
    first fire is appended to the fire log (``GYRE_FAULT_LOG``) and fsync'd before the kill or the error.

    Raises:
        OSError: an error is armed for ``name`` (``inject_error`` or ``GYRE_FAULT_POINT=name:ERRNO``).
        ValueError: ``GYRE_FAULT_POINT`` names an unknown point (see ``parse_spec``).
    """
    if _errors and name in _errors:
        _raise(name, _errors[name])
    armed = _armed().get(name)
    if armed is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= armed.nth:
        if _hits[name] == armed.nth:
            _log_fire(name, _hits[name], _errno.errorcode[armed.errno] if armed.errno is not None else "SIGKILL")
        if armed.errno is not None:
            _raise(name, armed.errno)
        os.kill(os.getpid(), signal.SIGKILL)
