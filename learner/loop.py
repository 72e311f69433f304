"""Learner loop: lease a batch from replay → GRPO/TIS step → publish the new policy version →
every ``save_interval`` steps checkpoint, then ack the leases that checkpoint trained on.

The checkpoint cycle (commit, then ack; mirror, archive, background saves) is ``learner.checkpoint.cycle``; this
loop decides when it runs (``save_interval``, loss spikes, SIGUSR1/SIGTERM) and resumes from its checkpoints.
Replay's lease TTL must exceed the time ``save_interval`` steps take, or groups come back while still pending.

Pure logic over three collaborators: the DeepSpeed ``LearnerEngine``, a ``ReplaySource`` (the gRPC
client in production) and the ``WeightPublisher`` behind ``WeightService``. No grpc import.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Protocol

import pyarrow as pa
import structlog

from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.cycle import CheckpointCycle
from gyre.learner.background_publish import BackgroundPublisher
from gyre.learner.publisher import WeightPublisher
from gyre.learner.loop_config import LearnerLoopConfig
from gyre.learner.versions import learner_versions
from gyre.proto.timeline import label
from gyre.learner.run_journal import LearnerJournal, group_ids_of
from gyre.learner.checkpoint.spike import SpikeDetector
from gyre.learner.step_metrics import dead_timeline_rows
from gyre.learner.step_timer import StepTimer

log = structlog.get_logger("learner")
CONSUMER = "learner"
"""The name the learner leases batches under; ``rejoin`` on resume releases exactly this consumer's leases."""


class ReplaySource(Protocol):
    def sample(self, num_groups: int, learner_version: int, timeout_s: float, consumer: str = "",
               prompt_indices: list[int] | None = None, request_id: str = "") -> tuple[str, pa.Table] | None: ...
    def ack(self, lease_ids: list[str]) -> int: ...
    def rejoin(self, consumer: str, learner_version: int, timeline: int = 0) -> int: ...


class NoDataError(TimeoutError):
    """Replay handed out no batch within ``sample_timeout_s``."""


class StopRequested(SystemExit):
    """SIGTERM arrived: the emergency checkpoint committed (and acked); the process should exit cleanly."""

    def __init__(self) -> None:
        super().__init__(0)


def _shared(name: str, doc: str) -> property:
    """An attribute of ``LearnerLoop`` that is its ``CheckpointCycle``'s, so the two never disagree."""
    return property(lambda self: getattr(self.checkpoints, name),
                    lambda self, value: setattr(self.checkpoints, name, value), doc=doc)


