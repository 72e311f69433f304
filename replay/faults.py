"""Named fault points: a test makes the process die, or an I/O call fail, when it gets to one.

Like torchft's ``EventInjector``, this lets a test kill a service *at a named phase* (in the middle
of a snapshot, between writing a segment and fsyncing it) instead of hoping a random kill lands there,
or make one named disk operation fail the way a full or broken disk does.

- ``GYRE_FAULT_POINT=name`` (kill at the first hit) or ``name#n`` (kill at the n-th hit): the process
  SIGKILLs itself. Read once at import.
- ``GYRE_FAULT_POINT=name:ENOSPC`` (or ``name#n:EIO``, any ``errno`` name): from the n-th hit on, the
  point raises ``OSError(errno.ENOSPC, ...)`` instead, like the system call after it would.
- In-process tests use ``inject_error(name, errno)`` / ``clear_errors()`` for the same.

Unarmed, a fault point is one comparison.

Points in replay: ``snapshot.files_written``, ``snapshot.before_rename``, ``snapshot.after_rename``,
``snapshot.before_wal_delete``, ``wal.after_append``, ``wal.after_roll``, and, just before the system
call they name, ``wal.write`` (a record's bytes) and ``wal.fsync`` (a segment's fsync).
"""

from __future__ import annotations

import errno as _errno
import os
import signal

_SPEC = os.environ.get("GYRE_FAULT_POINT", "")
_POINT, _, _ERRNAME = _SPEC.partition(":")
_NAME, _, _NTH = _POINT.partition("#")
_hits = 0
_errors: dict[str, int] = {}
"""Fault point name → errno to raise there (armed in-process by ``inject_error``)."""


def _errno_of(name: str) -> int:
    code = getattr(_errno, name, None)
    if not isinstance(code, int):
        raise ValueError(f"GYRE_FAULT_POINT={_SPEC!r}: {name!r} is not an errno name (expected e.g. ENOSPC, EIO)")
    return code


_ENV_ERRNO = _errno_of(_ERRNAME) if _ERRNAME else None


def inject_error(name: str, code: int = _errno.ENOSPC) -> None:
    """Make every later hit of fault point ``name`` raise ``OSError(code)`` (until ``clear_errors``)."""
    _errors[name] = code


def clear_errors() -> None:
    """Disarm every error armed by ``inject_error``."""
    _errors.clear()


def _raise(name: str, code: int) -> None:
    raise OSError(code, f"{os.strerror(code)} (injected at fault point {name!r})")


def fault_point(name: str) -> None:
    """SIGKILL this process, or raise ``OSError``, if ``name`` is armed and its hit count is reached.

    Raises:
        OSError: an error is armed for ``name`` (``inject_error`` or ``GYRE_FAULT_POINT=name:ERRNO``).
    """
    global _hits
    if _errors and name in _errors:
        _raise(name, _errors[name])
    if not _NAME or name != _NAME:
        return
    _hits += 1
    if _hits >= int(_NTH or 1):
        if _ENV_ERRNO is not None:
            _raise(name, _ENV_ERRNO)
        os.kill(os.getpid(), signal.SIGKILL)
