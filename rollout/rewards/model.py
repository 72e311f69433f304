"""Learned reward models as rewards (``reward: {model: <folder or Hub id>, kind: classifier | judge}``).

A model reward is scored by the run's **reward-model service** (``services.reward_model``), not in the rollout:
one process holds the model, batches the requests of every rollout and answers a score per response. The
rollout side is ``ModelReward``: a reward part like any other (weights mix it with verifier rewards in a
``RewardSet``), whose ``score_groups`` sends the groups' (prompt, completion) pairs through the process's
*transport* (``set_transport``; the rollout actor installs a gRPC client, ``services.rollout.reward_client``)
and waits up to ``timeout_s`` — retried meanwhile while the service restarts — before recording
``reward_error = "timeout: ..."``.

Kinds:

- ``classifier``: ``AutoModelForSequenceClassification`` (the usual RLHF reward model, e.g. the
  Skywork/ArmoRM family or TRL's ``RewardTrainer`` output). The prompt's chat messages plus the completion as
  the assistant turn are rendered with the model's chat template and scored in one forward pass; one label:
  the logit is the reward; several: ``softmax[label]``. ``params``: ``max_length``, ``label``, ``normalize``.
- ``judge``: a generative model served by vLLM (LLM-as-a-judge, as in verl's GenRM recipes): ``params.template``
  (``{question}``, ``{completion}``, ``{reference}`` — the entry's ``answer``) is the user message, the reply
  is greedy, and ``params.parser`` (a regex whose first group is a number) reads the score, divided by
  ``params.scale``. A reply that does not parse is a failed score (``reward_error``), never a 0 the learner
  trains on.

Version (``reward_fn_version``): ``rm:<kind>:<label>@<revision>[:<params hash>]`` — the Hub commit of a Hub id
(or of a folder inside the HF cache), else the first 12 hex of the sha256 of the folder's config and weight
files (``params.revision`` picks a Hub branch, tag or commit); ``params`` other than the defaults add the sha256 of their canonical JSON. The service answers the
version it computed from the files it loaded; a reply under another version (the files changed on one
node) is a failed score.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gyre.rollout.rewards.base import Group, RewardConfig, RewardResult

WEIGHT_GLOBS = ("config.json", "*.safetensors", "*.bin")
"""Files whose bytes make a local folder's revision."""


class RewardModelError(ValueError):
    """A reward model that cannot be used: the folder or Hub id does not resolve, its config does not load, its
    architecture does not fit ``kind``, or bad ``params``; the message names the value and what was expected."""


class ClassifierParams(BaseModel):
    """``params`` of a ``classifier`` reward model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: int = Field(1024, ge=8)
    """Tokens of prompt + completion scored; longer inputs keep their last ``max_length`` tokens."""
    label: int | None = Field(None, ge=0)
    """With several labels: the one whose softmax probability is the reward (default: the last). One label: unset."""
    normalize: Literal["none", "sigmoid"] = "none"
    """``sigmoid`` maps a one-label logit into (0, 1) (Bradley–Terry win probability against a 0-logit reference)."""


class JudgeParams(BaseModel):
    """``params`` of a ``judge`` reward model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    template: str = ("Rate the answer to the question from 0 to 10.\nQuestion: {question}\nAnswer: {completion}\n"
                     "Reply with only the number.")
    """User message to the judge; ``{question}`` (the prompt's last user message), ``{completion}`` and
    ``{reference}`` (the problem entry's ``answer``, ``""`` if none) are filled in."""
    parser: str = r"(-?\d+(?:\.\d+)?)"
    """Regex searched in the judge's reply; its first group is the score (a number)."""
    scale: float = Field(10.0, gt=0)
    """The parsed number is divided by this (0–10 → 0–1)."""
    max_tokens: int = Field(16, ge=1)
    """Tokens the judge may reply with (greedy)."""
    max_model_len: int = Field(2048, ge=64)
    """vLLM context of the judge; longer prompts are truncated from the left."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """vLLM dtype of the judge."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache memory of the judge's vLLM engine, GiB."""

    @model_validator(mode="after")
    def _parsable(self) -> "JudgeParams":
        try:
            pattern = re.compile(self.parser)
        except re.error as exc:
            raise ValueError(f"parser {self.parser!r} is not a regex: {exc}") from None
        if pattern.groups < 1:
            raise ValueError(f"parser {self.parser!r} needs a group capturing the number, e.g. r'(\\d+)'")
        try:
            self.template.format(question="", completion="", reference="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template {self.template!r} may only use {{question}}, {{completion}} and "
                             f"{{reference}} (double other braces): {exc!r}") from None
        return self


PARAMS = {"classifier": ClassifierParams, "judge": JudgeParams}


@dataclass(frozen=True)
class ModelSpec:
    """One reward model as the service loads it; ``key`` (canonical JSON) crosses the wire."""

    model: str
    """The folder or Hub id as configured."""
    kind: str
    """``classifier`` or ``judge``."""
    params: dict
    """The validated params (every field, defaults filled in)."""
    path: str
    """The local folder the files are in (a Hub id's snapshot folder)."""
    version: str
    """``reward_fn_version`` of its scores (module docstring)."""
    revision: str | None = None
    """The Hub commit a Hub id resolved to (``None``: a local folder)."""

    @property
    def key(self) -> str:
        """Canonical JSON of ``{model, kind, params, version, revision}``: what a request names."""
        return json.dumps({"model": self.model, "kind": self.kind, "params": self.params, "version": self.version,
                           "revision": self.revision}, sort_keys=True, separators=(",", ":"))

    def typed_params(self) -> ClassifierParams | JudgeParams:
        return PARAMS[self.kind].model_validate(self.params)


