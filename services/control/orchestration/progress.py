"""The console progress line of a run (rich): step, reward, tokens/s, staleness, newest evaluation, ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    """Context manager; ``update(row)`` advances to the row's step and shows its key metrics."""

    def __init__(self, console: Console, total_steps: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False)
        self._info, self._eval = "waiting for the first batch…", ""
        self._task = self._progress.add_task("train", total=total_steps, info=self._info)

    def __enter__(self) -> "RunProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def show_eval(self, text: str) -> None:
        """Append the newest evaluation's summary (``services.control.orchestration.evaluation.eval_line``) to the line from now on."""
        self._eval = f" | {text}"
        self._progress.update(self._task, info=self._info + self._eval)

    def update(self, row: dict) -> None:
        """Advance to ``row["step"]`` and show its reward, throughput, staleness and IS ratio (and the newest
        evaluation's summary, once there is one)."""
        self._info = (f"reward {row.get('reward_mean', float('nan')):.3f} | "
                f"learn {row.get('tokens_per_s', 0):.0f} tok/s | gen {row.get('rollout_tokens_per_s', 0):.0f} tok/s | "
                f"staleness {row.get('staleness_mean', 0):.2f} (max {row.get('staleness_max', 0):.0f}) | "
                f"IS max {row.get('is_ratio_max', float('nan')):.2f}")
        self._progress.update(self._task, completed=row["step"], info=self._info + self._eval)
