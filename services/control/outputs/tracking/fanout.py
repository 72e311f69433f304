"""The fan-out over the enabled trackers: one call reaches each; a tracker that raises (at start or at any
later call) is reported once, as a structlog warning ``tracker_failed`` naming it and the error, and is then
left out while the run goes on.

``open_trackers`` starts the recipe's trackers for a run directory and keeps each backend's run id in
``{run}/tracking.json``, so that ``gyre run --resume`` continues the same W&B / MLflow / trackio run (a run
directory moved aside by ``--resume none`` takes the file with it: the next start opens new runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import structlog

from gyre.services.control.outputs.tracking.base import (
    TrackerContext, Tracker, completion_table, flatten, metric_values,
)
from gyre.services.control.outputs.tracking.config import TrackingConfig

log = structlog.get_logger("tracking")

STATE_FILE = "tracking.json"
"""``{run}/tracking.json``: ``{backend name: its run id}`` of the trackers started in this run directory."""


def _backends() -> dict[str, Callable[[Any, TrackerContext], Tracker]]:
    """Backend name → constructor ``(its config section, context)``. Each backend imports its library only
    when constructed."""
    from gyre.services.control.outputs.tracking.mlflow_tracker import MlflowTracker
    from gyre.services.control.outputs.tracking.tensorboard_tracker import TensorBoardTracker
    from gyre.services.control.outputs.tracking.trackio_tracker import TrackioTracker
    from gyre.services.control.outputs.tracking.wandb_tracker import WandbTracker

    return {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
            "trackio": TrackioTracker}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


class Trackers:
    """Fan-out over started trackers (``open_trackers``); every method returns normally whatever the trackers
    do. ``failed`` maps a tracker turned off to the error that turned it off."""

    def __init__(self, trackers: list[Tracker], completions_per_eval: int = 8,
                 failed: dict[str, str] | None = None) -> None:
        self.active = list(trackers)
        self.completions_per_eval = completions_per_eval
        self.failed: dict[str, str] = dict(failed or {})
        self.closed = False

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.active):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker must never stop the run: report once, turn it off
                self._turn_off(tracker, method, exc)

    def _turn_off(self, tracker: Tracker, during: str, exc: Exception) -> None:
        self.active.remove(tracker)
        self.failed[tracker.name] = _error(exc)
        log.warning("tracker_failed", tracker=tracker.name, during=during, error=_error(exc),
                    consequence="this tracker is off for the rest of the run; the run goes on")
        try:
            tracker.close(failed=True)
        except Exception as close_exc:  # already broken: nothing more to report than the first error
            log.debug("tracker_close_failed", tracker=tracker.name, error=_error(close_exc))

    def log_config(self, params: dict[str, Any]) -> None:
        """The resolved recipe (flattened dotted keys) to every tracker."""
        self._each("log_config", params)

    def log_row(self, row: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row: its ``metric_values`` at ``row["step"]`` and wall time ``row["time"]``.
        A row without a step or without metrics is skipped."""
        values = metric_values(row)
        if values and isinstance(row.get("step"), int):
            self._each("log_metrics", values, row["step"], row.get("time"))

    def log_completions(self, completions: list[dict[str, Any]], step: int) -> None:
        """The first ``completions_per_eval`` completions of an evaluation (greedy first) as the table
        ``eval/completions`` at ``step``."""
        if self.completions_per_eval and completions:
            columns, rows = completion_table(completions, self.completions_per_eval)
            self._each("log_table", "eval/completions", columns, rows, step)

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        """The run's ``summary.json``: its scalar (number, bool, string) values, nested ones dotted."""
        scalars = {k: v for k, v in flatten(summary).items() if isinstance(v, (int, float, str, bool))}
        self._each("log_summary", scalars, step)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker still on (``failed``: the run raised); a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self._each("close", failed)
        self.active = []

    def describe(self) -> str:
        """One line for the console: where each tracker writes, and which ones are off and why."""
        parts = [f"{t.name} → {t.where}" for t in self.active]
        parts += [f"{name} OFF ({error})" for name, error in self.failed.items()]
        return "tracking: " + ("; ".join(parts) if parts else "none")


def read_state(out_dir: Path) -> dict[str, str]:
    """``{backend: run id}`` from ``{out_dir}/tracking.json`` (``{}`` when absent or unreadable)."""
    try:
        state = json.loads((Path(out_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in state.items() if isinstance(v, str)} if isinstance(state, dict) else {}


def _write_state(out_dir: Path, state: dict[str, str]) -> None:
    path = Path(out_dir) / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(tmp, path)


def open_trackers(config: TrackingConfig, out_dir: Path, run_name: str, recipe: dict[str, Any],
                  backends: dict[str, Callable[[Any, TrackerContext], Tracker]] | None = None) -> Trackers:
    """Start the enabled trackers of ``config`` for the run directory ``out_dir`` and give each the resolved
    ``recipe`` (``Recipe.model_dump(mode="json")``, flattened) as its config. A tracker whose start raises
    is reported (``tracker_failed``, ``during="start"``) and left out. ``backends`` replaces the constructors
    (tests). Never raises for a tracker's failure."""
    backends = backends or _backends()
    params = flatten(recipe)
    state = read_state(out_dir)
    started, failed = [], {}
    for name in config.enabled():
        ctx = TrackerContext(out_dir=Path(out_dir), run_name=run_name, params=params, resume_id=state.get(name))
        try:
            started.append(backends[name](getattr(config, name), ctx))
        except Exception as exc:  # no library, bad URI or credentials, no network: the run goes on without it
            failed[name] = _error(exc)
            log.warning("tracker_failed", tracker=name, during="start", error=_error(exc),
                        consequence="this tracker is off for the rest of the run; the run goes on")
    trackers = Trackers(started, config.completions_per_eval, failed)
    trackers.log_config(params)
    ids = {t.name: t.resume_id for t in trackers.active if t.resume_id}
    if ids and ids != {k: state.get(k) for k in ids}:
        _write_state(out_dir, {**state, **ids})
    return trackers
