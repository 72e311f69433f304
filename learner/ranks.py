"""Multi-rank learner: rank 0 runs the ``LearnerLoop``; every other rank mirrors its collective engine calls.

DeepSpeed needs every rank to enter the same collectives in the same order (forward/backward/step, ZeRO-3
parameter gathers, checkpoint save and load, export). Only rank 0 talks to replay and to the rollouts, so
rank 0's engine is wrapped in a ``LeaderEngine``: before each collective call it broadcasts a command (the
method name, its plain arguments as JSON, and its tensors) over the learner's own process group, and each
follower (``follow``) runs the same call on its ``LearnerEngine``. This is the driver/worker split of
torchrun-style trainers (one controller rank, SPMD engine ranks) without a second control plane.

Wire format (no pickle): one int64 length, then that many uint8 bytes of a UTF-8 JSON header
``{"op", "args", "tensors": [[name, dtype, shape], ...]}``, then each tensor broadcast in header order.

Failure model (fail-stop, as torchelastic): when a collective fails on any rank (a peer died: gloo raises on
the closed socket), that rank's process exits, so the whole learner group is restarted together by the
supervisor and resumes from its newest checkpoint. No rank ever tries to continue in a broken group.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import structlog
import torch
import torch.distributed as dist

from gyre.learner.batch import TrainBatch
from gyre.learner.checkpoint.async_save import BackgroundSaver
from gyre.learner.checkpoint.request import CheckpointRequest

log = structlog.get_logger("learner")

OPS = ("train_step", "named_weights", "capture_weights", "save_checkpoint", "load_checkpoint", "export_hf", "stop", "ping")
"""Commands a follower understands; anything else is a protocol error."""
HEARTBEAT_S = 60.0
"""An idle rank 0 pings its followers this often (seconds). A learner that waits for data longer than the
group's collective timeout (gloo's default: 30 min) would otherwise time its followers out of
``receive_command``; a ping to a dead follower also fails rank 0 at once instead of at the next step."""
_DTYPES = {str(d): d for d in (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool, torch.uint8)}
_BATCH_TENSORS = ("input_ids", "attention_mask", "response_mask", "behaviour_logprobs", "advantages", "rewards",
                  "staleness", "group_rows", "truncated", "overlong_penalty", "reward_failed", "baseline_rows")


class RankProtocolError(RuntimeError):
    """A follower received a command it does not know, or a malformed header."""


_CONTROL: list = []


def control_group():
    """The process group the rank commands and step metrics travel on: the default group under gloo, else
    (NCCL on GPUs, which only moves CUDA tensors) a gloo group over the same ranks, created on first use —
    every rank's first command or metrics exchange, so all ranks create it in the same order."""
    if not _CONTROL:
        _CONTROL.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _CONTROL[0]


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0 sends ``payload`` (others pass ``None``); every rank returns it. Two broadcasts on
    ``control_group``: an int64 length, then (if not empty) the uint8 bytes."""
    rank0, group = dist.get_rank() == 0, control_group()
    length = torch.tensor([len(payload) if rank0 else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank0 and payload
           else torch.empty(int(length.item()), dtype=torch.uint8))
    if int(length.item()):
        dist.broadcast(buf, src=0, group=group)
    return bytes(buf.numpy().tobytes())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable ``obj``, in rank order (uint8 all-gathers on ``control_group``)."""
    group, world = control_group(), dist.get_world_size()
    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]


def gather_step_metrics(loss: float, parts: list[dict], rhos: list[torch.Tensor]
                        ) -> tuple[float, list[dict], list[torch.Tensor]]:
    """A sharded step's per-rank results made whole-batch on every rank: the loss summed (each rank's is its
    share of the batch-normalised total), the micro-batch metric dicts and importance ratios ([N] float32)
    concatenated in rank order."""
    mine = {"loss": loss, "parts": parts, "rhos": [r.tolist() for r in rhos]}
    every = all_gather_json(mine)
    return (sum(e["loss"] for e in every), [p for e in every for p in e["parts"]],
            [torch.tensor(r, dtype=torch.float32) for e in every for r in e["rhos"]])


