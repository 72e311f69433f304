"""The tracker ABC every backend implements, what a backend is started with, and the pure helpers that turn
``metrics.jsonl`` rows, evaluation completions and the recipe into what trackers take."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

TRACKING_EXTRA = "pip install 'gyre[tracking]'"
"""What to run when an enabled tracker's library is missing."""
NOT_METRICS = ("step", "time", "version")
"""Row keys that are the x-axis (learner step, wall time) or repeat it, not metrics."""
TABLE_COLUMNS = ("set", "index", "greedy", "prompt", "completion", "answer", "reward")
"""Columns of the completions table, from ``rollout.evaluation.EvalResult.completions`` records."""


class TrackerUnavailable(RuntimeError):
    """An enabled tracker's library is not installed; the message names the package and ``TRACKING_EXTRA``."""


@dataclass(frozen=True)
class TrackerContext:
    """What a backend is started with."""

    out_dir: Path
    """The run directory ``{run_dir}/{name}``; relative paths of a backend's config are taken from it."""
    run_name: str
    """The recipe's ``name``: the default run name of every backend."""
    params: dict[str, Any]
    """The resolved recipe, flattened to dotted keys (``flatten``): the run's config / params."""
    resume_id: str | None = None
    """The backend's run id from an earlier start of this run directory (``tracking.json``), to continue the
    same tracker run after ``gyre run --resume``; ``None`` on a fresh run."""


class Tracker(abc.ABC):
    """One experiment tracker (a backend). Built by its constructor, which raises when the backend cannot start
    (library missing, bad URI, no credentials); the fan-out (``services.control.outputs.tracking.fanout.Trackers``) then
    warns once and leaves it out, and does the same when any method below raises later. Methods are called
    from the driver's one thread, in step order for training rows (an evaluation row may come later than the
    training rows after its step). No method may block for long: they run inside the supervision loop."""

    name: ClassVar[str]
    """Backend name, as in the recipe's ``tracking`` section."""
    resume_id: str | None = None
    """This backend's run id to keep in ``tracking.json`` (``None``: nothing to continue)."""
    where: str = ""
    """Where it writes (a folder, a URI, a project), for the line ``gyre run`` prints."""

    @abc.abstractmethod
    def log_config(self, params: dict[str, Any]) -> None:
        """Record the resolved recipe (``flatten``ed dotted keys → str / int / float / bool / None / list)."""

    @abc.abstractmethod
    def log_metrics(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        """Record scalar ``values`` (finite floats) at learner ``step`` (the policy version; an evaluation's: the
        version evaluated) and ``wall_time`` (Unix seconds, ``None``: now) where the library takes one."""

    @abc.abstractmethod
    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Record a table (``rows[i][j]`` under ``columns[j]``) at ``step`` under ``key``."""

    @abc.abstractmethod
    def log_summary(self, values: dict[str, Any], step: int) -> None:
        """Record the run's summary (``summary.json``'s scalar values) once, at the end, ``step`` = final version."""

    @abc.abstractmethod
    def close(self, failed: bool) -> None:
        """Flush and finish the run (``failed``: the run raised, or this tracker failed); called once."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings → one level of dotted keys: ``{"learner": {"engine": {"lr": 1e-3}}}`` →
    ``{"learner.engine.lr": 1e-3}``. Lists and scalars are leaves; an empty mapping is a leaf ``{}``."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value} if prefix else {}


def metric_values(row: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics of one ``metrics.jsonl`` row: finite numbers and bools (as 0/1), nested mappings
    flattened with ``/`` (``rollout_reward_means/char_fraction``); the x-axis keys (``NOT_METRICS``), strings,
    lists, ``None`` and non-finite numbers are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_METRICS:
            continue
        if isinstance(value, dict):
            for sub, inner in metric_values(value).items():
                out[f"{key}/{sub}"] = inner
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def completion_table(completions: list[dict[str, Any]], limit: int) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of at most ``limit`` evaluation completions (``EvalResult.completions`` records),
    greedy ones first, then in their order; columns ``TABLE_COLUMNS``, a missing field is ``None``."""
    chosen = sorted(completions, key=lambda c: not c.get("greedy", False))[:limit]
    return list(TABLE_COLUMNS), [[c.get(col) for col in TABLE_COLUMNS] for c in chosen]


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it); ``|`` and newlines inside cells escaped."""
    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def resolve_under(out_dir: Path, path: str | None, default: str) -> Path:
    """``path`` (``None``: ``default``) made absolute against the run directory ``out_dir``."""
    return (Path(out_dir) / Path(path if path is not None else default).expanduser()).resolve()
