"""The learner service as Ray actors: ``LearnerActor`` (rank 0: DeepSpeed engine, WeightService, the training
loop against replay) and ``LearnerRankActor`` (ranks >= 1 of a multi-rank learner), plus the rank rendezvous
helpers. Actor conventions (``describe()``, pushed addresses): ``services.common.actor_env``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import ray
import structlog

from gyre.learner.loop import StopRequested
from gyre.proto.exports import write_export_version
from gyre.services.common.actor_env import advertised_host, node_ip, security_config
from gyre.services.common.service_info import LearnerInfo, LearnerRankInfo
from gyre.services.common.logs import bind_policy_version
from gyre.services.common.names import ServiceName
from gyre.services.common.run_files import LEARNER_ROWS
from gyre.services.common.replay_links import ReroutableReplay

log = structlog.get_logger("actors")


TORCH_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
"""torch.distributed rendezvous variables a learner rank replaces (or, single-rank, drops) before DeepSpeed starts."""


@ray.remote
class LearnerActor:
    """The learner service: DeepSpeed engine + WeightService; ``run`` trains in a worker thread while
    ``progress`` is polled (the actor is created with ``max_concurrency >= 2``).

    Args:
        checkpoint_dir: where the loop commits checkpoints (leases are acked only after a commit);
            ``None`` defers every save (and ack) to ``finalize``. A restarted learner resumes from the
            newest verified checkpoint here (``config["resume"] == "auto"``) and re-publishes it.
            The learner's run journal goes next to it: ``{checkpoint_dir}/../learner_journal.jsonl``.
        security: ``SecurityConfig`` fields for the weight server and the replay client.
        run_id, metrics_port: as for ``services.replay.actor.ReplayActor``.
        weight_transport: the rollouts' ``weight_transport`` (``proto.weight_transport``); with ``type: nccl`` the
            learner also forms the broadcast group (``services.learner.weight_group``).
        ranks: rank 0 of a multi-rank learner (``rank_env``'s fields): the other ranks are
            ``LearnerRankActor``s mirroring this one's collective calls (``learner.ranks``); a failed
            collective ends this process (fail-stop: the supervisor restarts the whole group). ``None``: a
            world of one.
    """

    def __init__(self, config: dict, replay_address: str, host: str | None = None,
                 checkpoint_dir: str | None = None, security: dict | None = None, run_id: str = "run",
                 metrics_port: int | None = 0, ranks: dict | None = None,
                 weight_transport: dict | None = None) -> None:
        from gyre.learner.engine import LearnerEngine
        from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
        from gyre.learner.versions import prepare_learner_process
        from gyre.learner.ranks import LeaderEngine
        from gyre.learner.publisher import WeightPublisher
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging
        from gyre.services.common.observability import LearnerMetrics, serve
        from gyre.proto.weight_transport import NcclTransportConfig
        from gyre.services.learner import weight_server
        from gyre.services.learner.weight_group import GroupMembers, WeightGroup
        from transformers import AutoTokenizer

        configure_logging(run_id, "learner")
        pin_from_env("learner")  # placement.<role>.cpus, before any compute thread starts
        set_rank_env(ranks)
        sec = security_config(security)
        host = host or (sec.bind_host if sec is not None else "127.0.0.1")
        self.config = LearnerLoopConfig(**config)
        prepare_learner_process(self.config)  # lockstep: deterministic kernels, before CUDA starts
        self.engine = LearnerEngine(self.config.engine, self.config.algorithm)
        if ranks is not None and ranks["world_size"] > 1:  # rank 0 announces each collective call to the others
            self.engine = LeaderEngine(self.engine, on_failure=fail_stop)
        self.publisher = WeightPublisher(delta_bases=delta_bases(weight_transport))
        members = GroupMembers() if (weight_transport or {}).get("type") == "nccl" else None
        self.server, self.port = weight_server.serve(self.publisher, host=host, security=sec, members=members)
        self.host = advertised_host(host)
        pad = AutoTokenizer.from_pretrained(self.config.engine.model).pad_token_id
        self.replay = ReroutableReplay(replay_address, sec)
        journal = Path(checkpoint_dir).parent / "learner_journal.jsonl" if checkpoint_dir is not None else None
        self.loop = LearnerLoop(self.config, self.engine, self.replay, self.publisher, pad, checkpoint_dir, journal)
        if members is not None:  # weight_transport: nccl — versions also go out in a broadcast group
            self.loop.background.group = WeightGroup(NcclTransportConfig(**weight_transport), self.publisher, members,
                                                     host=host)
        self.resumed_from = self.loop.resume()  # config.resume (auto: newest verified checkpoint, if any)
        self.loop.publish_current()
        self.metrics = LearnerMetrics(run_id, "learner", async_save=self.config.async_save)
        last = self.loop.last_checkpoint
        self.metrics.observe_resume(self.engine.version, saved_at=(last / "manifest.json").stat().st_mtime
                                    if last is not None else None)
        bind_policy_version(self.engine.version)
        self.metrics_port = serve(self.metrics.registry, host, metrics_port) if metrics_port is not None else None
        self._rows: list[dict] = []
        self._rows_file = Path(checkpoint_dir).parent / LEARNER_ROWS if checkpoint_dir is not None else None
        """Each row is appended here too (``services.common.run_files.LEARNER_ROWS``), and a checkpointed step's
        row once more before its checkpoint commits (``LearnerLoop.keep_row``)."""
        self.loop.keep_row = self._keep_row
        self._error: str | None = None
        self._running = False
        self._done = threading.Event()
        self._ray_sigterm = None
        if threading.current_thread() is threading.main_thread():  # Ray runs __init__ on the main thread
            self._ray_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGUSR1, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        """SIGUSR1: checkpoint after the current step and continue. SIGTERM (node drain, ``kill``): checkpoint
        (after the current step when training, else now), then exit through Ray's own SIGTERM path."""
        if self._running:
            if signum == signal.SIGTERM:
                self.loop.request_stop()
            else:
                self.loop.request_checkpoint()
            return
        log.warning("emergency_checkpoint", signal=signal.Signals(signum).name, step=self.engine.step)
        if self.loop.checkpoint_dir is not None:
            self.loop.checkpoint()
        if signum == signal.SIGTERM:
            self._exit_via_ray()

    def _exit_via_ray(self) -> None:
        """Hand SIGTERM back to Ray's handler (it shuts the worker down cleanly) and deliver it again."""
        signal.signal(signal.SIGTERM, self._ray_sigterm or signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def weights_address(self) -> str:
        return f"{self.host}:{self.port}"

    def set_replay_address(self, address: str) -> None:
        """Point the replay client at a restarted replay service."""
        self.replay.reroute(address)

    def version(self) -> int:
        return self.engine.version

    def run(self, num_steps: int) -> int:
        """Train ``num_steps`` steps; returns the final policy version. Errors are re-raised."""
        self._running, self._error = True, None
        self._done.clear()
        try:
            for _ in range(num_steps):
                try:
                    row = self.loop.step()
                except StopRequested:  # SIGTERM: the emergency checkpoint committed; leave through Ray
                    self._exit_via_ray()
                    return self.engine.version
                self._rows.append(row)
                self._keep_row(row)
                self.metrics.observe_step(row)
                bind_policy_version(row["version"])
        except Exception:
            self._error = traceback.format_exc()
            raise
        finally:
            self._running = False
            self._done.set()
        return self.engine.version

    def _keep_row(self, row: dict) -> None:
        """Append ``row`` to the run directory's ``LEARNER_ROWS`` (flushed: it survives this process's kill)."""
        if self._rows_file is None:
            return
        with self._rows_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True, default=float) + "\n")

    def progress(self, cursor: int) -> tuple[list[dict], bool, str | None]:
        """Metrics rows after ``cursor``, whether ``run`` ended, and its traceback if it failed."""
        return self._rows[cursor:], self._done.is_set(), self._error

    def request_checkpoint(self) -> str:
        """Emergency checkpoint: after the current step when training (the loop's SIGUSR1 path), else now.
        Returns ``"after_step"`` or the committed checkpoint's path."""
        if self._running:
            self.loop.request_checkpoint()
            return "after_step"
        self.loop.checkpoint()
        return str(self.loop.last_checkpoint)

    def describe(self) -> LearnerInfo:
        last = self.loop.last_checkpoint
        age = time.time() - last.stat().st_mtime if last is not None and last.exists() else None
        return LearnerInfo(pid=os.getpid(), node=node_ip(), address=self.weights_address(),
                           metrics_port=self.metrics_port,
                           version=self.engine.version, timeline=self.publisher.latest()[1],
                           running=self._running, resumed_from=str(self.resumed_from or ""),
                           last_checkpoint=str(last or ""), checkpoint_age_s=age,
                           tokens_per_s=self._rows[-1].get("tokens_per_s") if self._rows else None)

    def finalize(self, out_dir: str) -> dict:
        """Checkpoint (then ack the pending leases) and export the final policy as an HF folder; returns
        their paths. Checkpoints go to the loop's ``checkpoint_dir``, else ``{out_dir}/checkpoints``."""
        out = Path(out_dir)
        if self.loop.checkpoint_dir is None:
            self.loop.checkpoint_dir = out / "checkpoints"
        before = self.loop.last_checkpoint
        seconds = self.loop.checkpoint()
        if self.loop.last_checkpoint != before:
            self.metrics.observe_checkpoint(seconds)
        self.loop.wait_for_uploads()
        ckpt = self.loop.last_checkpoint
        export = out / "final_policy"
        self.engine.export_hf(export, self.config.engine.model)
        write_export_version(export, self.engine.version)  # a rollout may bootstrap from it (bootstrap_dir)
        return {"checkpoint": str(ckpt), "export": str(export)}

    def stop(self) -> None:
        if hasattr(self.engine, "stop_followers"):
            self.engine.stop_followers()
        self.loop.close_publishing()
        self.publisher.close()
        self.server.stop(grace=2).wait()


