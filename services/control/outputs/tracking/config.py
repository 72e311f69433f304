"""The recipe's ``tracking:`` section: which experiment trackers the controller feeds, and where.

TensorBoard is on by default; Weights & Biases, MLflow and trackio are on when their section is written
(``tracking: {wandb: {mode: offline}}``) or ``enabled: true``. Paths left unset resolve under the run directory
(``{run_dir}/{name}/``) when the run starts (``services.control.outputs.tracking.fanout.open_trackers``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

OPTIONAL_BACKENDS = ("wandb", "mlflow", "trackio")
"""Sections that a recipe turns on by writing them (``enabled`` left out); TensorBoard is on unless disabled."""


class TensorBoardConfig(BaseModel):
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``; view with ``tensorboard --logdir``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    """Write TensorBoard event files (on by default; ``false`` turns them off)."""
    log_dir: str | None = None
    """Folder of the event files. ``None``: ``{run_dir}/{name}/tb``; a relative path is taken from the run
    directory."""


class WandbConfig(BaseModel):
    """Weights & Biases (``wandb``, from ``pip install 'gyre[tracking]'``). Online mode needs ``WANDB_API_KEY``
    (or ``wandb login``) on the driver's machine; offline mode writes a run folder to upload later with
    ``wandb sync``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Log to W&B. Writing a ``wandb:`` section turns it on unless it says ``enabled: false``."""
    mode: Literal["online", "offline"] = "online"
    """``online``: stream to the W&B server (``WANDB_BASE_URL``, default wandb.ai). ``offline``: write only the
    local run folder ``{dir}/wandb/offline-run-*`` (no network); ``wandb sync`` uploads it later."""
    project: str = "gyre"
    """W&B project the run goes to."""
    entity: str | None = None
    """W&B user or team owning the project. ``None``: the API key's default entity."""
    group: str | None = None
    """W&B run group (seeds of one configuration, the cells of a sweep). ``None``: no group."""
    tags: list[str] = []
    """W&B run tags."""
    name: str | None = None
    """W&B display name. ``None``: the recipe's ``name``."""
    dir: str | None = None
    """Folder W&B writes its ``wandb/`` folder into. ``None``: the run directory; a relative path is taken from
    the run directory."""


class MlflowConfig(BaseModel):
    """MLflow (``mlflow-skinny``, from ``pip install 'gyre[tracking]'``): metrics, params, artifacts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Log to MLflow. Writing an ``mlflow:`` section turns it on unless it says ``enabled: false``."""
    tracking_uri: str | None = None
    """Any MLflow tracking URI: ``http(s)://`` a tracking server, ``databricks``, ``sqlite:///path.db`` (needs
    the full ``mlflow`` package), ``file:///path`` or a plain path (a local file store). ``None``: the file
    store ``{run_dir}/{name}/mlruns``. A file store is MLflow's legacy backend: gyre sets
    ``MLFLOW_ALLOW_FILE_STORE=true`` for it (MLflow 3 refuses it otherwise), and so must ``mlflow ui`` on it."""
    experiment: str = "gyre"
    """MLflow experiment name (created if missing)."""
    run_name: str | None = None
    """MLflow run name. ``None``: the recipe's ``name``."""


class TrackioConfig(BaseModel):
    """trackio (``trackio``, from ``pip install 'gyre[tracking]'``): a local SQLite store in ``TRACKIO_DIR``
    (default ``$HF_HOME/trackio``), ``trackio show`` serves its dashboard; optionally synced to a Space."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Log to trackio. Writing a ``trackio:`` section turns it on unless it says ``enabled: false``."""
    project: str = "gyre"
    """trackio project."""
    name: str | None = None
    """trackio run name. ``None``: the recipe's ``name``."""
    group: str | None = None
    """trackio run group. ``None``: none."""
    space_id: str | None = None
    """A Hugging Face Space (``user/space``) to sync the project to (needs a Hub token). ``None``: local only."""


class TrackingConfig(BaseModel):
    """Experiment trackers fed by the controller: every ``metrics.jsonl`` row (keyed by learner step, with its
    wall time where the library takes one), each evaluation's completions as a table, the resolved recipe as
    the run's config, the run's summary at the end. A tracker that cannot start or write warns once and is
    turned off; the run goes on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard event files (on by default, ``{run_dir}/{name}/tb``)."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases (off unless written)."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow (off unless written)."""
    trackio: TrackioConfig = TrackioConfig()
    """trackio (off unless written)."""
    completions_per_eval: int = Field(8, ge=0)
    """Completions of each evaluation sent to the trackers as a table (greedy ones first, from
    ``eval/step_N.jsonl``); 0: no table."""

    @model_validator(mode="before")
    @classmethod
    def _written_sections_are_on(cls, data: Any) -> Any:
        """A written ``wandb`` / ``mlflow`` / ``trackio`` section is enabled unless it says otherwise; a section
        given as ``true`` / ``false`` stands for ``{enabled: true}`` / ``{enabled: false}``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in ("tensorboard", *OPTIONAL_BACKENDS):
            section = data.get(name)
            if isinstance(section, bool):
                data[name] = {"enabled": section}
            elif name in OPTIONAL_BACKENDS and isinstance(section, dict) and "enabled" not in section:
                data[name] = {**section, "enabled": True}
        return data

    def enabled(self) -> list[str]:
        """Names of the enabled trackers, in the order they are opened."""
        return [name for name in ("tensorboard", *OPTIONAL_BACKENDS) if getattr(self, name).enabled]
