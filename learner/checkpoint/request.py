"""The learner's checkpoint save, defined once: what a save is asked to do (``CheckpointRequest``) and what a
learner engine offers for it (``CheckpointedLearner``).

Every engine takes the same ``save_checkpoint(request) -> Path | Future[Path]``: ``learner.engine.LearnerEngine``
(which hands the request to ``learner.checkpoint.engine.save_checkpoint``), ``learner.ranks.LeaderEngine`` (several
ranks) and the test doubles; ``learner.loop.LearnerLoop`` builds the request. Pure: no deepspeed import.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.async_save import BackgroundSaver
    from gyre.learner.config import AlgorithmConfig, LearnerConfig


@dataclass(frozen=True)
class CheckpointRequest:
    """One checkpoint save (``learner.checkpoint.store`` layout and commit protocol). ``root`` may be given as a
    ``str``; the id lists as any sequence of ``str`` (both are normalised: ``Path``, ``tuple``).
    """

    root: Path
    """Checkpoint root directory: the save commits ``{root}/global_step_{step}`` (created if missing)."""
    pending_lease_ids: Sequence[str] = ()
    """Replay leases whose batches this checkpoint trained on, not acked yet; stored in the metadata so a
    resumed learner acks them again (``CheckpointMetadata.pending_lease_ids``)."""
    pending_group_ids: Sequence[str] = ()
    """``group_id`` of every group in those leases' batches (``CheckpointMetadata.pending_group_ids``), so a
    resumed learner can re-journal a ``commit`` event a crash cut off."""
    acked_lease_count: int = 0
    """Leases acked before this checkpoint, cumulative (``CheckpointMetadata.acked_lease_count``)."""
    fingerprint: str = ""
    """Task/dataset fingerprint; a resume with another one is refused unless forced."""
    spike_save: Mapping[str, Any] = field(default_factory=dict)
    """The loop's loss-spike detector state (``learner.checkpoint.spike.SpikeDetector.state_dict``), stored as
    ``CheckpointMetadata.spike_save``; empty when the loop keeps none."""
    keep_last_n: int | None = None
    """After the commit, prune all but the newest ``keep_last_n`` checkpoints under ``root``; ``None``: keep all."""
    protected: Callable[[], Collection[str]] | None = field(default=None, compare=False)
    """Called at prune time: checkpoint names the prune must keep for now (archive uploads still queued or
    running read them from ``root``); ``None``: none."""
    saver: BackgroundSaver | None = field(default=None, compare=False)
    """``learner.checkpoint.async_save.BackgroundSaver``: each rank's shard of the state is captured in memory and
    written in its thread, and rank 0's commits there once every rank's shard is written, at any world size
    (``save_checkpoint`` returns a ``Future`` of the path); ``None``: synchronous."""
    after_commit: Callable[[Path], None] | None = field(default=None, compare=False)
    """Runs with the committed path on rank 0 right after the commit and pruning (in the saver's thread for an
    async save), before the loop acks the leases, e.g. to mirror the checkpoint."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "pending_lease_ids", tuple(self.pending_lease_ids))
        object.__setattr__(self, "pending_group_ids", tuple(self.pending_group_ids))


class CheckpointedLearner(Protocol):
    """What ``learner.checkpoint.engine`` and ``learner.checkpoint.reshard`` read from a learner to save it and set on it when
    they restore it (``learner.engine.LearnerEngine`` has these)."""

    step: int
    """Optimizer steps taken; the checkpoint is ``global_step_{step}``."""
    version: int
    """Policy version of the current weights."""
    config: LearnerConfig
    """Written to the checkpoint (``learner_config.json``); its ``zero_stage`` decides whether it reshards."""
    algo: AlgorithmConfig
    """Written to the checkpoint (``algorithm_config.json``)."""
    kl_ctrl: Any
    """``learner.algo.kl_control.KLController``: its ``state_dict`` is saved in the metadata, ``load_state_dict``
    restores it."""
    config_hash: str
    """sha256 of both configs' JSON (``learner.checkpoint.store.config_hash``), compared on resume."""
    engine: Any
    """The ``deepspeed.DeepSpeedEngine`` whose state is saved under ``deepspeed/``."""


def commit_request(tmp: Path, final: Path, meta: ckpt.CheckpointMetadata, request: CheckpointRequest) -> Path:
    """The end of every save that ``request`` asked for (on rank 0): commit ``tmp`` as ``final``
    (``learner.checkpoint.store.commit``), prune ``request.root`` to ``keep_last_n`` sparing ``request.protected()``,
    then run ``after_commit(final)``. Returns ``final``."""
    from gyre.learner.checkpoint import store as ckpt

    ckpt.commit(tmp, final, meta)
    if request.keep_last_n is not None:
        ckpt.prune(request.root, request.keep_last_n, request.protected() if request.protected else ())
    if request.after_commit is not None:
        request.after_commit(final)
    return final
