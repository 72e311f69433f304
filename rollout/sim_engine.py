"""A simulated rollout engine, for benchmarks of the pipeline around the engine (``bench.pipeline``).

``SimulatedEngine`` has the surface ``RolloutWorker``, ``RolloutActor`` and the weight transports use
(``start``, ``version``, ``generate``, ``generate_greedy``, ``update_weights``, ``shutdown``) but samples
nothing: a group "generates" for a configured time (``SimulatedEngineConfig``: fixed seconds per group, or
seconds per token × ``n`` × ``max_new_tokens``) while the event loop runs on, and its samples are token ids
drawn from a seeded RNG over the tokenizer's vocabulary, each ``max_new_tokens`` long (finish reason
``"length"``). Groups in flight "generate" concurrently, each for its full time (as vLLM batches them,
with capacity to spare). It stands in for a vLLM engine on its own GPUs: it takes none of the learner's
CPU, so a benchmark measures how gyre overlaps generation with training, not how two engines share two
cores.

Weight updates are real: each policy version the learner publishes arrives over the configured transport
(gRPC), is checked tensor by tensor against the model folder's safetensors headers (names, shapes, float
dtypes, nothing missing) and is then "applied": generation pauses for ``apply_s`` seconds (vLLM's pause →
load → cache reset → resume), then new tokens carry the new version. Version spans follow the
simulation's clock: a group's tokens are spread evenly over its generation interval (start to end, wall
clock), and a span starts at the first token placed at or after the moment an update was applied.

Never train on its output: it is random text (rewards ~0). Select it with ``engine.kind: simulated``.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog
import torch

from gyre.rollout.config import EngineConfig, SamplingConfig
from gyre.rollout.types import Sample
from gyre.rollout.weights import expected_shapes

log = structlog.get_logger("sim_engine")

LOGPROB_NOISE = 0.1
"""Std of the Gaussian noise around ``-log(vocab)`` in the behaviour logprobs (nats)."""


def version_spans(history: Sequence[tuple[float, int]], t0: float, t1: float,
                  num_tokens: int) -> tuple[list[int], list[int]]:
    """Policy-version spans of ``num_tokens`` tokens sampled evenly over ``[t0, t1]`` (seconds).

    ``history`` lists ``(applied_at, version)`` in increasing time, its first entry no later than ``t0``.
    Token ``k`` is sampled at ``t0 + k (t1 - t0) / num_tokens``; it carries the newest version applied at
    or before that time. Returns ``(starts [S], versions [S])`` as in ``Sample.version_span_*``.

    Raises:
        ValueError: ``num_tokens < 1``, ``t1 < t0``, or no version was applied by ``t0``.
    """
    if num_tokens < 1 or t1 < t0:
        raise ValueError(f"need num_tokens ({num_tokens}) >= 1 and t1 ({t1}) >= t0 ({t0})")
    before = [v for t, v in history if t <= t0]
    if not before:
        raise ValueError(f"no policy version was applied by t0 ({t0}); history starts at {history[:1]}")
    starts, versions = [0], [before[-1]]
    for applied_at, version in history:
        if applied_at <= t0 or applied_at > t1:
            continue
        k = math.ceil((applied_at - t0) / (t1 - t0) * num_tokens)
        if k >= num_tokens:
            break
        if k == starts[-1]:
            versions[-1] = version  # two updates before the same token: the newer one sampled it
        else:
            starts.append(k)
            versions.append(version)
    return starts, versions


def check_weights(named_tensors: Sequence[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]],
                  optional: set[str], model: str) -> int:
    """Check one policy version against the model: every name known, once, with its shape and a float dtype,
    none missing (``optional`` names may be absent). Returns the bytes received.

    Raises:
        ValueError: naming the first bad tensor (unknown, duplicated, wrong shape/dtype) or the missing ones.
    """
    seen: set[str] = set()
    nbytes = 0
    for name, tensor in named_tensors:
        want = expected.get(name)
        if want is None:
            raise ValueError(f"unknown tensor {name!r}: the model {model} has no weight of that name")
        if tuple(tensor.shape) != want or not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                             f"the model expects {want}, float")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears more than once")
        seen.add(name)
        nbytes += tensor.numel() * tensor.element_size()
    missing = set(expected) - optional - seen
    if missing:
        raise ValueError(f"missing {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
    return nbytes


class SimulatedEngine:
    """Sleeps instead of sampling; see the module docstring. Build it with ``await SimulatedEngine.start``."""

    def __init__(self, config: EngineConfig, tokenizer, initial_version: int = 0) -> None:
        """Use :meth:`start`. Raises ``ValueError`` unless ``config.kind == "simulated"``."""
        if config.kind != "simulated" or config.simulated is None:
            raise ValueError(f"SimulatedEngine needs engine kind 'simulated', got {config.kind!r}")
        self._config, self._sim, self._tokenizer = config, config.simulated, tokenizer
        self._vocab = len(tokenizer)
        self._expected, self._optional = expected_shapes(Path(config.model))
        self._version = initial_version
        self._history: list[tuple[float, int]] = [(float("-inf"), initial_version)]
        self._rng = np.random.default_rng(config.seed)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._paused_total = 0.0
        self._update_lock = asyncio.Lock()
        self.applied_bytes = 0
        """Bytes of weights received and checked, over every update."""

    @classmethod
    async def start(cls, config: EngineConfig, initial_version: int = 0) -> SimulatedEngine:
        """Load the model folder's tokenizer and safetensors headers (no weights); ``initial_version`` >= 0.

        Raises:
            ValueError: ``initial_version`` is negative, or ``config.kind`` is not ``"simulated"``.
        """
        from transformers import AutoTokenizer

        if initial_version < 0:
            raise ValueError(f"initial_version ({initial_version}) must be >= 0")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, config.model)
        return cls(config, tokenizer, initial_version)

    @property
    def version(self) -> int:
        """The policy version new tokens are sampled with."""
        return self._version

    def group_seconds(self, n: int, max_new_tokens: int) -> float:
        """Unpaused seconds one group of ``n`` samples of ``max_new_tokens`` tokens takes."""
        if self._sim.seconds_per_group is not None:
            return self._sim.seconds_per_group
        return self._sim.seconds_per_token * n * max_new_tokens

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: SamplingConfig,
                       request_id: str, seed: int | None = None) -> list[Sample]:
        """One group after ``group_seconds`` of unpaused time: ``n`` ``Sample``s, each with ``token_ids`` [T]
        uniform over the tokenizer's vocabulary V and ``logprobs`` [T] (float32 values ``-log V`` plus
        N(0, ``LOGPROB_NOISE``²) noise, capped at 0: a uniform policy's, like a randomly initialised model's),
        ``T = sampling.max_new_tokens``, finish reason ``"length"``. With ``seed`` the tokens depend only on
        (engine seed, seed).

        Raises:
            ValueError: empty prompt, ``n < 1``, or prompt + ``max_new_tokens`` > ``max_model_len``.
        """
        total = len(prompt_token_ids) + sampling.max_new_tokens
        if not prompt_token_ids or n < 1 or total > self._config.max_model_len:
            raise ValueError(
                f"need a non-empty prompt ({len(prompt_token_ids)} tokens), n ({n}) >= 1 and "
                f"prompt + max_new_tokens ({total}) <= max_model_len ({self._config.max_model_len})")
        t0 = await self._run_for(self.group_seconds(n, sampling.max_new_tokens))
        spans = version_spans(self._history, t0, time.monotonic(), sampling.max_new_tokens)
        rng = np.random.default_rng([self._config.seed, seed]) if seed is not None else self._rng
        return [self._sample(rng, sampling.max_new_tokens, spans) for _ in range(n)]

    async def generate_greedy(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Sample]:
        """One sample per prompt (concurrently, in order), seeded by the prompt's tokens (deterministic)."""
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
        return [g[0] for g in await asyncio.gather(*(
            self.generate(p, 1, sampling, f"greedy-{i}", seed=zlib.crc32(np.asarray(p, np.int64).tobytes()))
            for i, p in enumerate(prompts)))]

    async def update_weights(self, version: int, named_tensors, rewind: bool = False) -> float:
        """Check a policy version's tensors against the model, pause generation ``apply_s`` seconds and
        switch to ``version``; returns the seconds the update took. ``rewind`` as in ``RolloutEngine``.

        Raises:
            ValueError: ``version`` is not newer than the current one (and not ``rewind``), the payload is not named tensors
                (the simulated engine takes the gRPC transport only), or a tensor is wrong (``check_weights``).
        """
        start = time.perf_counter()
        if not isinstance(named_tensors, (list, tuple)):
            raise ValueError(f"the simulated engine takes named tensors (gRPC transport), got "
                             f"{type(named_tensors).__name__}; set weight_transport type 'grpc'")
        async with self._update_lock:
            if version <= self._version and not rewind:
                raise ValueError(f"weight version ({version}) must be newer than the current one ({self._version})")
            nbytes = check_weights(named_tensors, self._expected, self._optional, self._config.model)
            self._resumed.clear()
            paused = time.monotonic()
            try:
                await asyncio.sleep(self._sim.apply_s)
                self._version = version
                self._history = self._history[-63:] + [(time.monotonic(), version)]  # a group spans far fewer
            finally:
                self._paused_total += time.monotonic() - paused
                self._resumed.set()
            self.applied_bytes += nbytes
        seconds = time.perf_counter() - start
        log.info("sim_weights_applied", version=version, bytes=nbytes, seconds=round(seconds, 4))
        return seconds

    async def shutdown(self) -> None:
        """Nothing to stop (no processes); present for ``RolloutActor.stop``."""

    async def _run_for(self, seconds: float) -> float:
        """Wait until ``seconds`` of unpaused time passed; returns the (monotonic) time generation began."""
        await self._resumed.wait()
        t0, paused0 = time.monotonic(), self._paused_total
        while True:
            active = time.monotonic() - t0 - (self._paused_total - paused0)
            if active >= seconds:
                return t0
            await asyncio.sleep(seconds - active)
            await self._resumed.wait()

    def _sample(self, rng: np.random.Generator, length: int, spans: tuple[list[int], list[int]]) -> Sample:
        ids = rng.integers(0, self._vocab, size=length)
        logprobs = (-math.log(self._vocab) + LOGPROB_NOISE * rng.standard_normal(length)).astype(np.float32)
        return Sample(token_ids=ids.tolist(), logprobs=np.minimum(logprobs, 0.0).tolist(), finish_reason="length",
                      version_span_starts=list(spans[0]), version_span_versions=list(spans[1]),
                      text=self._tokenizer.decode(ids.tolist(), skip_special_tokens=True))
