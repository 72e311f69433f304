"""A recipe file's paths before validation: the model (a local folder or a Hub id, resolved to its cache
folder and commit), and relative local paths (reward function files, ``ray.runtime_env``) made absolute; and
``RecipeError``, what a bad recipe raises."""

from __future__ import annotations

from pathlib import Path

from gyre.utils.model_source import ModelSourceError, is_hub_id, resolve


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file, the key and what was expected."""


def resolve_model(data: dict, path: Path, dry_run: bool) -> None:
    """``data["model"]`` → an absolute local folder; a Hub id → its HF-cache folder, with ``model_id`` and the
    commit in ``model_revision`` (a dry run keeps the id)."""
    model = data.get("model")
    if not isinstance(model, str):
        return
    if is_hub_id(model):
        if dry_run:
            return
        try:
            folder, commit = resolve(model, data.get("model_revision"))
        except ModelSourceError as exc:
            raise RecipeError(f"recipe {path}: {exc}") from None
        data.update(model=folder, model_id=model, model_revision=commit)
        return
    data["model"] = str(Path(model).expanduser().resolve())
    if not dry_run and not (Path(data["model"]) / "config.json").is_file():
        raise RecipeError(f"recipe {path}: model: folder {data['model']} does not exist or has no config.json; "
                          "expected a local HF folder or a Hub id org/name (`make model` prepares "
                          "SmolLM2-135M-Instruct in .cache/models/)")


def resolve_local_paths(data: dict, base: Path) -> None:
    """Make relative local paths absolute against ``base`` (the CWD, as the model path and dataset paths): reward functions
    given as ``file.py:fn`` (``task.reward``, ``task.rewards``, and those of ``task.mixture``) and local
    ``ray.runtime_env`` ``working_dir`` / ``py_modules`` entries (not URIs)."""
    from gyre.utils.callable_spec import resolve_file_spec

    task = data.get("task") if isinstance(data.get("task"), dict) else {}
    mixture = task.get("mixture") if isinstance(task.get("mixture"), dict) else {}
    holders = [task, *(c for c in mixture.values() if isinstance(c, dict))]
    for holder in holders:
        rewards = holder.get("rewards") if isinstance(holder.get("rewards"), list) else []
        for reward in [holder.get("reward"), *rewards]:
            if isinstance(reward, dict) and isinstance(reward.get("function"), str):
                reward["function"] = resolve_file_spec(reward["function"], base)
            if isinstance(reward, dict) and isinstance(reward.get("model"), str) and (base / reward["model"]).is_dir():
                reward["model"] = str((base / reward["model"]).resolve())  # a folder; a Hub id stays as it is
    env = data.get("ray", {}).get("runtime_env") if isinstance(data.get("ray"), dict) else None
    if not isinstance(env, dict):
        return
    local = lambda p: str((base / Path(p).expanduser()).resolve()) if isinstance(p, str) and "://" not in p \
        and not Path(p).expanduser().is_absolute() else p  # noqa: E731
    if "working_dir" in env:
        env["working_dir"] = local(env["working_dir"])
    if isinstance(env.get("py_modules"), list):
        env["py_modules"] = [local(p) for p in env["py_modules"]]
