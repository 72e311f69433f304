"""A buffer directory read offline: what a replay service would restore from ``config.dir``, held in memory
without writing to the directory (crash-test checkers and ``gyre check`` read it). Apart from
``replay.durable``, which the running buffer owns, so that neither module imports the other's importer."""

from __future__ import annotations

from pathlib import Path

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.restore import restore


def inspect_dir(config: ReplayConfig, read_only: bool = True) -> TrajectoryBuffer:
    """An in-memory buffer holding what ``config.dir`` restores to (``read_only``: nothing in the directory is
    moved or rewritten, corrupt files are left where they are); its ``restore_report`` says what loaded.

    Raises:
        replay.restore.RestoreError: the directory holds data but nothing valid loads (as a real start would).
    """
    buffer = TrajectoryBuffer(config.model_copy(update={"dir": None}))
    buffer.restore_report = restore(buffer.state, Path(config.dir), read_only=read_only)
    return buffer
