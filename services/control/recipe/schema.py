"""Run recipes: a small YAML file validated into one pydantic tree of the components' configs.

``RecipeError`` and the path resolution before validation live in ``services.control.recipe.paths``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gyre import faults
from gyre.learner.algo.advantages import OUTCOME_ESTIMATORS
from gyre.learner.algo.kl_control import check_horizon
from gyre.utils.model_source import DRY_RUN, is_hub_id
from gyre.learner.loop import LearnerLoopConfig
from gyre.replay.config import ReplayConfig
from gyre.rollout.config import RolloutConfig
from gyre.rollout.dataset_files import is_hub, resolve_paths
from gyre.rollout.evaluation import EvalConfig, resolve_recipe_eval
from gyre.rollout.tasks import TaskConfig
from gyre.services.common.names import ServiceName
from gyre.services.common.security import SecurityConfig
from gyre.services.control.orchestration.placement import PlacementConfig, RayConfig
from gyre.services.control.recipe import shared_keys
from gyre.services.control.recipe.paths import RecipeError, resolve_local_paths, resolve_model
from gyre.services.control.recipe.recorded import RecordingError, check_recorded_source
from gyre.services.control.outputs.tracking.config import TrackingConfig
from gyre.services.reward_model.config import RewardServiceConfig

__all__ = ["Recipe", "RecipeError", "load_recipe"]


class Recipe(BaseModel):
    """Everything one run needs. ``model`` is copied into the rollout engine and learner configs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; outputs go to ``{run_dir}/{name}/``."""
    model: str
    """The policy at version 0, shared by rollout and learner: a local HF folder (safetensors + tokenizer) or a
    Hugging Face Hub id ``org/name``, which the loader resolves once into the HF cache (``utils.model_source``)
    and replaces by that folder (``model_id`` keeps the id)."""
    model_revision: str | None = None
    """Branch, tag or commit of a Hub id (``None``: its default branch); after loading, the commit it resolved
    to, which every service uses."""
    model_id: str | None = None
    """Set by the loader: the Hub id ``model`` was resolved from (``None`` for a local folder)."""
    run_dir: str = "runs"
    """Directory holding run directories; relative paths resolve from where gyre runs."""
    seed: int = 0
    """Seed of the run: sampling seeds in lockstep, the learner's RNG, the dataset's shuffles."""
    task: TaskConfig = TaskConfig()
    """What the rollouts generate and how it is scored: a reasoning-gym task, HumanEval, your own dataset,
    a mixture; the reward(s)."""
    reward_model: RewardServiceConfig = RewardServiceConfig()
    """The reward-model service (``services.reward_model``), started when a task's reward names a ``model``:
    batching and how many models it keeps loaded; its resources are ``placement.reward_model``."""
    rollout: RolloutConfig
    """The rollout services: engine, sampling, group size, fleet size, backpressure."""
    replay: ReplayConfig = ReplayConfig()
    """The replay service: staleness gate, selectors, rate limiter, WAL and snapshots."""
    learner: LearnerLoopConfig
    """The learner: DeepSpeed engine, algorithm, steps, batch size, checkpoints."""
    ray: RayConfig = RayConfig()
    """Which Ray cluster to run on, its namespace and the rollouts' runtime_env."""
    placement: PlacementConfig = PlacementConfig()
    """Ray resources (CPUs, GPUs, custom node resources) per role; the learner's world size."""
    security: SecurityConfig = SecurityConfig()
    """TLS/token settings every service's gRPC servers and clients use (default: loopback plaintext)."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation before, during (``every_steps``) and after training (``rollout.evaluation``). The old
    keys ``eval_before``, ``eval_after`` and ``rollout.eval_max_new_tokens`` still load, as aliases of
    ``eval.before``, ``eval.after`` and ``eval.max_new_tokens``."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment trackers fed with the metrics rows, evaluation completions and the resolved recipe: TensorBoard
    (on by default, ``{run_dir}/{name}/tb``), W&B, MLflow, trackio (on when written); a failing one warns once."""
    determinism: Literal["async", "lockstep"] = "async"
    """``lockstep`` (``proto.lockstep``): prompt i is generated with exactly policy version
    ``max(0, i // groups_per_step - lockstep_lag)`` and a seed of its own, and step s trains exactly prompts
    ``[s·P, (s+1)·P)`` in order — the run's result does not depend on crashes, restarts or timing."""
    lockstep_lag: int = Field(1, ge=0)
    """Fixed policy lag k in lockstep (0: synchronous on-policy; 1: generate step s+1 while training step s)."""
    faults: dict[str, list[str]] = {}
    """Crash tests: service name (``replay``, ``learner``, ``rollout-<i>``) → one ``GYRE_FAULT_POINT`` spec per
    incarnation of that service (``faults``): ``{learner: ["learner.ckpt.mid_write#2", "learner.publish.mid_stream"]}``
    kills the first learner process at its 2nd ``mid_write``, the restarted one at its first ``mid_stream``; the
    third runs clean. ``""`` is a clean incarnation; a single string is a list of one."""

    def model_rewards(self) -> list[dict]:
        """The distinct ``{model: ...}`` rewards of every task (``RewardConfig`` dicts); empty: no reward-model
        service."""
        from gyre.rollout.tasks import reward_configs

        out: list[dict] = []
        for task, comp in self.task.components().items():
            for cfg in reward_configs(task, comp):
                raw = cfg.model_dump(include={"model", "kind", "params"})
                if cfg.model is not None and raw not in out:
                    out.append(raw)
        return out

    @field_validator("faults", mode="before")
    @classmethod
    def _faults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"faults must map a service name to a list of fault specs, got {value!r}")
        return {name: validate_fault_specs(name, specs) for name, specs in value.items()}

    @model_validator(mode="before")
    @classmethod
    def _share_model(cls, data: Any) -> Any:
        return shared_keys.share_model(data)

    @model_validator(mode="before")
    @classmethod
    def _eval_section(cls, data: Any) -> Any:
        return resolve_recipe_eval(data) if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _share_lockstep(cls, data: Any) -> Any:
        return shared_keys.share_lockstep(data)

    @model_validator(mode="before")
    @classmethod
    def _share_groups_per_step(cls, data: Any) -> Any:
        return shared_keys.share_groups_per_step(data)

    @model_validator(mode="before")
    @classmethod
    def _share_generation_budget(cls, data: Any) -> Any:
        return shared_keys.share_generation_budget(data)

    @model_validator(mode="after")
    def _overlong_budget(self) -> "Recipe":
        algo, budget = self.learner.algorithm, self.rollout.sampling.max_new_tokens
        if algo.overlong_buffer_len > 0 and algo.max_response_tokens != budget:
            raise ValueError(f"learner.algorithm.max_response_tokens ({algo.max_response_tokens}) must equal "
                             f"rollout.sampling.max_new_tokens ({budget}) with overlong_buffer_len "
                             f"({algo.overlong_buffer_len}) > 0: the soft overlong punishment's L_max is the "
                             "rollout's generation budget (leave max_response_tokens out to take it)")
        return self

    @model_validator(mode="after")
    def _token_budget_holds_a_row(self) -> "Recipe":
        budget, longest = self.learner.engine.micro_batch_tokens, self.rollout.engine.max_model_len
        if budget is not None and budget < longest:
            raise ValueError(f"learner.engine.micro_batch_tokens ({budget}) is smaller than the longest row a rollout "
                             f"can return: rollout.engine.max_model_len ({longest}) tokens of prompt + response; set "
                             f"micro_batch_tokens >= {longest} (a packed micro-batch holds whole rows)")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        t_roll, t_learn = self.rollout.sampling.temperature, self.learner.algorithm.temperature
        if t_roll != t_learn:
            raise ValueError(f"rollout.sampling.temperature ({t_roll}) must equal learner.algorithm.temperature "
                             f"({t_learn}): the learner rescales logits to match the behaviour logprobs")
        if self.rollout.sampling.top_p != 1.0:
            raise ValueError(f"rollout.sampling.top_p ({self.rollout.sampling.top_p}) must be 1.0: the learner "
                             "cannot reproduce a truncated behaviour distribution")
        if t_roll == 0:
            raise ValueError("rollout.sampling.temperature must be > 0 for RL sampling (0 is greedy)")
        if self.determinism == "lockstep" and self.rollout.max_groups_per_version is not None:
            raise ValueError(f"rollout.max_groups_per_version ({self.rollout.max_groups_per_version}) cannot be "
                             "combined with determinism: lockstep, which fixes each prompt's policy version itself")
        if self.determinism == "lockstep" and self.rollout.engine.kind != "vllm":
            raise ValueError(f"determinism: lockstep needs rollout.engine.kind 'vllm', got "
                             f"{self.rollout.engine.kind!r}")
        if self.determinism == "lockstep" and self.replay.max_staleness < self.lockstep_lag:
            raise ValueError(f"replay.max_staleness ({self.replay.max_staleness}) must be >= lockstep_lag "
                             f"({self.lockstep_lag}): lockstep trains every group at exactly that lag")
        verifiers = self.rollout.verifiers
        if verifiers is not None and verifiers.heldout == 0 and (self.eval.before or self.eval.after
                                                                 or self.eval.every_steps):
            raise ValueError("rollout.verifiers.heldout is 0, so there is no held-out task to evaluate: hold out the "
                             "taskset's last N tasks (rollout.verifiers.heldout: N), or turn evaluation off "
                             "(eval.before: false, eval.after: false, eval.every_steps: null)")
        if verifiers is not None and self.eval.sets is not None:
            raise ValueError(f"eval.sets ({self.eval.sets}) must be unset with rollout.verifiers: its one held-out "
                             f"set is the taskset's last rollout.verifiers.heldout tasks")
        unknown_sets = sorted(set(self.eval.sets or []) - set(self.task.components()))
        if unknown_sets:
            raise ValueError(f"eval.sets {unknown_sets} are not held-out sets of the task; expected some of "
                             f"{sorted(self.task.components())}")
        tp, gpus = self.rollout.engine.tensor_parallel_size, self.placement.rollout.num_gpus
        if tp > 1 and tp > gpus:
            raise ValueError(f"rollout.engine.tensor_parallel_size ({tp}) is larger than the GPUs each rollout is "
                             f"given (placement.rollout.num_gpus: {gpus:g}): set placement.rollout.num_gpus: {tp} "
                             f"or tensor_parallel_size: {max(1, int(gpus))}")
        per_process = self.placement.rollout.rollouts_per_process
        if per_process > 1 and self.rollout.engine.kind != "simulated":
            raise ValueError(f"placement.rollout.rollouts_per_process ({per_process}) > 1 needs rollout.engine.kind "
                             f"'simulated' (fleet simulation), got {self.rollout.engine.kind!r}: one vLLM engine per "
                             "process")
        if per_process > 1 and any(str(k).startswith("rollout-") for k in self.faults):
            raise ValueError(f"faults for rollouts need placement.rollout.rollouts_per_process 1 (a fault point arms a "
                             f"process, which holds {per_process} rollouts here)")
        if self.model_revision is not None and self.model_id is None and not is_hub_id(self.model):
            raise ValueError(f"model_revision ({self.model_revision!r}) applies to a Hub id, but model "
                             f"({self.model!r}) is a local folder: remove model_revision")
        advantage, n = self.learner.algorithm.advantage, self.rollout.group_size
        if advantage in OUTCOME_ESTIMATORS and n < 2:
            raise ValueError(f"rollout.group_size ({n}) must be >= 2 for learner.algorithm.advantage {advantage!r}: its "
                             "baseline comes from the other samples of the group, and a group of one has none (every "
                             "advantage would be 0, or undefined for rloo); or set learner.algorithm.advantage: gae")
        world, rows = self.placement.learner.world_size, self.learner.groups_per_step * self.rollout.group_size
        check_horizon(self.learner.algorithm.kl_ctrl, rows)  # beta must stay positive after any one step
        if world > 1 and self.learner.engine.batch_split == "shard" and rows % world:
            raise ValueError(f"learner.groups_per_step * rollout.group_size ({rows} rows) must be a multiple of "
                             f"placement.learner.world_size ({world}) to shard each batch over the ranks; or set "
                             "learner.engine.batch_split: replicate")
        mini = self.learner.algorithm.mini_batches
        shards = world if world > 1 and self.learner.engine.batch_split == "shard" else 1
        if mini > 1 and rows % (mini * shards):
            raise ValueError(f"learner.groups_per_step * rollout.group_size ({rows} rows) must be a multiple of "
                             f"learner.algorithm.mini_batches ({mini})"
                             + (f" times placement.learner.world_size ({world})" if shards > 1 else "")
                             + " so that every optimizer update gets an equal mini-batch")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.run_dir) / self.name

    @property
    def gpus_needed(self) -> dict[str, float]:
        """GPUs each role asks for in all (``placement``; the learner's times its world size, replay's times its
        shards); roles asking none are left out."""
        pl = self.placement
        need = {"replay": pl.replay.num_gpus * self.replay.shards, "learner": pl.learner.num_gpus * pl.learner.world_size,
                "rollout": pl.rollout.num_gpus * self.rollout.num_workers}
        return {role: n for role, n in need.items() if n > 0}



