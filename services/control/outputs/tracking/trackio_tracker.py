"""trackio backend (``trackio``): a local SQLite store, ``{TRACKIO_DIR}/{project}.db`` (``TRACKIO_DIR`` defaults
to ``$HF_HOME/trackio``; ``trackio show --project P`` serves the dashboard), optionally synced to a Hugging
Face Space. Metrics keyed by learner step (trackio stamps its own wall time); tables are ``trackio.Table``."""

from __future__ import annotations

from typing import Any

from gyre.services.control.outputs.tracking.base import TRACKING_EXTRA, Tracker, TrackerContext, TrackerUnavailable
from gyre.services.control.outputs.tracking.config import TrackioConfig


class TrackioTracker(Tracker):
    """One trackio run per run directory (its name is kept in ``tracking.json``; a resumed gyre run continues it
    with ``resume="allow"``). trackio keeps one current run per process. The recipe is the run's config (sent
    with the first logged row); the summary is logged as ``summary/...`` at the final step."""

    name = "trackio"

    def __init__(self, config: TrackioConfig, ctx: TrackerContext) -> None:
        try:
            import trackio
        except ImportError as exc:
            raise TrackerUnavailable(f"trackio tracking needs the trackio package ({exc}): {TRACKING_EXTRA}") from exc
        self._trackio = trackio
        self.run = trackio.init(project=config.project, name=ctx.resume_id or config.name or ctx.run_name,
                                group=config.group, space_id=config.space_id, config=dict(ctx.params),
                                resume="allow" if ctx.resume_id else "never", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)
        self.resume_id = self.run.name
        self.where = f"project {config.project}" + (f" (Space {config.space_id})" if config.space_id else " (local)")

    def log_config(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def log_metrics(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        self.run.log(dict(values), step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self.run.log({key: self._trackio.Table(columns=columns, data=rows, allow_mixed_types=True)}, step=step)

    def log_summary(self, values: dict[str, Any], step: int) -> None:
        numbers = {f"summary/{k}": float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if numbers:
            self.run.log(numbers, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish()
