"""MLflow backend (``mlflow-skinny``'s ``MlflowClient``; any tracking URI, by default a local file store in the
run directory). Metrics keyed by learner step with the row's wall time (ms); the recipe as params (and the
artifact ``recipe.json``); each completions table as a table artifact (``log_table``: the MLflow UI shows it
in the run's Evaluation/Artifacts view); the summary as ``summary/...`` metrics and ``summary.json``."""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gyre.services.control.outputs.tracking.base import TRACKING_EXTRA, Tracker, TrackerContext, TrackerUnavailable
from gyre.services.control.outputs.tracking.config import MlflowConfig

MAX_PARAM_CHARS = 6000
"""MLflow's longest param value; a longer one (a long list in the recipe) is cut, ending in ``…``."""
PARAMS_PER_BATCH = 100
"""MLflow's most params in one ``log_batch``."""
_BAD_NAME = re.compile(r"[^\w./\- :]")


def metric_name(key: str) -> str:
    """An MLflow-valid name for a gyre key: ``@`` → ``_at_`` (``heldout_pass@4`` → ``heldout_pass_at_4``), any
    other character MLflow refuses (it takes alphanumerics, ``_ - . / : `` and space) → ``_``."""
    return _BAD_NAME.sub("_", key.replace("@", "_at_"))


def tracking_uri(configured: str | None, out_dir: Path) -> str:
    """The URI to use: ``configured`` as given when it has a scheme (``http://``, ``sqlite:///``, ``file:``) or
    is ``databricks``; a plain path made absolute against the run directory, as ``file:``; ``None``: the file
    store ``{out_dir}/mlruns``."""
    if configured is not None and (urlparse(configured).scheme or configured.startswith("databricks")):
        return configured
    return (Path(out_dir) / Path(configured or "mlruns").expanduser()).resolve().as_uri()


class MlflowTracker(Tracker):
    """One MLflow run per run directory (its id is kept in ``tracking.json``; a resumed gyre run sets it
    ``RUNNING`` again and continues it). MLflow params cannot change: on resume only keys not yet logged are
    added; ``recipe.json`` (an artifact) is rewritten with the resumed run's recipe."""

    name = "mlflow"

    def __init__(self, config: MlflowConfig, ctx: TrackerContext) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackerUnavailable(f"MLflow tracking needs mlflow-skinny ({exc}): {TRACKING_EXTRA}") from exc
        self._Metric, self._Param = Metric, Param
        uri = tracking_uri(config.tracking_uri, ctx.out_dir)
        if uri.startswith("file:"):  # MLflow 3 refuses its (legacy) file store unless this is set
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._existing_run(ctx.resume_id)
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(config.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(config.experiment))
            run = self.client.create_run(experiment_id, run_name=config.run_name or ctx.run_name,
                                         tags={"gyre.run_dir": str(ctx.out_dir)})
            self.run_id = run.info.run_id
        self.resume_id = self.run_id
        self.where = f"{uri} (run {self.run_id})"

    def _existing_run(self, run_id: str | None) -> str | None:
        """``run_id`` set running again if the store still has it, else ``None`` (a new run is created)."""
        if run_id is None:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # deleted, or another store: start a new run
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_config(self, params: dict[str, Any]) -> None:
        have = self.client.get_run(self.run_id).data.params
        new = []
        for key, value in sorted(params.items()):
            name, text = metric_name(key)[:250], json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            if name not in have:
                new.append(self._Param(name, text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 1] + "…"))
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + PARAMS_PER_BATCH])
        self.client.log_dict(self.run_id, params, "recipe.json")

    def log_metrics(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        ms = int((wall_time if wall_time is not None else time.time()) * 1000)
        self.client.log_batch(self.run_id, metrics=[self._Metric(metric_name(k), v, ms, step) for k, v in values.items()])

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        data = {column: [row[j] for row in rows] for j, column in enumerate(columns)}
        with warnings.catch_warnings():  # pandas' deprecation notes from inside MLflow's DataFrame handling
            warnings.simplefilter("ignore")
            self.client.log_table(self.run_id, data=data, artifact_file=f"{key}_step_{step}.json")

    def log_summary(self, values: dict[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if numbers:
            self.log_metrics({f"summary/{k}": v for k, v in numbers.items()}, step, None)
        self.client.log_dict(self.run_id, values, "summary.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
