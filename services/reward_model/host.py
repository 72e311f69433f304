"""What the reward-model service runs: reward models loaded in this process and scored in batches.

``RewardModelHost`` keeps up to ``max_models`` loaded models (least recently used dropped first), keyed by
``ModelSpec.key``, so a swap to a new revision loads it on its first request while the old one keeps serving
groups that started before the swap. ``ClassifierScorer`` is Hugging Face ``AutoModelForSequenceClassification``
(torch, one padded forward pass per ``batch_size`` responses); ``JudgeScorer`` is vLLM's offline ``LLM``
(greedy, one ``generate`` per batch). Both return ``(score, error)`` per response; see
``rollout.rewards.model`` for what each kind computes.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

from gyre.rollout.rewards.base import RewardResult
from gyre.rollout.rewards.model import ClassifierParams, JudgeParams, ModelSpec, RewardModelError, ScoreItem, folder_revision


def _render(tokenizer, prompt: list, completion: str) -> str:
    """The prompt's chat messages plus the completion as the assistant turn, in the model's chat template (plain
    ``role: content`` lines when it has none)."""
    messages = [*prompt, {"role": "assistant", "content": completion}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class ClassifierScorer:
    """A sequence-classification reward model on CPU or one GPU (float32 on CPU).

    Args:
        spec: a ``classifier`` spec (``rollout.rewards.model.model_spec``).
        batch_size: responses per forward pass.
    Raises:
        RewardModelError: the weights do not load.
    """

    def __init__(self, spec: ModelSpec, batch_size: int = 16) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.params: ClassifierParams = spec.typed_params()
        self.batch_size = batch_size
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.path)
            dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
            self.model = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=dtype).to(self.device)
        except Exception as exc:
            raise RewardModelError(f"reward model {spec.model!r}: weights do not load: {type(exc).__name__}: "
                                   f"{str(exc)[:300]}") from None
        self.model.eval()
        self.tokenizer.truncation_side = "left"  # keep the completion's end: that is what is judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the model finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = self.model.config.num_labels
        if self.params.label is not None and self.params.label >= labels:
            raise RewardModelError(f"reward model {spec.model!r}: label {self.params.label} out of range for "
                                   f"{labels} labels")

    def score(self, items: list[ScoreItem]) -> list[tuple[float, str]]:
        """``[(reward, "")]`` per item; one-label logit (optionally sigmoid), or ``softmax[label]``."""
        import torch

        out: list[tuple[float, str]] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start:start + self.batch_size]
            texts = [_render(self.tokenizer, it.prompt, it.completion) for it in chunk]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.params.max_length, add_special_tokens=False).to(self.device)
            with torch.no_grad():
                logits = self.model(**enc).logits.float()  # [B, num_labels]
            if logits.shape[-1] == 1:
                scores = logits[:, 0]
                if self.params.normalize == "sigmoid":
                    scores = torch.sigmoid(scores)
            else:
                label = logits.shape[-1] - 1 if self.params.label is None else self.params.label
                scores = torch.softmax(logits, dim=-1)[:, label]
            for s in scores.tolist():
                out.append((s, "") if math.isfinite(s) else (0.0, f"reward model gave {s}, not finite"))
        return out


class JudgeScorer:
    """A generative judge served by vLLM's offline ``LLM`` (greedy).

    Args:
        spec: a ``judge`` spec.
    Raises:
        RewardModelError: the engine does not start on the model.
    """

    def __init__(self, spec: ModelSpec, batch_size: int = 16) -> None:
        from vllm import LLM, SamplingParams

        self.params: JudgeParams = spec.typed_params()
        self.pattern = re.compile(self.params.parser)
        try:
            self.llm = LLM(model=spec.path, dtype=self.params.dtype, max_model_len=self.params.max_model_len,
                           kv_cache_memory_bytes=int(self.params.kv_cache_gib * 2**30), enforce_eager=True,
                           seed=0)
        except Exception as exc:
            raise RewardModelError(f"reward model {spec.model!r}: the judge's vLLM engine does not start: "
                                   f"{type(exc).__name__}: {str(exc)[:300]}") from None
        self.tokenizer = self.llm.get_tokenizer()
        self.sampling = SamplingParams(temperature=0.0, max_tokens=self.params.max_tokens)

    def prompt(self, item: ScoreItem) -> str:
        """The judge's chat prompt for one response (text)."""
        question = next((m["content"] for m in reversed(item.prompt) if m.get("role") == "user"), "")
        user = self.params.template.format(question=question, completion=item.completion, reference=item.reference)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                  add_generation_prompt=True)

    def prompt_ids(self, item: ScoreItem) -> dict:
        """``{"prompt_token_ids": [...]}`` of ``prompt(item)``, keeping its last ``max_model_len - max_tokens``
        tokens (a long completion is cut from the left, never refused)."""
        ids = self.tokenizer(self.prompt(item), add_special_tokens=False)["input_ids"]
        return {"prompt_token_ids": ids[-(self.params.max_model_len - self.params.max_tokens):]}

    def parse(self, reply: str) -> tuple[float, str]:
        """``(score / scale, "")``, or ``(0.0, why)`` when the reply holds no number the parser finds."""
        m = self.pattern.search(reply)
        try:
            value = float(m.group(1)) if m is not None else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            return 0.0, f"judge reply did not parse: {reply[:120]!r} (expected a match of {self.params.parser!r})"
        return value / self.params.scale, ""

    def score(self, items: list[ScoreItem]) -> list[tuple[float, str]]:
        outputs = self.llm.generate([self.prompt_ids(it) for it in items], self.sampling, use_tqdm=False)
        return [self.parse(o.outputs[0].text) for o in outputs]


