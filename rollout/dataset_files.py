"""A recipe's own dataset: its config, how it is loaded (Hugging Face ``datasets``) and its fingerprint.

``task.dataset.path`` is a local JSONL/JSON/Parquet/CSV file, a glob or folder of them, a ``save_to_disk``
folder, or a Hub id ``org/name`` (only when online or already in the local cache). Files are read with
``datasets.load_dataset`` (the ``json``/``parquet``/``csv`` builders with ``data_files``), folders written by
``save_to_disk`` with ``datasets.load_from_disk``; the resulting ``Dataset`` is Arrow-backed and memory-mapped.

``data_fingerprint`` is the data-consistency check of a resume: sha256 of every local data file, keyed by its
path relative to the dataset's root, plus a tree hash over them (``learner.checkpoint.store.fingerprint_diff`` names
the files added, removed and changed).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DatasetColumns", "DatasetConfig", "DatasetError", "DatasetEval", "data_fingerprint", "load_split",
           "local_files"]

EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension → ``datasets`` builder for ``format: auto``."""
DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""A folder holding one of these was written by ``save_to_disk``."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
Format = Literal["auto", "json", "parquet", "csv", "disk", "hub"]


class DatasetError(ValueError):
    """A dataset that cannot be used: missing file, unknown split or column, no rows; names the bad value."""


class DatasetColumns(BaseModel):
    """Which columns hold the prompt and the answer; every column is passed to the reward as well."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str = "prompt"
    """A string column (sent as one user message, after the optional system prompt) or a column of chat
    messages (``[{role, content}, ...]``, sent as they are)."""
    answer: str | None = None
    """Column copied into the reward's ``entry["answer"]`` (``None``: a column named ``answer``, if any, is
    already there)."""


class DatasetEval(BaseModel):
    """Evaluation data: a separate file/split (``path`` and/or ``split``) or a seeded held-out fraction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = None
    """Another file, glob, folder or Hub id (default: the training ``path``)."""
    format: Format = "auto"
    """How ``path`` is read (see ``task.dataset.format``)."""
    split: str | None = None
    """Split of the eval data; default ``"train"`` when ``path`` is set (a file's only split)."""
    heldout_fraction: float | None = Field(None, gt=0, lt=1)
    """Fraction of the training split's rows held out (seeded by ``seed``); those rows never train."""
    seed: int = 7
    """Seed of the held-out fraction's row choice."""

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetEval":
        separate = self.path is not None or self.split is not None
        if separate == (self.heldout_fraction is not None):
            raise ValueError("eval needs either path/split (separate data) or heldout_fraction, not "
                             f"{'both' if separate else 'neither'}")
        return self


