"""Weights & Biases backend (``wandb``). Every metric is plotted against ``learner_step`` (``define_metric``),
not W&B's own ``_step`` counter: an evaluation's row arrives after the training rows past its step, which W&B
would drop as a step going backwards. W&B records each row's wall time itself (``_timestamp``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.services.control.outputs.tracking.base import TRACKING_EXTRA, Tracker, TrackerContext, TrackerUnavailable, resolve_under
from gyre.services.control.outputs.tracking.config import WandbConfig

STEP_KEY = "learner_step"
"""The x-axis every gyre metric is defined against in W&B."""


class WandbTracker(Tracker):
    """One W&B run per run directory (its id is kept in ``tracking.json``; a resumed gyre run continues it with
    ``resume="allow"``). The recipe is the run's config; tables are ``wandb.Table``; the summary goes to
    ``run.summary``. Console capture is off (gyre's logs are in ``{run}/logs``)."""

    name = "wandb"

    def __init__(self, config: WandbConfig, ctx: TrackerContext) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise TrackerUnavailable(f"W&B tracking needs the wandb package ({exc}): {TRACKING_EXTRA}") from exc
        self._wandb = wandb
        root = resolve_under(ctx.out_dir, config.dir, ".")
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=config.project, entity=config.entity, group=config.group,
                              tags=list(config.tags) or None, name=config.name or ctx.run_name, mode=config.mode,
                              dir=str(root), id=ctx.resume_id, resume="allow" if ctx.resume_id else None,
                              settings=wandb.Settings(console="off"))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.resume_id = self.run.id
        self.where = f"offline {Path(self.run.dir).parent}" if config.mode == "offline" else str(self.run.url)

    def log_config(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        self.run.log({**values, STEP_KEY: step})

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        table = self._wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        self.run.log({key: table, STEP_KEY: step})

    def log_summary(self, values: dict[str, Any], step: int) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
