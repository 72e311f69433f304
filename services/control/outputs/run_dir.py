"""One reader (and writer) of a run directory's resolved recipe: ``runs/<name>/recipe.json``.

``gyre run`` writes the recipe it resolved (``write_recipe``; every default filled in, ``--set`` applied) before any
service starts. Everything that later reads a run from its directory reads that file here: ``gyre check``
(``services/cli/run_records.py``), ``gyre compare`` (``services/cli/compare.py``), ``gyre reward swap``
(``services/cli/reward.py``) and a run that trains from a recording (``services/control/recipe/recorded.py``). The configs
it returns are the same pydantic models the services ran with, so a recipe that loaded then reads back the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

from gyre.replay.config import ReplayConfig

if TYPE_CHECKING:
    from gyre.rollout.tasks import TaskConfig

RECIPE_FILE = "recipe.json"
"""The resolved recipe's file name inside a run directory."""


class RunDirError(ValueError):
    """A run directory without a readable ``recipe.json``, or a section of it that does not load; names the path."""


def write_recipe(run_dir: Path, recipe_json: str) -> Path:
    """Write the resolved recipe (``Recipe.model_dump_json``) as ``run_dir/recipe.json``; returns its path."""
    path = Path(run_dir) / RECIPE_FILE
    path.write_text(recipe_json)
    return path


def read_recipe(run_dir: str | Path, kind: str = "run directory") -> dict:
    """The resolved recipe of ``run_dir`` as plain JSON values.

    Args:
        kind: what ``run_dir`` was expected to be, for the message (``"recorded run's directory"``).

    Raises:
        RunDirError: no ``recipe.json`` in ``run_dir``, or one that is not a JSON object (path and cause named).
    """
    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        raise RunDirError(f"{run_dir} is not a {kind}: no {RECIPE_FILE} (expected runs/<name>, the directory "
                          "`gyre run` writes)")
    try:
        recipe = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{path} does not read as JSON: {exc}") from None
    if not isinstance(recipe, dict):
        raise RunDirError(f"{path} holds a {type(recipe).__name__}; expected a JSON object (the resolved recipe)")
    return recipe


def read_recipe_if_any(run_dir: str | Path) -> dict | None:
    """``read_recipe``, or ``None`` when ``run_dir`` has no ``recipe.json``. Raises ``RunDirError`` on an unreadable
    one."""
    return read_recipe(run_dir) if (Path(run_dir) / RECIPE_FILE).is_file() else None


def replay_config(run_dir: str | Path, kind: str = "run directory") -> ReplayConfig:
    """The replay config the run ran with, ``dir`` set to its replay directory (``replay.dir``, else
    ``{run_dir}/replay``; whether it exists is the caller's question).

    Raises:
        RunDirError: ``read_recipe``'s, or a ``replay`` section that does not validate.
    """
    path = Path(run_dir) / RECIPE_FILE
    section = read_recipe(run_dir, kind).get("replay", {})
    try:
        cfg = ReplayConfig(**section)
    except (ValueError, TypeError) as exc:
        raise RunDirError(f"{path}: unreadable replay section: {exc}") from None
    return cfg.model_copy(update={"dir": str(Path(cfg.dir) if cfg.dir else Path(run_dir) / "replay")})


def replay_shard_dir(replay_dir: str | Path, shard: int, shards: int) -> str:
    """Directory of replay shard ``shard`` of ``shards``: ``replay_dir`` itself for an unsharded replay, else
    ``{replay_dir}/shard-{shard}`` (each shard's own WAL and snapshots)."""
    return str(replay_dir) if shards == 1 else str(Path(replay_dir) / f"shard-{shard}")


def replay_shard_configs(run_dir: str | Path, kind: str = "run directory") -> list[ReplayConfig]:
    """``replay_config`` once per replay shard, each with its ``shard`` and ``dir`` (one for an unsharded run).

    Raises:
        RunDirError: as ``replay_config``.
    """
    cfg = replay_config(run_dir, kind)
    return [cfg.model_copy(update={"shard": k, "dir": replay_shard_dir(cfg.dir, k, cfg.shards)})
            for k in range(cfg.shards)]


def task_config(run_dir: str | Path) -> "TaskConfig":
    """The run's ``task`` section (its reward functions and datasets).

    Raises:
        RunDirError: ``read_recipe``'s, or a missing or invalid ``task`` section.
    """
    from gyre.rollout.tasks import TaskConfig  # datasets and reasoning_gym: only for the commands that need them

    path = Path(run_dir) / RECIPE_FILE
    recipe = read_recipe(run_dir)
    if "task" not in recipe:
        raise RunDirError(f"{path} has no task section")
    try:
        return TaskConfig.model_validate(recipe["task"])
    except ValueError as exc:
        raise RunDirError(f"{path}: unreadable task section: {exc}") from None