class DatasetConfig(BaseModel):
    """A recipe's own prompts (``task.dataset``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    """A JSONL/JSON/Parquet/CSV file, a glob or folder of them, a ``save_to_disk`` folder, or a Hub id.
    A relative local path is made absolute (from the CWD) when the recipe loads."""
    format: Format = "auto"
    """``auto``: from the file extension (``.jsonl``/``.json`` → json, ``.parquet``, ``.csv``); a folder with
    ``dataset_info.json``/``state.json``/``dataset_dict.json`` → ``disk``; a path that does not exist and
    looks like ``org/name`` → ``hub``."""
    split: str = "train"
    """Split to train on (local files have only ``train``; a ``save_to_disk`` folder of one ``Dataset`` is used
    whole)."""
    columns: DatasetColumns = DatasetColumns()
    """Which columns hold the prompt and the answer; every other column reaches the reward."""
    eval: DatasetEval | None = None
    """Evaluation data; ``None``: ``task.heldout_size`` training rows (seeded by ``task.heldout_seed``) are held
    out."""
    name: str = Field("dataset", pattern=r"^[A-Za-z0-9._-]+$")
    """Task name of its trajectories (the ``task`` column and metrics)."""


def resolve_format(path: str, fmt: Format) -> str:
    """The concrete format (``json``/``parquet``/``csv``/``disk``/``hub``) of ``path``.

    Raises:
        DatasetError: a local path that does not exist (or a glob matching nothing), or whose format cannot be
            told from its extension.
    """
    if fmt == "hub":
        return fmt
    p = Path(path)
    if p.is_dir():
        if fmt != "auto":
            return fmt
        if any((p / m).is_file() for m in DISK_MARKERS):
            return "disk"
        kinds = {EXTENSIONS[f.suffix] for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS}
        if len(kinds) != 1:
            raise DatasetError(f"dataset folder {path} holds {sorted(kinds) or 'no'} data files; expected files of "
                               f"one kind ({', '.join(EXTENSIONS)}) or a save_to_disk folder")
        return kinds.pop()
    matches = glob.glob(path, recursive=True) if glob.has_magic(path) else ([path] if p.is_file() else [])
    if not matches:
        if fmt == "auto" and _HUB_ID.match(path) and Path(path).suffix not in EXTENSIONS:
            return "hub"
        raise DatasetError(f"dataset path {path} does not exist (expected a data file, glob, folder, or a Hub id "
                           "org/name)")
    if fmt != "auto":
        return fmt
    kinds = {EXTENSIONS.get(Path(m).suffix) for m in matches}
    if None in kinds or len(kinds) != 1:
        raise DatasetError(f"cannot tell the format of {path} from its extension; expected one of "
                           f"{', '.join(EXTENSIONS)} or format: json|parquet|csv|disk|hub")
    return kinds.pop()


def local_files(path: str, fmt: Format = "auto") -> tuple[Path | None, list[Path]]:
    """``(root, files)``: the data files of a local dataset (sorted) and the folder their names are relative
    to; ``(None, [])`` for a Hub id. Raises ``DatasetError`` like ``resolve_format``."""
    kind = resolve_format(path, fmt)
    if kind == "hub":
        return None, []
    p = Path(path)
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")
                 and (kind == "disk" or fmt != "auto" or f.suffix in EXTENSIONS)]
        return p, sorted(files)
    if glob.has_magic(path):
        root = Path(os.path.commonpath([os.path.dirname(m) or "." for m in glob.glob(path, recursive=True)]))
        return root, sorted(Path(m) for m in glob.glob(path, recursive=True) if Path(m).is_file())
    return p.parent, [p]


def load_split(path: str, fmt: Format, split: str):
    """The ``datasets.Dataset`` of one split (indices flattened).

    Raises:
        DatasetError: missing path, unknown split (naming the ones there are), a Hub id that is offline and not
            in the local cache, or a file ``datasets`` cannot parse.
    """
    import datasets

    kind = resolve_format(path, fmt)
    try:
        if kind == "disk":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DatasetError(f"dataset {path} has no split {split!r}; its splits are {sorted(ds)}")
                ds = ds[split]
        elif kind == "hub":
            ds = _load_hub(path, split)
        else:
            _, files = local_files(path, fmt)
            if all(_no_rows(f, kind) for f in files):  # datasets fails on these with StopIteration / ArrowInvalid
                raise DatasetError(f"dataset {path} split {split!r} has no rows (its files are empty)")
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split=split)
    except DatasetError:
        raise
    except ValueError as exc:  # datasets: 'Unknown split "test". Should be one of [...]'
        raise DatasetError(f"dataset {path} split {split!r}: {exc}") from None
    except Exception as exc:  # parser errors (pyarrow / pandas) come in many types
        raise DatasetError(f"dataset {path} ({kind}) could not be read: {type(exc).__name__}: {exc}") from None
    return ds.flatten_indices() if ds._indices is not None else ds


def _no_rows(path: Path, kind: str) -> bool:
    """A data file without rows: parquet with 0 rows in its footer, other files blank."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # not parquet at all: datasets' reader names the problem
            return False
    return path.stat().st_size == 0 or (path.stat().st_size < 1 << 16 and not path.read_bytes().strip())


def _load_hub(path: str, split: str):
    import datasets
    from huggingface_hub import constants

    try:
        return datasets.load_dataset(path, split=split)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        where = ("offline (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
                 if constants.HF_HUB_OFFLINE else "it could not be loaded from the Hub")
        raise DatasetError(f"dataset {path!r} is not a local path and {where}: {exc}") from None


def sha256_file(path: Path) -> str:
    """sha256 hex of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(path: str, fmt: Format = "auto") -> dict[str, str]:
    """``{path relative to the dataset's root: sha256}`` of a local dataset's files; ``{}`` for a Hub id."""
    root, files = local_files(path, fmt)
    return {f.relative_to(root).as_posix(): sha256_file(f) for f in files}


def data_fingerprint(config: DatasetConfig) -> dict:
    """The data part of the task fingerprint stored in each learner checkpoint.

    Returns:
        ``{"data_files": {"train": {relpath: sha256}, "eval": {...}}, "data_tree": sha256}``: ``eval`` only when
        the eval data has its own ``path``; ``data_tree`` hashes the sorted file table (a Hub id contributes no
        files: its id, split and columns are in the task config part).
    Raises:
        DatasetError: a local path that does not exist.
    """
    files = {"train": file_hashes(config.path, config.format)}
    if config.eval is not None and config.eval.path is not None:
        files["eval"] = file_hashes(config.eval.path, config.eval.format)
    tree = hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"data_files": files, "data_tree": tree}


def is_hub(path: str, fmt: Format = "auto") -> bool:
    """Whether ``path`` names a Hub dataset (``format: hub``, or ``org/name`` that is no local path)."""
    return fmt == "hub" or (fmt == "auto" and not Path(path).expanduser().exists() and not glob.has_magic(path)
                            and bool(_HUB_ID.match(path)) and Path(path).suffix not in EXTENSIONS)


def resolve_paths(task: dict) -> None:
    """Make the local dataset paths of a raw recipe ``task`` mapping absolute (from the CWD), in place: the
    services read them from other working directories. Hub ids and values of the wrong type are left alone."""
    mixture = task.get("mixture")
    comps = [task] + [c for c in (mixture.values() if isinstance(mixture, dict) else []) if isinstance(c, dict)]
    for comp in comps:
        ds = comp.get("dataset")
        for cfg in (ds, ds.get("eval") if isinstance(ds, dict) else None):
            if isinstance(cfg, dict) and isinstance(cfg.get("path"), str) and not is_hub(cfg["path"],
                                                                                        cfg.get("format", "auto")):
                cfg["path"] = os.path.abspath(os.path.expanduser(cfg["path"]))
