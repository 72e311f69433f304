"""Named fault points: a crash test arms one and the process SIGKILLs itself when it gets there.

Like torchft's ``EventInjector``, this lets a test kill a service *at a named phase* (in the middle
of a snapshot, between writing a segment and fsyncing it) instead of hoping a random kill lands there.
Arm with the environment variable ``GYRE_FAULT_POINT=name`` (kill at the first hit) or
``GYRE_FAULT_POINT=name#n`` (kill at the n-th hit), read once at import. Unarmed, a fault point is one
comparison.

Points in replay: ``snapshot.files_written``, ``snapshot.before_rename``, ``snapshot.after_rename``,
``snapshot.before_wal_delete``, ``wal.after_append``, ``wal.after_roll``.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("GYRE_FAULT_POINT", "")
_NAME, _, _NTH = _SPEC.partition("#")
_hits = 0


def fault_point(name: str) -> None:
    """SIGKILL this process if ``name`` is the armed fault point and its hit count is reached."""
    global _hits
    if not _NAME or name != _NAME:
        return
    _hits += 1
    if _hits >= int(_NTH or 1):
        os.kill(os.getpid(), signal.SIGKILL)