class LearnerLoop:
    """Runs optimizer steps; each one publishes policy version ``step`` (the initial weights are 0).

    Args:
        engine: ``learner.engine.LearnerEngine``, or ``learner.ranks.LeaderEngine`` with several ranks (a
            test double takes the same ``save_checkpoint(request: learner.checkpoint.request.CheckpointRequest)``).
        replay: where batches come from and are acknowledged.
        publisher: receives every new version's named tensors.
        pad_token_id: tokenizer pad id for right-padding.
        checkpoint_dir: where ``global_step_N`` checkpoints go; ``None`` keeps every lease pending
            (nothing is acked) until a directory is given.
        journal_path: the run journal (``learner.run_journal``: commits with their group ids, resumes)
            that ``gyre check`` verifies; ``None``: no journal.
    """

    def __init__(self, config: LearnerLoopConfig, engine, replay: ReplaySource, publisher: WeightPublisher,
                 pad_token_id: int, checkpoint_dir: Path | None = None, journal_path: Path | None = None) -> None:
        journal = LearnerJournal(journal_path) if journal_path is not None else None
        self.checkpoints = CheckpointCycle(config, engine, replay, checkpoint_dir, journal)
        """Commits checkpoints and acks the leases they trained on (``learner.checkpoint.cycle``). The loop's
        ``config``, ``engine``, ``replay``, ``checkpoint_dir`` and ``journal`` are the cycle's: setting one on the
        loop (the learner actor sets ``checkpoint_dir`` once its run directory is known) sets it for both."""
        self.publisher = publisher
        self.pad_token_id = pad_token_id
        self._emergency: int | None = None  # signal number awaiting an emergency checkpoint
        self._rejoin: tuple | None = None
        """``(checkpoint metadata or None,)`` after ``resume`` until ``rejoin_replay`` ran (first ``step``)."""
        self.versions = learner_versions(config)
        """The determinism mode's seam (``learner.versions``): timeline, lease bounds, version store."""
        self.background = BackgroundPublisher(publisher, self.versions)
        """Publishes each captured version behind the next steps (``learner.background_publish``)."""
        self.start_version = 0
        """Policy version this learner started at (``resume``): its predecessor's versions above it are dead."""
        self.spikes = SpikeDetector(config.spike_save)
        """Loss-spike checkpoints (``learner.checkpoint.spike``): shortens the save interval after a spike; checkpointed."""
        self.timeline = self.versions.timeline
        """This learner incarnation's timeline (``proto.timeline``): every version it publishes but 0 carries it,
        so rollouts drop the weights a crashed predecessor published under the same numbers."""
        self.keep_row: Callable[[dict], None] | None = None
        """Called with a step's row (without its checkpoint's fields, ``"before_checkpoint": true``) just before a
        checkpoint that commits the step: a learner that dies after the commit (journaled) but before ``step``
        returns (acking a dead replay raises) has kept its row (``services.common.run_files.LEARNER_ROWS``)."""

    config = _shared("config", "The loop's settings (``LearnerLoopConfig``).")
    engine = _shared("engine", "``LearnerEngine`` (or ``LeaderEngine``, or a test double).")
    replay = _shared("replay", "Where batches come from and are acknowledged (``ReplaySource``).")
    checkpoint_dir = _shared("checkpoint_dir", "Where ``global_step_N`` goes; ``None``: nothing is acked.")
    journal = _shared("journal", "The run journal (``LearnerJournal``), or ``None``.")

    def install_signal_handlers(self) -> dict:
        """SIGUSR1 → checkpoint after the current step and continue; SIGTERM → checkpoint after the
        current step, then ``step`` raises ``StopRequested`` (exit 0). Main thread only; returns the
        previous handlers (``signal.signal(sig, handler)`` each to undo)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGUSR1, signal.SIGTERM)}

    def request_checkpoint(self) -> None:
        """Checkpoint after the current step and continue (SIGUSR1's path); callable from any thread
        (``gyre checkpoint`` reaches it through the learner actor)."""
        if self._emergency != signal.SIGTERM:
            self._emergency = signal.SIGUSR1
        log.warning("emergency_checkpoint_requested", source="request")

    def request_stop(self) -> None:
        """SIGTERM's path from any thread: checkpoint after the current step, then ``step`` raises
        ``StopRequested``."""
        self._emergency = signal.SIGTERM
        log.warning("emergency_checkpoint_requested", source="stop")

    def _on_signal(self, signum, frame) -> None:
        if self._emergency != signal.SIGTERM:  # a pending SIGTERM is never downgraded
            self._emergency = signum
        log.warning("emergency_checkpoint_requested", signal=signal.Signals(signum).name)

    def publish_current(self, wait: bool = True) -> float:
        """Publish the engine's current weights under its current version and this learner's timeline
        (``SHARED`` for version 0); returns the seconds this call blocked. The weights are captured on their
        device (``engine.capture_weights``); the rest runs in the background (``learner.background_publish``)
        unless ``wait`` is set or the determinism mode waits (lockstep).

        Raises:
            proto.lockstep.VersionMismatchError: lockstep, and this version was stored before (a predecessor's)
                with other weights: exact resume is broken, so the run stops here, loudly.
            Exception: what an earlier background publish raised (``BackgroundPublisher.raise_if_failed``).
        """
        t0 = time.perf_counter()
        captured = self.engine.capture_weights()
        self.background.submit(self.engine.version, label(self.engine.version, self.timeline), captured,
                               wait=wait or not self.versions.publish_in_background)
        return time.perf_counter() - t0

    def close_publishing(self, timeout_s: float = 60.0) -> None:
        """Publish the version still queued, then stop the background publisher (at most ``timeout_s`` seconds)."""
        self.background.close(timeout_s)

    def step(self) -> dict:
        """One optimizer step; returns its metrics row (plain floats/ints), with its wall time split into phases
        (``learner.step_timer``: ``time/learner/*``, summing to ``time/learner/step_s`` == ``step_s``).

        Raises:
            NoDataError: no batch within ``sample_timeout_s`` seconds.
        """
        timer = StepTimer()
        with timer.phase("wait_data"):
            if self._rejoin is not None:
                self.rejoin_replay()
            lease_id, table = self._lease_batch()
        t_sampled = time.perf_counter()
        batch = build_train_batch(table, self.pad_token_id, self.engine.version, self.config.algorithm)
        dead = dead_timeline_rows(table, self.timeline, self.start_version)  # before train_step: lag as sampled
        with timer.phase("forward_backward"):
            metrics = self.engine.train_step(batch)
        timer.move("forward_backward", "optimizer", metrics.get("optimizer_step_s", 0.0))
        metrics |= self.spikes.observe(self.engine.step, metrics)
        t_trained = time.perf_counter()  # train_step advanced engine.version by one
        with timer.phase("publish_blocking"):
            publish_s = self.publish_current(wait=False)
        self.checkpoints.trained(lease_id, group_ids_of(table))
        trained = {**metrics, "step": self.engine.version, "version": self.engine.version,
                   "groups": self.config.groups_per_step, "trajectories": table.num_rows,
                   "sample_wait_s": timer.seconds["wait_data"], "train_s": t_trained - t_sampled, "publish_s": publish_s}
        save_s, before = 0.0, self.last_checkpoint
        emergency, self._emergency = self._emergency, None
        due = emergency or self.engine.step % self.save_interval_at(self.engine.step) == 0
        if self.checkpoint_dir is not None and due:
            if self.keep_row is not None:  # the commit journals this step before its leases are acked, which may
                self.keep_row({**trained, "before_checkpoint": True})  # raise: the row must already be kept
            with timer.phase("checkpoint"):
                save_s = self.checkpoint(wait=bool(emergency) or not self.config.async_save)
        background = self.poll_background_save()
        committed = {"checkpoint_committed": 1.0} if self.last_checkpoint != before else {}
        if emergency == signal.SIGTERM:
            log.warning("stopping_after_sigterm", step=self.engine.step, checkpoint=str(self.last_checkpoint))
            raise StopRequested()
        times = timer.row()
        return {
            **trained, "checkpoint_s": save_s, **background,
            "weights/publish_background_s": self.background.last_background_s,
            "weights/versions_superseded": self.background.superseded,
            **self._group_metrics(),
            **committed, "dead_timeline_rows": dead, "pending_leases": len(self.pending_lease_ids),
            **times, "step_s": times["time/learner/step_s"], "time": time.time(),
        }

    def _group_metrics(self) -> dict:
        """The broadcast group's counters (``weight_transport: nccl``, ``services.learner.weight_group``), else none:
        versions it delivered and that failed (they went over gRPC), groups formed, members now."""
        group = self.background.group
        if group is None:
            return {}
        return {"weights/group_versions": group.sent, "weights/group_failed": group.failed,
                "weights/group_reforms": group.reforms, "weights/group_members": len(group.group_members)}

    def save_interval_at(self, step: int) -> int:
        """The checkpoint interval at optimizer step ``step``: ``config.save_interval_at(step)``, shortened
        while a loss-spike hold lasts (``config.spike_save``, ``learner.checkpoint.spike``)."""
        return self.spikes.interval(step, self.config.save_interval_at(step))

    def checkpoint(self, wait: bool = True) -> float:
        """Checkpoint the current step and ack every pending lease once it commits; returns the seconds training
        was blocked (``CheckpointCycle.save``: with ``config.async_save`` and ``wait=False`` it commits in the
        background). Raises ``RuntimeError`` without a ``checkpoint_dir``, and what the save raised when ``wait``."""
        return self.checkpoints.save(self.spikes.state_dict(), wait=wait)

    def poll_background_save(self) -> dict:
        """Ack the leases of a background save that has committed; returns its metrics or ``{}``."""
        return self.checkpoints.poll()

    @property
    def pending_lease_ids(self) -> list[str]:
        """Leases trained on since the last committed checkpoint (not acked yet)."""
        return self.checkpoints.pending_lease_ids

    @property
    def acked_lease_count(self) -> int:
        return self.checkpoints.acked_lease_count

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpoints.last_checkpoint

    def wait_for_uploads(self, timeout_s: float | None = None) -> None:
        """Block until every queued archive upload finished (end of run, tests)."""
        self.checkpoints.wait_for_uploads(timeout_s)

    @property
    def tier_failures(self) -> int:
        """Mirror copies and archive uploads that failed (logged; training went on)."""
        return self.checkpoints.tier_failures

    def resume(self) -> Path | None:
        """Apply ``config.resume``: load the chosen checkpoint into the engine; returns its path, or ``None``
        for a cold start. Call before ``publish_current`` so the restored version is (re-)published. In lockstep,
        stored versions above the restored one are set aside until re-written and checked. Talks to
        no replay: that is ``rejoin_replay``, which the first ``step`` runs (so a learner restarted while replay
        is down, too, starts at once and its supervisor can restart replay meanwhile).
        Raises ``learner.checkpoint.store.CheckpointError`` when refused."""
        from gyre.learner.checkpoint.mirror import resolve_resume

        mode, mirror = self.config.resume, self.config.mirror_dir
        path = (resolve_resume(mode, self.checkpoint_dir, Path(mirror) if mirror else None, self.config.archive)
                if self.checkpoint_dir or mode != "auto" else None)
        if path is None:
            log.info("cold_start", resume=mode, checkpoint_dir=str(self.checkpoint_dir))
            self._journal_resume(None, None)
            self._rejoin = (None,)
            self.versions.starting_at(self.engine.version)
            return None
        meta = self.engine.load_checkpoint(path, fingerprint=self.config.fingerprint, force=self.config.force_resume)
        self.start_version = self.engine.version
        self.spikes.load_state_dict(meta.spike_save)
        self.versions.starting_at(self.engine.version)
        self._journal_resume(path, meta)  # before restore acks the checkpoint's leases
        self.checkpoints.restored(path, meta.acked_lease_count)
        self._rejoin = (meta,)
        log.info("resumed", path=str(path), step=meta.step, version=meta.policy_version,
                 pending_leases=len(meta.pending_lease_ids))
        return path

    def rejoin_replay(self) -> int:
        """After ``resume``: ack the leases the restored checkpoint committed (``restore``), then ``Rejoin``
        replay at the restored version — in that order, so the other leases this consumer holds, taken after
        that checkpoint, are exactly the ones released. Returns how many groups were released. Runs once;
        the first ``step`` calls it. Raises ``ConnectionError`` if replay stays unreachable (nothing is
        released then: a lease the checkpoint trained on can never go back to the pool)."""
        if self._rejoin is None:
            return 0
        meta, = self._rejoin
        if meta is not None:
            self.restore(meta)
        released = self._rejoin_replay()
        self._rejoin = None
        log.info("replay_rejoined", version=self.engine.version, acked_leases=self.acked_lease_count,
                 released_groups=released)
        return released

    def _journal_resume(self, path: Path | None, meta) -> None:
        if self.journal is not None:
            roots = [r for r in (self.checkpoint_dir, self.config.mirror_dir) if r is not None]
            self.journal.resume(path, meta, self.config.resume, [Path(r) for r in roots])

    def _rejoin_replay(self) -> int:
        """Tell replay this learner (re)starts at ``engine.version``: leases a crashed predecessor took after
        its last checkpoint go back to the pool now (not at their TTL), and replay's learner version follows
        the checkpoint down, so fresh groups are not dropped as too stale for a version nobody trains at. This
        learner's timeline retires its predecessor's: replay deletes (and from then on drops) the groups that
        the predecessor's versions above this one sampled (``proto.timeline``)."""
        return self.replay.rejoin(CONSUMER, self.engine.version, self.timeline)

    def restore(self, meta) -> None:
        """After ``engine.load_checkpoint``: ack the leases that checkpoint committed but may not have
        acked before the crash. Already-acked or expired ids are logged and skipped (recovery path)."""
        self.checkpoints.acked_lease_count = meta.acked_lease_count
        for lease_id in meta.pending_lease_ids:
            try:
                self.replay.ack([lease_id])
                self.checkpoints.acked_lease_count += 1
            except ConnectionError:
                raise  # replay unreachable: rejoining now would release leases this checkpoint trained on
            except Exception as exc:  # recovery path: unknown (acked/expired: UnknownLeaseError in-process,
                # NOT_FOUND over gRPC): nothing left to ack
                log.warning("resume_ack_skipped", lease_id=lease_id, error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def _lease_batch(self) -> tuple[str, pa.Table]:
        deadline = time.monotonic() + self.config.sample_timeout_s
        request_id = uuid.uuid4().hex  # one key for every retry: a lease whose answer a replay crash lost comes back
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoDataError(
                    f"no batch of {self.config.groups_per_step} groups within {self.config.sample_timeout_s}s "
                    f"at learner version {self.engine.version}; are the rollouts alive?")
            try:
                got = self.replay.sample(self.config.groups_per_step, self.engine.version,
                                         timeout_s=min(remaining, 10.0), consumer=CONSUMER, request_id=request_id,
                                         **self.versions.sample_args(self.engine.step))
            except ConnectionError as exc:
                log.warning("replay_unreachable", error=str(exc)[:200])
                time.sleep(1.0)
                continue
            if got is not None:
                return got
