"""The one fsync helper every service's on-disk format uses (WAL, snapshots, checkpoints, spool, journals,
the lockstep version store): a commit is only durable once the file *and* its directory entry are."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """fsync a file's data, or a directory's entries (creations, renames, deletions).

    Raises:
        OSError: the path cannot be opened or the fsync fails (e.g. EIO).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
