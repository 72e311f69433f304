"""Ray actors: each wraps one service (its gRPC server and its core) so the controller can place,
watch and stop it. Configs cross as plain dicts (Ray control messages); data goes over gRPC."""

from __future__ import annotations

import asyncio
import os
import threading
import traceback
from pathlib import Path

import ray


def _node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


@ray.remote
class ReplayActor:
    """The replay service: the Arrow buffer (durable when given a directory) behind ReplayService.

    Args:
        config: ``ReplayConfig`` fields.
        host: address to bind.
        dir: WAL/snapshot directory, overriding ``config["dir"]`` (the controller passes ``{run_dir}/replay``);
            an existing directory is restored first.
        metrics_port: serve Prometheus ``/metrics`` on this port (0 = any free port; ``None`` = off).
    """

    def __init__(self, config: dict, host: str = "127.0.0.1", dir: str | None = None,
                 metrics_port: int | None = None) -> None:
        from replay.buffer import TrajectoryBuffer
        from replay.config import ReplayConfig
        from services import replay_server
        from services.replay_metrics import serve_metrics

        cfg = ReplayConfig(**{**config, **({"dir": dir} if dir is not None else {})})
        self.buffer = TrajectoryBuffer(cfg)
        self.server, self.port = replay_server.serve(self.buffer, host=host)
        self.host = host
        self.metrics_port = serve_metrics(self.buffer, metrics_port, host) if metrics_port is not None else None

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def info(self) -> dict:
        return self.buffer.info()

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
        self.buffer.close()


@ray.remote
class LearnerActor:
    """The learner service: DeepSpeed engine + WeightService; ``run`` trains in a worker thread while
    ``progress`` is polled (the actor is created with ``max_concurrency >= 2``).

    Args:
        checkpoint_dir: where the loop commits checkpoints (leases are acked only after a commit);
            ``None`` defers every save (and ack) to ``finalize``.
    """

    def __init__(self, config: dict, replay_address: str, host: str = "127.0.0.1",
                 checkpoint_dir: str | None = None) -> None:
        from learner.engine import LearnerEngine
        from learner.loop import LearnerLoop, LearnerLoopConfig
        from learner.publisher import WeightPublisher
        from services import weight_server
        from services.replay_client import ReplayClient
        from transformers import AutoTokenizer

        self.config = LearnerLoopConfig(**config)
        self.engine = LearnerEngine(self.config.engine, self.config.algorithm)
        self.publisher = WeightPublisher()
        self.server, self.port = weight_server.serve(self.publisher, host=host)
        self.host = host
        pad = AutoTokenizer.from_pretrained(self.config.engine.model).pad_token_id
        self.loop = LearnerLoop(self.config, self.engine, ReplayClient(replay_address), self.publisher, pad,
                                checkpoint_dir)
        self.loop.resume()  # config.resume (auto: newest verified checkpoint, if any)
        self.loop.publish_current()
        self._rows: list[dict] = []
        self._error: str | None = None
        self._done = threading.Event()

    def weights_address(self) -> str:
        return f"{self.host}:{self.port}"

    def run(self, num_steps: int) -> int:
        """Train ``num_steps`` steps; returns the final policy version. Errors are re-raised."""
        try:
            for _ in range(num_steps):
                self._rows.append(self.loop.step())
        except Exception:
            self._error = traceback.format_exc()
            raise
        finally:
            self._done.set()
        return self.engine.version

    def progress(self, cursor: int) -> tuple[list[dict], bool, str | None]:
        """Metrics rows after ``cursor``, whether ``run`` ended, and its traceback if it failed."""
        return self._rows[cursor:], self._done.is_set(), self._error

    def finalize(self, out_dir: str) -> dict:
        """Checkpoint (then ack the pending leases) and export the final policy as an HF folder; returns
        their paths. Checkpoints go to the loop's ``checkpoint_dir``, else ``{out_dir}/checkpoints``."""
        out = Path(out_dir)
        if self.loop.checkpoint_dir is None:
            self.loop.checkpoint_dir = out / "checkpoints"
        self.loop.checkpoint()
        ckpt = self.loop.last_checkpoint
        export = out / "final_policy"
        self.engine.export_hf(export, self.config.engine.model)
        return {"checkpoint": str(ckpt), "export": str(export)}

    def stop(self) -> None:
        self.publisher.close()
        self.server.stop(grace=2).wait()


@ray.remote
class RolloutActor:
    """A rollout service (async actor): vLLM engine + worker loop + weight subscriber."""

    async def setup(self, rollout_id: str, config: dict, task_config: dict, replay_address: str,
                    weights_address: str, seed: int) -> int:
        from rollout.engine import RolloutEngine
        from rollout.tasks import TaskConfig, TaskSource
        from rollout.worker import RolloutConfig, RolloutWorker
        from services.replay_client import ReplayClient
        from services.weight_client import WeightSubscriber
        from transformers import AutoTokenizer

        cfg = RolloutConfig(**config)
        self.loop = asyncio.get_running_loop()
        self.engine = await RolloutEngine.start(cfg.engine)
        tokenizer = AutoTokenizer.from_pretrained(cfg.engine.model)
        self.worker = RolloutWorker(rollout_id, cfg, TaskSource(TaskConfig(**task_config)), self.engine,
                                    ReplayClient(replay_address), tokenizer, seed)
        self.subscriber = WeightSubscriber(weights_address, self._on_version, have_version=self.engine.version,
                                           name=rollout_id).start()
        self.task = None
        return os.getpid()

    def _on_version(self, version, tensors) -> None:
        # Called in the subscriber thread: apply on the actor's event loop and wait for it.
        asyncio.run_coroutine_threadsafe(self.worker.apply_weights(version, tensors), self.loop).result()

    async def start(self) -> None:
        self.task = asyncio.create_task(self.worker.run())

    async def pause(self) -> None:
        """Stop taking new prompts and finish the groups in flight (weights keep flowing)."""
        self.worker.stop()
        if self.task is not None:
            await self.task
            self.task = None

    async def wait_for_version(self, version: int, timeout_s: float) -> int:
        deadline = self.loop.time() + timeout_s
        while self.engine.version < version and self.loop.time() < deadline:
            await asyncio.sleep(0.2)
        return self.engine.version

    async def evaluate(self) -> dict:
        return await self.worker.evaluate()

    async def stats(self) -> dict:
        return self.worker.stats.as_dict(self.engine.version)

    async def stop(self) -> None:
        await self.pause()
        self.subscriber.stop()
        await self.engine.shutdown()

