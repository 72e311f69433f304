"""Where a policy's initial weights come from: a local Hugging Face folder, or a Hub id ``org/name``.

A Hub id is resolved once, on the driver, by ``huggingface_hub.snapshot_download`` into the HF cache
(``HF_HOME`` / ``HF_HUB_CACHE``), and pinned to the commit it resolved to. The rollout and learner configs
then carry the local folder plus ``model_id`` and ``model_revision`` (that commit): a service on another
node whose filesystem lacks the folder fetches exactly that commit into its own HF cache
(:func:`localize`), so every service starts from the same bytes. Offline mode is the user's choice:
``HF_HUB_OFFLINE=1`` is respected (the cache must then hold the model) and never forced here.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""``org/name`` as the Hub spells repository ids (one slash, no leading dot or dash)."""
COMMIT = re.compile(r"^[0-9a-f]{40}$")
"""A full git commit hash, the form a resolved ``model_revision`` takes."""
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a policy needs from a model repository: config, weights (safetensors only), tokenizer, chat template."""
CONFIG_FILES = [p for p in MODEL_FILES if p != "*.safetensors"]
"""What a rollout that takes its weights from the weight path needs (``rollout.engine.load_format: dummy``)."""


class ModelSourceError(ValueError):
    """A model that cannot be had; the message names it and says what to do, in one line."""


def is_hub_id(model: str) -> bool:
    """True when ``model`` names a Hub repository (``org/name``) rather than an existing local path."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def resolve(model_id: str, revision: str | None = None, weights: bool = True) -> tuple[str, str]:
    """Download (or find in the HF cache) the policy files of ``model_id`` at ``revision``.

    Args:
        model_id: a Hub id, ``org/name``.
        revision: a branch, tag or commit; ``None`` is the repository's default branch.
        weights: ``False``: config and tokenizer only (``CONFIG_FILES``), no safetensors.

    Returns:
        ``(folder, commit)``: the snapshot folder in the HF cache and the commit hash it holds.

    Raises:
        ModelSourceError: the id does not exist (or is private without a token), the repository is gated
            and no token with access is set, the revision does not exist, or there is no network (or
            ``HF_HUB_OFFLINE`` is set) and the HF cache holds no copy — each naming the model and the fix.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f"{model_id}@{revision}" if revision else model_id
    cached = _cached_commit(model_id, revision, weights)
    if cached is not None:  # a commit is immutable: its snapshot, once cached, needs no Hub call
        return cached, revision  # type: ignore[return-value]
    try:
        folder = snapshot_download(model_id, revision=revision, allow_patterns=MODEL_FILES if weights else CONFIG_FILES)
    except GatedRepoError:
        raise ModelSourceError(
            f"model {at!r} is gated: accept its licence on https://huggingface.co/{model_id} and set HF_TOKEN "
            "(or run `hf auth login`) with an account that has access") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {at!r} was not found on the Hugging Face Hub: check the id (org/name), or set HF_TOKEN if "
            "it is private; a local folder must exist and hold config.json") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {model_id!r} has no revision {revision!r} (branch, tag or commit)") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        raise ModelSourceError(
            f"model {at!r} is not in the HF cache ({_cache_dir()}) and {why}: download it once where the "
            f"Hub is reachable (`hf download {model_id}`) into that cache, or give a local folder") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(f"model {at!r} could not be downloaded: {str(exc).splitlines()[0][:300]}") from None
    if weights and not any(Path(folder).glob("*.safetensors")):
        raise ModelSourceError(f"model {at!r} has no *.safetensors weights (gyre loads safetensors only)")
    return folder, Path(folder).name


def _cached_commit(model_id: str, revision: str | None, weights: bool = True) -> str | None:
    """The HF-cache snapshot folder of ``model_id`` at ``revision`` when ``revision`` is a commit hash whose
    ``config.json`` (and, with ``weights``, safetensors) are cached (``huggingface_hub.try_to_load_from_cache``);
    else ``None``."""
    from huggingface_hub import try_to_load_from_cache

    if revision is None or not COMMIT.fullmatch(revision):
        return None
    config = try_to_load_from_cache(model_id, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return str(folder) if not weights or any(folder.glob("*.safetensors")) else None


def localize(model: str, model_id: str | None, revision: str | None, weights: bool = True) -> str:
    """The local folder of a policy on this node: ``model`` if it is a folder here, else ``model_id`` at
    ``revision`` fetched into this node's HF cache (:func:`resolve`; without ``weights``, config and tokenizer
    only). With no ``model_id``, ``model`` as is.

    Raises:
        ModelSourceError: as :func:`resolve`.
    """
    if model_id is None or (Path(model) / "config.json").is_file():
        return model
    return resolve(model_id, revision, weights)[0]


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


DRY_RUN = "gyre_dry_run"
"""Validation-context key (``Model.model_validate(data, context={DRY_RUN: True})``): leave Hub ids unresolved
and skip the local-folder checks (``gyre run --dry-run`` downloads nothing)."""


def resolving_models(info) -> bool:
    """False inside a dry-run validation (``info``: pydantic's ``ValidationInfo``), where ids stay ids."""
    return not (info.context or {}).get(DRY_RUN, False)


def localize_model_data(data, info):
    """``mode="before"`` validator body shared by the engine configs: replace ``data["model"]`` with this
    node's folder of ``model_id`` at ``model_revision`` (:func:`localize`) when the given folder is not here;
    without the weights when ``data["load_format"]`` is ``dummy`` (a rollout that takes them from the weight path).

    Raises:
        ValueError: as :func:`resolve` (``ModelSourceError`` is a ``ValueError``, so pydantic reports it under
            the config's key).
    """
    if not isinstance(data, dict) or not resolving_models(info) or not isinstance(data.get("model"), str):
        return data
    weights = data.get("load_format", "auto") != "dummy"
    return {**data, "model": localize(data["model"], data.get("model_id"), data.get("model_revision"), weights)}