def _resolve(model: str, revision: str | None) -> tuple[Path, str | None]:
    """``(local folder, Hub commit or None)``; raises ``RewardModelError``."""
    path = Path(model).expanduser()
    if path.is_dir():
        commit = path.name if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name) else None
        return path.resolve(), commit
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") != 1:
        raise RewardModelError(f"reward model {model!r}: no such folder, and not a Hub id 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(model, revision=revision, allow_patterns=["*.json", "*.safetensors",
                                                                               "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # offline and not cached, unknown id, no access: all mean "does not load"
        raise RewardModelError(f"reward model {model!r}: not a folder, and the Hub id does not resolve "
                               f"({type(exc).__name__}: {str(exc)[:300]})") from None
    return folder, folder.name


@functools.lru_cache(maxsize=64)
def _folder_digest(folder: str, stamp: tuple) -> str:
    """sha256 (12 hex) of the folder's config and weight files, in name order (``stamp``: their sizes and mtimes,
    so an edited file is hashed again)."""
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(name.encode() + b"\0")
        with open(Path(folder) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def folder_revision(folder: Path) -> str:
    """The content revision of a local model folder (``WEIGHT_GLOBS``' files). Raises ``RewardModelError`` when
    it holds no ``config.json``."""
    if not (folder / "config.json").is_file():
        raise RewardModelError(f"reward model folder {str(folder)!r} has no config.json (expected a Hugging Face "
                               "model folder)")
    files = sorted({p for g in WEIGHT_GLOBS for p in folder.glob(g) if p.is_file()})
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _folder_digest(str(folder), stamp)


def _check_architecture(folder: Path, kind: str, model: str) -> None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise RewardModelError(f"reward model {model!r}: its config does not load: {type(exc).__name__}: "
                               f"{str(exc)[:300]}") from None
    archs = list(getattr(config, "architectures", None) or [])
    if kind == "classifier" and archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"reward model {model!r} is a {archs}, not a sequence classifier (expected an "
                               "*ForSequenceClassification architecture for kind 'classifier'; a chat model "
                               "is kind 'judge')")
    if kind == "judge" and any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"reward model {model!r} is a {archs}: a classifier cannot be kind 'judge'")


def model_spec(config: RewardConfig) -> ModelSpec:
    """Resolve and check a ``{model: ...}`` reward (no weights are loaded: the folder, its config and
    architecture, the params).

    Raises:
        RewardModelError: see the class.
    """
    kind = config.kind
    params = dict(config.params)
    revision = params.pop("revision", None)
    try:
        typed = PARAMS[kind].model_validate(params)
    except ValidationError as exc:
        raise RewardModelError(f"reward model {config.model!r} ({kind}): bad params {params}: {exc}") from None
    folder, commit = _resolve(config.model, revision)
    _check_architecture(folder, kind, config.model)
    rev = commit[:12] if commit else folder_revision(folder)
    dumped = typed.model_dump()
    version = f"rm:{kind}:{config.label[3:]}@{rev}"
    if dumped != PARAMS[kind]().model_dump():
        blob = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
        version += ":" + hashlib.sha256(blob.encode()).hexdigest()[:8]
    return ModelSpec(config.model, kind, dumped, str(folder), version, commit)


@dataclass(frozen=True)
class ScoreItem:
    """One response to score."""

    prompt: list
    """The chat messages it answered (``list[dict[str, str]]``)."""
    completion: str
    reference: str = ""
    """The problem entry's ``answer`` as text (judges may quote it), ``""`` if none."""


class Transport(Protocol):
    """How a process reaches the reward-model service."""

    async def score(self, spec: ModelSpec, items: list[ScoreItem], deadline_s: float) -> list[RewardResult]:
        """One ``RewardResult`` per item, in order, within ``deadline_s`` seconds; never raises for the service's
        failure (``error`` says what happened)."""


_TRANSPORT: Transport | None = None


def set_transport(transport: Transport | None) -> None:
    """Install the process's way to the reward-model service (the rollout actor's gRPC client)."""
    global _TRANSPORT
    _TRANSPORT = transport


def transport() -> Transport | None:
    return _TRANSPORT


class ModelReward:
    """A ``{model: ...}`` reward part: ``name``, ``version``, ``timeout_s``, ``check_entry`` and
    ``score_groups`` as a built-in reward has; scores come from the reward-model service.

    Raises:
        RewardModelError: the model does not resolve or does not fit its ``kind`` (``model_spec``).
    """

    def __init__(self, config: RewardConfig) -> None:
        self.spec = model_spec(config)
        self.name, self.version, self.timeout_s = config.label, self.spec.version, config.timeout_s

    def check_entry(self, entry: dict) -> None:
        """Any entry: a reward model reads the prompt and the completion (and ``answer`` if there is one)."""

    async def score_groups(self, groups: list[Group]) -> list[list[RewardResult]]:
        """Every completion of each group scored in one request; results per group, in order. A missing
        transport, a service down past ``timeout_s`` or a reply under another version fail the rows."""
        items = [ScoreItem(list(prompt), text, str(g.entry.get("answer", "")))
                 for g in groups for prompt, text in zip(g.prompts, g.completions)]
        via = _TRANSPORT
        if via is None:
            flat = [RewardResult(0.0, self.version, f"reward model {self.name}: no reward-model service is "
                                                    "reachable from this process")] * len(items)
        elif not items:
            flat = []
        else:
            flat = await via.score(self.spec, items, self.timeout_s)
        flat = [r if r.error or r.version == self.version else
                RewardResult(0.0, self.version, f"reward model {self.name}: the service scored with version "
                                                f"{r.version!r}, expected {self.version!r}") for r in flat]
        out, i = [], 0
        for g in groups:
            out.append(flat[i:i + len(g.completions)])
            i += len(g.completions)
        return out

