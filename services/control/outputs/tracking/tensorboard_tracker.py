"""TensorBoard backend: event files written by ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
package, a base dependency). Scalars under their ``metrics.jsonl`` names, keyed by learner step with the row's
wall time; the recipe, each completions table and the summary as Markdown text (TensorBoard's Text tab)."""

from __future__ import annotations

from typing import Any

from gyre.services.control.outputs.tracking.base import Tracker, TrackerContext, TrackerUnavailable, markdown_table, resolve_under
from gyre.services.control.outputs.tracking.config import TensorBoardConfig


class TensorBoardTracker(Tracker):
    """Writes ``{log_dir}/events.out.tfevents.*`` (a resumed run adds a new event file to the same folder;
    TensorBoard reads them as one run). Flushes after every call, so a crash keeps what was logged."""

    name = "tensorboard"

    def __init__(self, config: TensorBoardConfig, ctx: TrackerContext) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackerUnavailable(f"TensorBoard needs the tensorboard package ({exc}): pip install tensorboard") from exc
        self.log_dir = resolve_under(ctx.out_dir, config.log_dir, "tb")
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.where = str(self.log_dir)

    def log_config(self, params: dict[str, Any]) -> None:
        rows = [[key, value] for key, value in sorted(params.items())]
        self.writer.add_text("recipe", markdown_table(["key", "value"], rows), global_step=0)
        self.writer.flush()

    def log_metrics(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self.writer.add_text(key, markdown_table(columns, rows), global_step=step)
        self.writer.flush()

    def log_summary(self, values: dict[str, Any], step: int) -> None:
        rows = [[key, value] for key, value in sorted(values.items())]
        self.writer.add_text("summary", markdown_table(["key", "value"], rows), global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()