class RewardModelHost:
    """Loaded reward models of one service process, scored under one lock (one batch at a time).

    Args:
        batch_size: responses per forward pass / ``generate``.
        max_models: models kept loaded; the least recently used is dropped to load another.
    """

    def __init__(self, batch_size: int = 16, max_models: int = 2) -> None:
        if max_models < 1 or batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_models ({max_models}) must be >= 1")
        self.batch_size, self.max_models = batch_size, max_models
        self.loaded: OrderedDict[str, tuple[ModelSpec, object]] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, spec: ModelSpec) -> object:
        """The scorer of ``spec``, loading it (and dropping the least recently used) if needed.

        Raises:
            RewardModelError: it does not load, or its files' revision is not ``spec.version``'s (changed
                since the rollout resolved it).
        """
        with self._lock:
            if spec.key in self.loaded:
                self.loaded.move_to_end(spec.key)
                return self.loaded[spec.key][1]
            found = folder_revision_or_commit(spec)
            if not spec.version.split("@", 1)[1].startswith(found):
                raise RewardModelError(f"reward model {spec.model!r}: its files here are revision {found}, the "
                                       f"request names {spec.version!r}")
            scorer = (ClassifierScorer if spec.kind == "classifier" else JudgeScorer)(spec, self.batch_size)
            while len(self.loaded) >= self.max_models:
                self.loaded.popitem(last=False)
            self.loaded[spec.key] = (spec, scorer)
            return scorer

    def score(self, spec: ModelSpec, items: list[ScoreItem]) -> list[tuple[float, str]]:
        """``(reward, error)`` per item (``load`` raises what it raises)."""
        scorer = self.load(spec)
        with self._lock:
            return scorer.score(items)

    def versions(self) -> dict[str, str]:
        """``{model label: version}`` of the loaded models."""
        return {spec.model: spec.version for spec, _ in self.loaded.values()}


class LocalRewardModels:
    """A ``rollout.rewards.model.Transport`` scoring in this process (a ``RewardModelHost`` of its own): what
    ``gyre eval`` uses, where no service runs. Not for a run's rollouts (each would load every model)."""

    def __init__(self, host: RewardModelHost | None = None) -> None:
        self.host = host or RewardModelHost()

    async def score(self, spec: ModelSpec, items: list[ScoreItem], deadline_s: float) -> list[RewardResult]:
        try:
            scored = await asyncio.to_thread(self.host.score, spec, items)
        except RewardModelError as exc:
            return [RewardResult(0.0, spec.version, f"reward model refused: {exc}"[:500])] * len(items)
        return [RewardResult(0.0 if e else r, spec.version, e) for r, e in scored]


def folder_revision_or_commit(spec: ModelSpec) -> str:
    """The revision of ``spec.path`` as found here: its Hub commit (12 hex) inside the HF cache, else the
    content digest (``folder_revision``)."""
    path = Path(spec.path)
    if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name):
        return path.name[:12]
    return folder_revision(path)
