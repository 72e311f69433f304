"""The controller's held-out evaluations (``eval:`` in a recipe): before training, every ``eval.every_steps``
learner versions during it, and after it, each on one rollout service (``RolloutActor.evaluate``).

Each evaluation becomes one ``metrics.jsonl`` row (``step`` = the policy version evaluated, the
``rollout.evaluation.EvalResult.metrics`` keys, ``eval`` = ``before`` / ``periodic`` / ``after`` /
``standalone``) and one file ``{run}/eval/step_{version}.jsonl`` holding its completions, one JSON object per
line (``EvalResult.completions``). A periodic evaluation runs on the first running rollout while generation
and training go on; it never stops the run: while the rollout restarts it is skipped, and a failed one is
logged and dropped (``PeriodicEval``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import structlog
from rich.table import Table

from gyre.rollout.evaluation import EvalConfig, EvalResult

log = structlog.get_logger("evaluation")

EVAL_DIR = "eval"
"""Sub-directory of the run directory holding ``step_{version}.jsonl``."""
VERSION_WAIT_S = 120.0
"""Seconds a periodic evaluation waits for its rollout to hold the version that triggered it."""


def write_completions(out_dir: Path, version: int, completions: list[dict]) -> Path:
    """Write ``{out_dir}/eval/step_{version}.jsonl`` (one JSON object per completion, sorted keys) atomically
    (temp file, fsync, rename); an evaluation of the same version again replaces it. Returns the path."""
    path = Path(out_dir) / EVAL_DIR / f"step_{version}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in completions:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def record_eval(result: EvalResult, out_dir: Path, metrics, label: str, **extra) -> dict:
    """Write one evaluation's ``metrics.jsonl`` row (via ``metrics.write``, with its completions for the
    experiment trackers' table; ``extra`` keys join the row) and its completions file; returns the row
    (``step`` = ``result.metrics["version"]``)."""
    row = {"step": result.metrics["version"], "time": time.time(), "eval": label, **extra, **result.metrics}
    metrics.write(row, completions=result.completions)
    write_completions(out_dir, row["step"], result.completions)
    return row


def k_of(metrics: dict) -> int | None:
    """The ``k`` of an evaluation's ``heldout_pass@k`` key (None without sampled responses)."""
    keys = [key for key in metrics if key.startswith("heldout_pass@")]
    return int(keys[0].rpartition("@")[2]) if keys else None


def eval_line(metrics: dict) -> str:
    """One line: ``eval@V greedy 0.250 mean@4 0.310 pass@4 0.500`` (the all-sets numbers)."""
    k = k_of(metrics)
    line = f"eval@{metrics['version']} greedy {metrics['heldout_accuracy']:.3f}"
    if k is not None:
        line += f" mean@{k} {metrics[f'heldout_mean@{k}']:.3f} pass@{k} {metrics[f'heldout_pass@{k}']:.3f}"
    return line


def eval_table(metrics: dict, title: str) -> Table:
    """A rich table: one row per eval set (problems, greedy accuracy, mean@k, pass@k, failed scores) and one
    for all sets together."""
    k = k_of(metrics)
    table = Table(title=title)
    for col in ["set", "problems", "greedy accuracy", *([f"mean@{k}", f"pass@{k}"] if k else []), "reward errors"]:
        table.add_column(col, justify="left" if col == "set" else "right")
    sets = [key.split("/")[1] for key in metrics if key.startswith("eval/") and key.endswith("/greedy_accuracy")]
    for name in sets:
        m = {key.rpartition("/")[2]: v for key, v in metrics.items() if key.startswith(f"eval/{name}/")}
        table.add_row(name, str(m["size"]), f"{m['greedy_accuracy']:.3f}",
                      *([f"{m[f'mean@{k}']:.3f}", f"{m[f'pass@{k}']:.3f}"] if k else []), str(m["reward_errors"]))
    errors = sum(v for key, v in metrics.items() if key.startswith("eval/") and key.endswith("/reward_errors"))
    table.add_row("all", str(metrics["heldout_size"]), f"{metrics['heldout_accuracy']:.3f}",
                  *([f"{metrics[f'heldout_mean@{k}']:.3f}", f"{metrics[f'heldout_pass@{k}']:.3f}"] if k else []),
                  str(errors), style="bold")
    return table


def first_due(every: int | None, version: int) -> int | None:
    """The first multiple of ``every`` above ``version`` (None when ``every`` is None or 0)."""
    return (version // every + 1) * every if every else None


class PeriodicEval:
    """Evaluations during training, one at a time, on the first running rollout.

    ``poll(sup, version)`` (each supervision round, ``version`` = the learner's newest) collects a finished
    evaluation (row + file + ``progress.show_eval``), and starts one when ``version`` reached the next multiple
    of ``every_steps`` below ``num_steps``; a multiple crossed while one is still running, or while no rollout
    runs, is skipped (logged). Errors of an evaluation (its rollout died or restarted, a refused prompt) are
    logged, never raised. ``wait`` / ``get`` are ``ray.wait`` / ``ray.get`` (replaced in unit tests).
    """

    def __init__(self, config: EvalConfig, num_steps: int, start_version: int, out_dir: Path, metrics,
                 progress=None, wait=None, get=None) -> None:
        import ray

        self.config, self.num_steps, self.out_dir, self.metrics = config, num_steps, Path(out_dir), metrics
        self.progress, self._wait, self._get = progress, wait or ray.wait, get or ray.get
        self.next_due = first_due(config.every_steps, start_version)
        self.inflight: tuple[object, int] | None = None
        self.rows: list[dict] = []
        """Rows of the evaluations written."""
        self.skipped: list[int] = []
        """Trigger versions skipped (busy, no rollout running, or failed)."""

    def poll(self, sup, version: int) -> None:
        """One round (see the class docstring); never raises for an evaluation's failure."""
        if self.inflight is not None and self._wait([self.inflight[0]], timeout=0)[0]:
            self._collect()
        due = self.next_due
        if due is None or due >= self.num_steps or version < due:
            return
        self.next_due = first_due(self.config.every_steps, version)
        running = sup.running_rollouts()
        if self.inflight is not None or not running:
            log.warning("periodic_eval_skipped", step=due, reason="busy" if running else "no rollout running")
            self.skipped.append(due)
            return
        ref = running[0].handle.evaluate.remote(self.config.model_dump(), due, VERSION_WAIT_S)
        self.inflight = (ref, due)
        log.info("periodic_eval_started", step=due, rollout=running[0].name)

    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait up to ``timeout_s`` for the evaluation in flight (if any) and collect it."""
        if self.inflight is not None:
            self._wait([self.inflight[0]], timeout=timeout_s)
            self._collect()

    def _collect(self) -> None:
        ref, due = self.inflight
        self.inflight = None
        try:
            result = self._get(ref, timeout=0)
        except Exception as exc:  # the rollout died or restarted, or refused: the run goes on without it
            log.warning("periodic_eval_failed", step=due, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self.skipped.append(due)
            return
        self.rows.append(record_eval(result, self.out_dir, self.metrics, "periodic"))
        if self.progress is not None:
            self.progress.show_eval(eval_line(result.metrics))
