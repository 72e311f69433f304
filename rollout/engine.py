"""The rollout engine: vLLM ``AsyncLLM`` behind a small API, with in-flight weight updates.

This is the only module in gyre that imports vLLM. Start it with ``await RolloutEngine.start(...)``
(construction is async because the initial policy version is sent to the engine core).

Weight updates (``update_weights``) happen while ``generate`` calls are running:
  1. validate names and shapes against the model folder's safetensors headers (nothing paused yet);
  2. write the tensors to one safetensors file (under ``/dev/shm`` when it has room) in a thread,
     while generation goes on;
  3. ``pause_generation(mode="keep")``: the scheduler freezes every in-flight request, the step that
     is running finishes and its tokens are emitted;
  4. ``collective_rpc("gyre_load_weights_file", path)``: the worker process (``GyreWorkerExtension``,
     injected by vLLM through ``worker_extension_cls``) reads the file and calls the worker's
     ``reload_weights``, i.e. ``model.load_weights`` with vLLM's layerwise reload (fuses qkv and
     gate_up, repacks for the kernels); no pickle crosses the process boundary, only the path;
  5. ``reset_prefix_cache(reset_running_requests=True)``: drops every cached block and preempts the
     kept requests, so their prompt and already-generated tokens are re-prefilled with the new
     weights on resume (no KV computed by the old policy is reused);
  6. ``update_weight_version(str(version))`` then ``resume_generation()``.

Version spans are exact. vLLM's engine core stamps every step's outputs with its current weight
version (``EngineCoreOutputs.weight_version``) and the output processor opens a new span whenever a
request's new tokens carry a different stamp (``CompletionOutput.weight_versions``). No step runs
while the scheduler is paused (a "keep" pause completes only once the engine is idle, i.e. the
running step and any async-scheduling batch queue are done and their tokens emitted), and the stamp
only changes inside that pause, so each token carries the version of the weights that sampled it.
The integration test checks this token by token against greedy decoding with each policy.

With ``weight_transport: nccl`` the rollout service receives each version from the learner's broadcast group
(``services.rollout.transport.nccl``) and hands it here as tensors, like gRPC: its tensor-parallel workers are fed
from this process.

On CPU, vLLM's attention kernels need ``head_dim`` to be a multiple of 32 (16 fails at start with
"Unsupported CPU attention configuration").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs.engine import tokens_input
from vllm.outputs import CompletionOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from gyre.proto.trajectory import FINISH_REASONS
from gyre.rollout.config import EngineConfig, SamplingConfig
from gyre.rollout.types import Sample
from gyre.rollout.weights import GyreWorkerExtension, expected_shapes, write_safetensors

__all__ = ["EngineFailedError", "RolloutEngine", "Sample", "StaleVersionError", "WeightMismatchError"]

logger = logging.getLogger(__name__)



class StaleVersionError(ValueError):
    """A weight update's version is not newer than the engine's current version."""


class WeightMismatchError(ValueError):
    """A weight update names an unknown tensor, misses one, or has a wrong shape or dtype."""


class EngineFailedError(RuntimeError):
    """A weight update failed after generation was paused; the engine must be restarted."""


class RolloutEngine:
    """One vLLM ``AsyncLLM`` serving one policy; see the module docstring for the update protocol."""

    def __init__(self, config: EngineConfig, llm: AsyncLLM, initial_version: int) -> None:
        """Use :meth:`start`; this only wires an already started ``AsyncLLM``."""
        self._config = config
        self._llm = llm
        self._version = initial_version
        self._expected, self._optional = expected_shapes(Path(config.model))
        self._update_lock = asyncio.Lock()
        self._failure: BaseException | None = None

    @classmethod
    async def start(cls, config: EngineConfig, initial_version: int = 0) -> RolloutEngine:
        """Start vLLM (blocks the event loop while it starts: 15-30 s on CPU) at ``initial_version`` (always -1 with
        ``config.load_format == "dummy"``: random weights, until the first ``update_weights``).

        vLLM spawns an engine-core and a worker process: scripts need an ``if __name__ == "__main__"``
        guard.

        Raises:
            ValueError: ``initial_version`` < -1 (-1: the model folder's weights carry no policy version
                yet; lockstep loads version 0 from its version store before generating).
        """
        if initial_version < -1:
            raise ValueError(f"initial_version ({initial_version}) must be >= -1")
        if config.load_format == "dummy":  # random weights are no policy version: the first update brings one
            initial_version = -1
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            logger.warning("VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_gib=%s",
                           os.environ["VLLM_CPU_KVCACHE_SPACE"], config.kv_cache_gib)
        cuda = not current_platform.is_cpu()
        if config.tensor_parallel_size > 1 and not cuda:
            raise ValueError(f"tensor_parallel_size ({config.tensor_parallel_size}) > 1 needs the cuda target "
                             "(vllm on GPUs); this is the cpu target: set rollout.engine.tensor_parallel_size: 1")
        args = AsyncEngineArgs(
            model=config.model, dtype=config.dtype, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, **config.device_settings(cuda),
            seed=config.seed, logprobs_mode="processed_logprobs", disable_log_stats=True, load_format=config.load_format,
            worker_extension_cls=f"{__name__}.{GyreWorkerExtension.__qualname__}",
        )
        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(str(initial_version))
        return cls(config, llm, initial_version)

    @property
    def version(self) -> int:
        """The policy version new tokens are sampled with (once an update in progress returns)."""
        return self._version

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: SamplingConfig,
                       request_id: str, seed: int | None = None) -> list[Sample]:
        """Sample ``n`` responses (one GRPO group) to one prompt; ordered by sample index.

        ``request_id`` must be unique among in-flight requests. With ``seed`` set, sample ``i``
        uses seed ``seed + i`` (reproducible for a fixed policy); without it, the engine's stream.

        Raises:
            ValueError: empty prompt, ``n < 1``, or prompt + ``max_new_tokens`` > ``max_model_len``.
            EngineFailedError: the engine failed during a weight update.
        """
        self._check_alive()
        total = len(prompt_token_ids) + sampling.max_new_tokens
        if not prompt_token_ids or n < 1 or total > self._config.max_model_len:
            raise ValueError(
                f"need a non-empty prompt ({len(prompt_token_ids)} tokens), n ({n}) >= 1 and "
                f"prompt + max_new_tokens ({total}) <= max_model_len ({self._config.max_model_len})")
        params = SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens, ignore_eos=sampling.ignore_eos, seed=seed,
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        prompt = tokens_input(list(prompt_token_ids))
        async for final in self._llm.generate(prompt, params, request_id):
            pass
        if final is None or not final.finished:
            raise RuntimeError(f"request {request_id} ended without a final output")
        outputs = sorted(final.outputs, key=lambda c: c.index)
        return [self._to_sample(request_id, c) for c in outputs]

    async def generate_greedy(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Sample]:
        """Greedy (temperature 0) responses to ``prompts``, run concurrently; one per prompt, in order.

        The ``logprobs`` of greedy samples are the log-softmax of the unscaled logits.
        """
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
        batch = uuid.uuid4().hex[:12]
        groups = await asyncio.gather(*(
            self.generate(p, 1, sampling, request_id=f"greedy-{batch}-{i}")
            for i, p in enumerate(prompts)))
        return [g[0] for g in groups]

    async def update_weights(self, version: int,
                             named_tensors: Sequence[tuple[str, torch.Tensor]],
                             rewind: bool = False) -> float:
        """Apply policy ``version`` in flight (requests are kept, not aborted); return seconds taken.

        ``named_tensors`` are HF-named tensors covering every weight of the model (a tied
        ``lm_head.weight`` may be left out), on CPU, any float dtype (cast to ``config.dtype``).

        ``rewind=True`` also accepts a version not newer than the current one: lockstep versions name exact
        weights, so a re-issued prompt may need an older one (``rollout.lockstep_gate``); and a learner that
        resumed from an older checkpoint publishes on a new timeline (``proto.timeline``), whose version
        may be lower than or equal to the dead timeline's the engine serves (``RolloutWorker.apply_weights``).

        Raises:
            StaleVersionError: ``version`` <= the current version and not ``rewind``; nothing changes.
            WeightMismatchError: unknown, missing or duplicate name, wrong shape or non-float dtype
                (raised before pausing); the old weights keep serving.
            EngineFailedError: loading failed after the pause; in-flight requests are aborted and the
                engine refuses further work (its weights are undefined).
        """
        start = time.perf_counter()
        async with self._update_lock:
            self._check_alive()
            if version <= self._version and not rewind:
                raise StaleVersionError(
                    f"weight version ({version}) must be newer than the current one ({self._version})")
            tensors = self._validated(named_tensors)
            path = await asyncio.to_thread(write_safetensors, tensors)
            try:
                paused_s = await self._swap_weights(version, self._load_file(path))
            finally:
                path.unlink(missing_ok=True)
            self._version = version
        total_s = time.perf_counter() - start
        logger.info("policy version %d applied in %.3f s (paused %.3f s)", version, total_s, paused_s)
        return total_s

    async def shutdown(self) -> None:
        """Stop vLLM's processes; blocks ~5 s (vLLM force-kills the engine core after 5 s on CPU)."""
        self._llm.shutdown()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"engine failed during a weight update: {self._failure!r}")

    def _validated(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Check names/shapes/dtypes against the checkpoint; return name -> CPU tensor to save."""
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, tensor in named_tensors:
            expected = self._expected.get(name)
            if expected is None:
                raise WeightMismatchError(f"unknown tensor {name!r}: the model {self._config.model} "
                                          "has no weight of that name")
            if tuple(tensor.shape) != expected or not tensor.is_floating_point():
                raise WeightMismatchError(f"tensor {name!r} has shape {tuple(tensor.shape)} and dtype "
                                          f"{tensor.dtype}; the model expects {expected}, float")
            if name in tensors:
                raise WeightMismatchError(f"tensor {name!r} appears more than once")
            if name in self._optional:
                continue
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.untyped_storage().data_ptr() in storages:
                tensor = tensor.clone()  # safetensors refuses tensors that share memory
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor
        missing = set(self._expected) - self._optional - set(tensors)
        if missing:
            raise WeightMismatchError(f"missing {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
        return tensors

    async def _load_file(self, path: Path) -> None:
        await self._llm.collective_rpc("gyre_load_weights_file", args=(str(path),))

    async def _swap_weights(self, version: int, load) -> float:
        """Pause (keeping requests), await ``load``, reset caches, stamp ``version``, resume."""
        start = time.perf_counter()
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await load
            if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM could not reset its prefix cache")
            await self._llm.update_weight_version(str(version))
        except WeightMismatchError:
            await self._llm.resume_generation()
            raise
        except BaseException as exc:
            self._failure = exc
            await self._llm.pause_generation(mode="abort")  # in-flight requests fail loudly
            if not isinstance(exc, Exception):
                raise  # cancellation or interrupt: propagate as is
            raise EngineFailedError(f"loading weight version {version} failed: {exc!r}") from exc
        await self._llm.resume_generation()
        return time.perf_counter() - start

    def _to_sample(self, request_id: str, out: CompletionOutput) -> Sample:
        """Convert one vLLM ``CompletionOutput`` into a :class:`Sample`."""
        if out.finish_reason not in FINISH_REASONS:
            self._check_alive()
            raise RuntimeError(f"request {request_id} sample {out.index} ended with "
                               f"finish_reason {out.finish_reason!r}")
        token_ids = list(out.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, token_ids, strict=True)]
        spans = out.weight_versions or []
        starts = [s.start for s in spans] or [0]
        versions = [int(s.version) for s in spans] or [self._version]
        return Sample(token_ids=token_ids, logprobs=logprobs, finish_reason=out.finish_reason,
                      version_span_starts=starts, version_span_versions=versions, text=out.text)