@ray.remote
class LearnerRankActor:
    """Rank ``r >= 1`` of a multi-rank learner: the same DeepSpeed engine as rank 0's ``LearnerActor``, driven by
    rank 0's broadcast commands (``learner.ranks.follow``). Talks to no replay and serves no weights.

    Args:
        config: ``LearnerLoopConfig`` fields (only ``engine`` and ``algorithm`` are used).
        ranks: this rank's rendezvous (``rank_env``'s fields).
        run_id: carried by every log line.
    """

    def __init__(self, config: dict, ranks: dict, run_id: str = "run") -> None:
        from gyre.learner.engine import LearnerEngine
        from gyre.learner.loop import LearnerLoopConfig
        from gyre.learner.versions import prepare_learner_process
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging

        if ranks["rank"] < 1:
            raise ValueError(f"LearnerRankActor is for ranks >= 1, got rank {ranks['rank']} (rank 0 is LearnerActor)")
        configure_logging(run_id, str(ServiceName("learner", ranks["rank"])))
        pin_from_env(str(ServiceName("learner", ranks["rank"])))  # placement.learner.cpus, before compute starts
        set_rank_env(ranks)
        self.rank = ranks["rank"]
        cfg = LearnerLoopConfig(**config)
        prepare_learner_process(cfg)  # lockstep: deterministic kernels, before CUDA starts
        self.engine = LearnerEngine(cfg.engine, cfg.algorithm)
        self._following = False

    def follow(self) -> int:
        """Run rank 0's commands until it sends ``stop``; returns how many ran. A failed collective (rank 0 or
        another rank died) ends this process (fail-stop)."""
        from gyre.learner.ranks import follow

        self._following = True
        try:
            return follow(self.engine)
        except BaseException as exc:  # the group is broken: never continue in it
            fail_stop(exc)
            raise
        finally:
            self._following = False

    def describe(self) -> LearnerRankInfo:
        return LearnerRankInfo(pid=os.getpid(), node=node_ip(), rank=self.rank, version=self.engine.version,
                               following=self._following)


