"""Run outputs: ``metrics.jsonl`` (one JSON object per line) and a PNG plot of reward and accuracy."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per line to ``path``, flushed per row so a crash keeps what was written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict]:
    """Rows of a ``metrics.jsonl``. Raises ``ValueError`` naming the line that is not JSON."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i} is not JSON: {exc}") from exc
    return rows


def plot_run(metrics_path: Path, out_png: Path) -> Path:
    """Reward mean per step and held-out accuracy (before/after) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if "reward_mean" in r and "heldout_accuracy" not in r]
    evals = [r for r in rows if "heldout_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, rewards = [r["step"] for r in train], [r["reward_mean"] for r in train]
    ax.plot(steps, rewards, alpha=0.35, label="train reward (batch mean)")
    window = 10
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window:i]) / window for i in range(window, len(rewards) + 1)]
        ax.plot(steps[window - 1:], smooth, label=f"train reward ({window}-step mean)")
    ax.plot([r["step"] for r in evals], [r["heldout_accuracy"] for r in evals], "o--", label="held-out accuracy")
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(Path(metrics_path).parent.name)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
