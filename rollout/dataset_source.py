"""``DatasetSource``: a recipe's own dataset as a task source (beside ``ReasoningGymSource``/``HumanEvalSource``).

Prompt index → row, deterministically in every process: with ``N`` training rows, index ``i`` is row
``perm_e[i % N]`` of epoch ``e = i // N``, where ``perm_e`` is a permutation of the training rows drawn by
``numpy.random.default_rng([seed, e])``. Every training row is therefore used exactly once per epoch, and the
prompt ledger's exactly-once accounting, resume and lockstep work on indices as before.

Held-out rows (a separate file/split, a seeded fraction, or by default ``heldout_size`` seeded rows) never
train. Rows whose prompt does not fit the engine's context (``PromptBudget``) are skipped when the source is
built and counted (``too_long``): such a row gets no prompt index at all, so no lease is ever issued for a
prompt the engine would refuse and the ledger needs no "completed without data" path. The budget depends on
the tokenizer and ``max_model_len``; every rollout of a run has the same ones, so all map indices alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import structlog

from gyre.rollout.dataset_files import DatasetConfig, DatasetError, load_split

__all__ = ["DatasetSource", "PromptBudget"]

log = structlog.get_logger("rollout.dataset")

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptBudget:
    """How many prompt tokens the engine takes: ``max_model_len`` minus the generation budget.

    Attributes:
        count_tokens: prompt tokens of chat messages (chat template applied, generation prompt added).
        train_max: most prompt tokens of a training prompt (``max_model_len - sampling.max_new_tokens``).
        eval_max: most prompt tokens of an evaluation prompt (``max_model_len - eval_max_new_tokens``).
    """

    count_tokens: Callable[[Messages], int]
    train_max: int
    eval_max: int

    @classmethod
    def for_tokenizer(cls, tokenizer, max_model_len: int, max_new_tokens: int, eval_max_new_tokens: int):
        """A budget counting with ``tokenizer.apply_chat_template``; a prompt whose UTF-8 bytes plus the
        template's own tokens (and 16 per message) fit is accepted without tokenizing (a byte-level token
        covers at least one byte)."""
        def exact(messages: Messages) -> int:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

        overhead = exact([{"role": "user", "content": ""}])

        def count(messages: Messages) -> int:
            bound = overhead + sum(16 + len(m["content"].encode()) for m in messages)
            return bound if bound <= min(train, ev) else exact(messages)

        train, ev = max_model_len - max_new_tokens, max_model_len - eval_max_new_tokens
        return cls(count, train, ev)


class DatasetSource:
    """Training stream and held-out set of one dataset (``rollout.dataset_files.DatasetConfig``).

    Entries (what the reward reads) are the row as a dict — every column — with ``question`` (the prompt
    text; for chat messages the last user message) and, when ``columns.answer`` is set, ``answer``.

    Args:
        name: task name. config: the dataset. seed: seed of the per-epoch permutations.
        heldout_seed, heldout_size: without ``config.eval``, this many seeded rows are held out; with it, at most
            this many eval rows are scored.
        system_prompt: prepended to a string prompt, and to chat messages that have no system message.
        suffix: appended (after a space) to a string prompt.
        budget: skip (and count) prompts longer than the engine's context; ``None``: keep all.
    Raises:
        DatasetError: missing file, unknown split or column (naming those there are), a prompt column of another
            type, null prompts, an empty split, or no row left for training or evaluation.
    """

    dataset = None  # the reward registry's reasoning-gym hook (none here)

    def __init__(self, name: str, config: DatasetConfig, seed: int, heldout_seed: int, heldout_size: int,
                 system_prompt: str | None = None, suffix: str = "", budget: PromptBudget | None = None) -> None:
        self.name, self.config, self.seed = name, config, seed
        self._system, self._suffix = system_prompt, suffix
        ev = config.eval
        if ev is not None and ev.path is None and ev.split == config.split:
            raise DatasetError(f"eval.split ({ev.split!r}) is the training split: the two would not be disjoint")
        self._data = self._load(config.path, config.format, config.split)
        n = len(self._data)
        if ev is None or ev.heldout_fraction is not None:
            k = heldout_size if ev is None else max(1, round(ev.heldout_fraction * n))
            if k >= n:
                raise DatasetError(f"dataset {config.path} split {config.split!r} has {n} rows; holding out {k} "
                                   "leaves none to train on (lower task.heldout_size or set task.dataset.eval)")
            order = np.random.default_rng([heldout_seed if ev is None else ev.seed]).permutation(n)
            held, train = np.sort(order[:k]), np.sort(order[k:])
            self._eval_data = self._data
        else:
            train = np.arange(n)
            self._eval_data = self._load(ev.path or config.path, ev.format if ev.path else config.format,
                                         ev.split or "train")
            held = np.arange(len(self._eval_data))
        self.too_long = {"train": 0, "eval": 0}
        """Rows skipped because their prompt does not fit the engine's context, per role."""
        self._train = self._fitting(self._data, train, budget and budget.train_max, budget, "train")
        self._heldout = self._fitting(self._eval_data, held, budget and budget.eval_max, budget, "eval")[:heldout_size]
        self._epoch: tuple[int, np.ndarray] | None = None
        log.info("dataset_loaded", task=name, path=config.path, rows=n, train_rows=len(self._train),
                 heldout_rows=len(self._heldout), too_long=self.too_long)

    def _load(self, path: str, fmt, split: str):
        ds = load_split(path, fmt, split)
        cols = self.config.columns
        for role, col in (("prompt", cols.prompt), ("answer", cols.answer)):
            if col is not None and col not in ds.column_names:
                raise DatasetError(f"dataset {path} split {split!r} has no column {col!r} (columns.{role}); its "
                                   f"columns are {ds.column_names}")
        if len(ds) == 0:
            raise DatasetError(f"dataset {path} split {split!r} has no rows")
        feature = ds.features[cols.prompt]
        inner = getattr(feature, "feature", None)
        is_text = getattr(feature, "dtype", None) in ("string", "large_string")
        is_chat = isinstance(inner, dict) and {"role", "content"} <= set(inner)
        if not (is_text or is_chat):
            raise DatasetError(f"dataset {path}: column {cols.prompt!r} (columns.prompt) must hold strings or lists "
                               f"of {{role, content}} chat messages; it holds {feature}")
        if nulls := ds.data.column(cols.prompt).null_count:
            raise DatasetError(f"dataset {path} split {split!r}: column {cols.prompt!r} has {nulls} empty (null) "
                               "prompts")
        return ds

    def _fitting(self, ds, rows: np.ndarray, limit: int | None, budget: PromptBudget | None, role: str) -> np.ndarray:
        """``rows`` whose prompt fits ``limit`` tokens (all of them without a budget); counts the others."""
        if budget is not None:
            prompts = ds.select(rows).select_columns([self.config.columns.prompt])
            keep = [budget.count_tokens(self._messages(p[self.config.columns.prompt])) <= limit for p in prompts]
            self.too_long[role] = len(keep) - sum(keep)
            rows = rows[np.asarray(keep, dtype=bool)]
        if len(rows) == 0:
            raise DatasetError(f"dataset {self.config.path}: no {role} row left ({self.too_long[role]} prompts "
                               f"longer than the engine's context, {limit} tokens)")
        return rows

    # ---- the source interface (train / heldout / question) ----------------------------------------
    @property
    def num_train_rows(self) -> int:
        """``N``: training rows per epoch."""
        return len(self._train)

    def row_of(self, index: int) -> int:
        """Row number (in the training split) of prompt index ``index >= 0``: ``perm_{index // N}[index % N]``."""
        n = len(self._train)
        epoch, pos = divmod(index, n)
        if self._epoch is None or self._epoch[0] != epoch:  # only the current epoch's permutation is kept
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return int(self._train[self._epoch[1][pos]])

    def train(self, index: int) -> dict:
        """Entry of prompt index ``index``."""
        return self._entry(self._data[self.row_of(index)])

    def heldout(self) -> list[dict]:
        """The held-out entries, in row order."""
        return [self._entry(self._eval_data[int(i)]) for i in self._heldout]

    def question(self, entry: dict) -> str:
        return entry["question"]

    def messages(self, entry: dict) -> Messages:
        """Chat messages of an entry: the string prompt (with suffix) as one user message after the system
        prompt, or the row's chat messages (the system prompt prepended if they have none)."""
        return self._messages(entry[self.config.columns.prompt])

    def _messages(self, prompt: Any) -> Messages:
        system = [{"role": "system", "content": self._system}] if self._system else []
        if isinstance(prompt, str):
            return system + [{"role": "user", "content": prompt + (f" {self._suffix}" if self._suffix else "")}]
        msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]
        return msgs if any(m["role"] == "system" for m in msgs) else system + msgs

    def _entry(self, row: dict) -> dict:
        prompt = row[self.config.columns.prompt]
        users = [m["content"] for m in prompt if m["role"] == "user"] if not isinstance(prompt, str) else [prompt]
        entry = dict(row, question=users[-1] if users else "")
        if self.config.columns.answer is not None:
            entry["answer"] = row[self.config.columns.answer]
        return entry