def set_rank_env(ranks: dict | None) -> None:
    """Point ``torch.distributed`` at this learner rank's rendezvous (``{"rank", "world_size", "master_addr",
    "master_port"}``), or, for ``None``, drop an inherited one: a single-rank learner is a world of its own, and
    the driver's env (it may have run DeepSpeed in-process) would collide. ``LOCAL_RANK`` is 0: Ray gives each
    rank actor its own visible GPU."""
    for key in TORCH_DIST_ENV:
        os.environ.pop(key, None)
    if ranks is not None:
        os.environ.update(RANK=str(ranks["rank"]), WORLD_SIZE=str(ranks["world_size"]), LOCAL_RANK="0",
                          MASTER_ADDR=str(ranks["master_addr"]), MASTER_PORT=str(ranks["master_port"]))


def delta_bases(weight_transport: dict | None) -> int:
    """The learner's ``WeightPublisher(delta_bases)`` for the rollouts' ``weight_transport``: its ``delta_bases`` for
    gRPC (default 2), 2 for the broadcast group (its gRPC fallbacks use deltas too)."""
    from gyre.proto.weight_transport import GrpcTransportConfig

    if (weight_transport or {}).get("type", "grpc") == "grpc":
        return GrpcTransportConfig(**(weight_transport or {})).delta_bases
    return GrpcTransportConfig().delta_bases


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict:
    """The ``ranks`` argument of ``LearnerActor`` (rank 0) and ``LearnerRankActor`` (ranks >= 1)."""
    return {"rank": rank, "world_size": world_size, "master_addr": master_addr, "master_port": master_port}


def fail_stop(exc: BaseException) -> None:
    """A multi-rank learner's collective failed: log it and end this process at once (exit 75), so the
    supervisor restarts every rank together from the newest checkpoint."""
    log.error("learner_rank_fail_stop", pid=os.getpid(), error=f"{type(exc).__name__}: {str(exc)[:500]}")
    os._exit(75)