def fault_service(service: Any) -> ServiceName | None:
    """The service a recipe's ``faults`` key names, if it may be armed: ``replay``, ``learner`` or ``rollout-<i>``
    (any index, scaled ones too; not the ranks >= 1 of a multi-rank learner); else ``None``."""
    try:
        name = ServiceName.parse(service)
    except ValueError:
        return None
    return None if name.role == "learner" and name.index else name


def validate_fault_specs(service: Any, specs: Any) -> list[str]:
    """Check one ``faults`` entry: ``service`` is ``replay``, ``learner`` or ``rollout-<i>``, and each spec (a
    ``GYRE_FAULT_POINT`` value, ``faults.parse_spec``) arms only that service's points (``replay.*``, ``learner.*``,
    ``rollout.*``). Returns the specs as a list (a single string becomes a list of one).

    Raises:
        ValueError: an unknown service name, a spec that is not a string, an unknown point, a bad hit count or
            errno, or a point of another service — naming the key, the spec and what was expected.
    """
    name = fault_service(service)
    if name is None:
        raise ValueError(f"faults: unknown service {service!r}; expected 'replay', 'learner', 'rollout-<i>' or 'reward_model'")
    specs = [specs] if isinstance(specs, str) else specs
    if not isinstance(specs, list):
        raise ValueError(f"faults.{service}: expected a list of fault specs (one per incarnation), got {specs!r}")
    prefix = name.role + "."
    for i, spec in enumerate(specs):
        if not isinstance(spec, str):
            raise ValueError(f"faults.{service}[{i}]: expected a fault spec string like "
                             f"'{prefix}...#2', got {spec!r}")
        try:
            points = faults.parse_spec(spec)
        except ValueError as exc:
            raise ValueError(f"faults.{service}[{i}]: {exc}") from None
        foreign = sorted(p for p in points if not p.startswith(prefix))
        if foreign:
            raise ValueError(f"faults.{service}[{i}]: {spec!r} arms {', '.join(foreign)}, which {service} never "
                             f"reaches; expected '{prefix}*' points")
    return list(specs)


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None, dry_run: bool = False) -> Recipe:
    """Read, validate and resolve a recipe; relative model/run paths become absolute (from the CWD), and a
    ``model: org/name`` Hub id is downloaded once into the HF cache (``utils.model_source.resolve``) and
    pinned to the commit it resolved to. ``dry_run``: a Hub id is checked for its form only, nothing is
    downloaded and no model folder is read.

    Raises:
        RecipeError: missing file, bad YAML, unknown key, wrong type, missing model folder, a Hub id that cannot
            be had (unknown, gated, offline and not cached), unknown task, a reward (name, params, or a
            ``function`` that does not import or cannot take ``(completions, prompts=...)``; the message names
            its path), a ``replay.source`` recording that is missing, incomplete or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_bytes().decode()) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(f"recipe {path} is not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#04x}") from None
    except RecursionError:
        raise RecipeError(f"recipe {path} nests lists/mappings too deeply to parse") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a mapping at top level, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    if "model_id" in data:
        raise RecipeError(f"recipe {path}: model_id is set by the loader; put the Hub id in model: instead")
    resolve_model(data, path, dry_run)
    if isinstance(data.get("task"), dict):
        resolve_paths(data["task"])  # dataset files: absolute, from the CWD
    resolve_local_paths(data, Path.cwd())  # reward files, runtime_env: from the CWD too
    if isinstance(data.get("run_dir"), str):
        data["run_dir"] = str(Path(data["run_dir"]).expanduser().resolve())
    try:
        recipe = Recipe.model_validate(data, context={DRY_RUN: dry_run})
    except ValidationError as exc:
        problems = format_validation_error(exc)
        sep = " " if "\n" not in problems else "\n"  # one problem: one line
        raise RecipeError(f"recipe {path}:{sep}{problems.strip() if sep == ' ' else problems}") from None
    _check_resources(recipe, path, dry_run)
    try:
        check_recorded_source(recipe)  # replay.source: the recording reads whole and verified
    except RecordingError as exc:
        raise RecipeError(f"recipe {path}: replay.source: {exc}") from None
    return recipe


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for i, p in enumerate(parents):
        data = data.setdefault(p, {})
        if not isinstance(data, dict):
            raise RecipeError(f"--set {dotted}: {'.'.join(parents[:i + 1])} is a {type(data).__name__}, "
                              "not a mapping")
    data[leaf] = value


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``  key.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key")
        elif err["type"] == "missing":
            lines.append(f"  {loc}: required key is missing")
        elif not err["loc"]:  # a whole-recipe check: its message names the values, the input is the recipe
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _check_resources(recipe: Recipe, path: Path, dry_run: bool = False) -> None:
    import reasoning_gym

    from gyre.rollout.tasks import TaskSource, reward_configs, validate_task_config

    task = recipe.task
    if task.mixture is None and task.name != "humaneval" and task.name not in reasoning_gym.factory.DATASETS:
        raise RecipeError(f"recipe {path}: task.name {task.name!r} is not a reasoning-gym dataset")
    try:
        validate_task_config(task)  # mixture task names, reward names and params, reward functions import
        datasets = [c.dataset for c in task.components().values() if c.dataset]
        functions = any(r.function for c in task.components().items() for r in reward_configs(*c))
        if datasets and not (dry_run and any(is_hub(d.path, d.format) for d in datasets)):
            TaskSource(task)  # loads each dataset (files, split, columns, rows), the rewards' fit, functions' signatures
        elif functions:
            TaskSource(task)  # a function's signature against the entries' columns
    except ValueError as exc:
        raise RecipeError(f"recipe {path}: task: {exc}") from None