def send_command(op: str, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Rank 0: broadcast one command. ``args`` must be JSON-serialisable; ``tensors`` are sent as they are
    (CPU, contiguous). Raises ``ValueError`` for an unknown ``op`` or a tensor dtype outside ``_DTYPES``."""
    if op not in OPS:
        raise ValueError(f"unknown learner rank command {op!r}; expected one of {OPS}")
    tensors = tensors or {}
    for name, t in tensors.items():
        if str(t.dtype) not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; rank commands carry {sorted(_DTYPES)}")
    header = {"op": op, "args": args, "tensors": [[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()]}
    broadcast_bytes(json.dumps(header).encode())
    for t in tensors.values():
        dist.broadcast(t.detach().to("cpu").contiguous(), src=0, group=control_group())


def receive_command() -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """Follower: the next ``(op, args, tensors)`` broadcast by rank 0. Raises ``RankProtocolError`` on a
    malformed header or unknown op, and what ``torch.distributed`` raises when rank 0 is gone."""
    raw = broadcast_bytes(None)
    try:
        header = json.loads(raw)
        op, args, specs = header["op"], header["args"], header["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RankProtocolError(f"malformed learner rank command header ({len(raw)} bytes): {exc}") from exc
    if op not in OPS:
        raise RankProtocolError(f"unknown learner rank command {op!r}; expected one of {OPS}")
    tensors = {}
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise RankProtocolError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        t = torch.empty(shape, dtype=_DTYPES[dtype])
        dist.broadcast(t, src=0, group=control_group())
        tensors[name] = t
    return op, args, tensors


def _batch_tensors(batch: TrainBatch) -> dict[str, torch.Tensor]:
    return {name: getattr(batch, name) for name in _BATCH_TENSORS}


def _batch_of(args: dict, tensors: dict[str, torch.Tensor]) -> TrainBatch:
    return TrainBatch(**{name: tensors[name] for name in _BATCH_TENSORS}, num_groups=int(args["num_groups"]),
                      episodes={k: float(v) for k, v in args.get("episodes", {}).items()})


class LeaderEngine:
    """Rank 0's view of a multi-rank ``LearnerEngine``: the same interface, each collective call announced to
    the followers first. Everything else (``step``, ``version``, ``config``…) is the wrapped engine's.

    Args:
        engine: rank 0's ``learner.engine.LearnerEngine`` (``torch.distributed`` world size > 1).
        on_failure: called with the exception when a collective call fails on this rank, before it is
            re-raised (the actor passes a fail-stop that ends the process: the group is broken then).
        heartbeat_s: ping the followers after this many idle seconds (``None``: never). A lock keeps each
            command and its collective call whole, so a ping never lands inside one.
    """

    def __init__(self, engine, on_failure: Callable[[BaseException], None] | None = None,
                 heartbeat_s: float | None = HEARTBEAT_S) -> None:
        self._engine = engine
        self._on_failure = on_failure
        self._lock = threading.RLock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        if heartbeat_s:
            threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="learner-rank-heartbeat",
                             daemon=True).start()

    def _run(self, op: str, args: dict, tensors: dict | None, call: Callable[[], Any]):
        with self._lock:
            try:
                send_command(op, args, tensors)
                return call()
            except BaseException as exc:
                if self._on_failure is not None:
                    self._on_failure(exc)
                raise
            finally:
                self._last = time.monotonic()

    def _heartbeat(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s / 4):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last < interval_s:
                    continue
                try:
                    self._run("ping", {}, None, lambda: None)
                except BaseException:  # _run already handed it to on_failure
                    return

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Broadcast ``batch`` ([B, L] tensors as in ``TrainBatch``) and step every rank on it."""
        return self._run("train_step", {"num_groups": batch.num_groups, "episodes": batch.episodes},
                         _batch_tensors(batch),
                         lambda: self._engine.train_step(batch))

    def named_weights(self, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        """Full weights on rank 0; under ZeRO-3 every rank takes part in the per-parameter gathers."""
        if self._engine.config.zero_stage != 3:
            return self._engine.named_weights(dtype)
        return self._run("named_weights", {"dtype": None if dtype is None else str(dtype)}, None,
                         lambda: self._engine.named_weights(dtype))

    def capture_weights(self, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        """Rank 0's device copies of the weights; under ZeRO-3 every rank takes part in the gathers, keeping nothing."""
        if self._engine.config.zero_stage != 3:
            return self._engine.capture_weights(dtype)
        return self._run("capture_weights", {"dtype": None if dtype is None else str(dtype)}, None,
                         lambda: self._engine.capture_weights(dtype))

    def save_checkpoint(self, request: CheckpointRequest):
        """Every rank writes its shard; rank 0 commits (metadata, manifest, rename) and runs
        ``request.after_commit`` (``learner.checkpoint.engine.save_checkpoint``). Followers get ``root``,
        ``fingerprint``, ``keep_last_n`` and ``async`` (whether ``request.saver`` is set): with a saver every rank
        saves in the background (each follower with its own ``BackgroundSaver``, made by ``follow``) and this
        returns rank 0's ``Future`` of the committed path once the capture is done; without one, the path."""
        return self._run("save_checkpoint", {"root": str(request.root), "fingerprint": request.fingerprint,
                                             "keep_last_n": request.keep_last_n, "async": request.saver is not None},
                         None, lambda: self._engine.save_checkpoint(request))

    def load_checkpoint(self, path, fingerprint: str = "", force: bool = False):
        """Every rank loads ``path`` (its own shard and RNG state)."""
        return self._run("load_checkpoint", {"path": str(path), "fingerprint": fingerprint, "force": force}, None,
                         lambda: self._engine.load_checkpoint(path, fingerprint, force))

    def export_hf(self, out_dir, tokenizer_dir: str) -> None:
        return self._run("export_hf", {"out_dir": str(out_dir), "tokenizer_dir": tokenizer_dir}, None,
                         lambda: self._engine.export_hf(out_dir, tokenizer_dir))

    def stop_followers(self) -> None:
        """Tell every follower to return from ``follow``; no ping is sent after it."""
        with self._lock:
            self._run("stop", {}, None, lambda: None)
            self._stopped.set()


def _log_shard_failure(future: Future) -> None:
    """A follower's background shard write ended; log it if it failed (nobody else reads this future)."""
    exc = future.exception()
    if exc is not None:
        log.error("checkpoint_shard_failed", rank=dist.get_rank(), error=f"{type(exc).__name__}: {exc}")


def follow(engine) -> int:
    """Follower ranks: run rank 0's collective engine calls until it sends ``stop``; returns the number of
    commands run (pings not counted). Raises what a failed collective raised (rank 0 gone) or
    ``RankProtocolError``.

    An asynchronous save (``async`` in the command) hands this rank's shard to a ``BackgroundSaver`` made on the
    first one, so the next command runs while it is written; a failed write is logged here (rank 0's commit
    fails on it: ``learner.checkpoint.async_save.wait_for_shards``). ``stop`` waits for a write in flight."""
    done, saver = 0, None
    while True:
        op, args, tensors = receive_command()
        if op == "ping":
            continue
        if op == "stop":
            if saver is not None:
                saver.shutdown()  # the shard in flight reaches the disk before this rank returns
            log.info("follower_stopped", rank=dist.get_rank(), commands=done)
            return done
        if op == "train_step":
            engine.train_step(_batch_of(args, tensors))
        elif op in ("named_weights", "capture_weights"):
            getattr(engine, op)(None if args["dtype"] is None else _DTYPES[args["dtype"]])
        elif op == "save_checkpoint":
            if args.get("async") and saver is None:
                saver = BackgroundSaver()
            result = engine.save_checkpoint(CheckpointRequest(args["root"], fingerprint=args["fingerprint"],
                                                              keep_last_n=args["keep_last_n"],
                                                              saver=saver if args.get("async") else None))
            if isinstance(result, Future):
                result.add_done_callback(_log_shard_failure)
        elif op == "load_checkpoint":
            engine.load_checkpoint(args["path"], args["fingerprint"], args["force"])
        elif op == "export_hf":
            engine.export_hf(args["out_dir"], args["tokenizer_dir"])
        done += 1
