"""``gyre sweep``'s file: a base recipe, a ``grid:`` and/or ``zip:`` of dotted overrides, ``seeds:``, a run-name
template, how many runs at a time and where they run. ``expand_cells`` turns it into the list of runs (cells).

A sweep file (YAML)::

    base: deploy/recipes/smollm2-arith.yaml   # relative paths resolve from where gyre runs
    set: {learner.num_steps: 40, determinism: lockstep}
    grid: {lockstep_lag: [0, 2, 4], learner.algorithm.is_weight: [none, tis_token]}
    seeds: [0, 1]
    run_name: "lag{lockstep_lag}-{is_weight}-s{seed}"
    parallel: 1
    backend: local

Pure: no recipe is loaded here (``services.cli.sweep`` validates every cell's recipe before any run starts).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SweepError(ValueError):
    """A sweep that cannot run; the message names the file, the key or the cell, and what was expected."""


RESERVED_KEYS = ("name", "run_dir", "learner.resume", "learner.force_resume")
"""Recipe keys a sweep sets itself and ``set``/``grid``/``zip`` may not: the run name (``run_name``), the
run directory (``{run_dir}/{sweep name}``) and the resume mode (always ``--resume auto``). ``seed`` is refused
there only when ``seeds`` is given."""


class LocalBackend(BaseModel):
    """Runs as ``gyre run`` subprocesses on this machine, ``parallel`` at a time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["local"] = "local"
    """``local``: each run is ``python -m gyre.services.cli run BASE --set ... --resume auto`` here."""


class RayJobBackend(BaseModel):
    """Runs as Ray jobs (``ray job submit``, docs/guides/deploy.md), ``parallel`` at a time; each job is the run's
    driver on the cluster, joined with ``ray.address=auto``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["ray-job"] = "ray-job"
    """``ray-job``: each run is ``ray job submit --address ADDRESS --working-dir WORKING_DIR -- python -m
    services.cli run BASE --set ... --resume auto``; the local ``ray job submit`` waits for the job and exits 1
    when it fails."""
    address: str | None = None
    """The cluster's job API, e.g. ``http://head:8265`` (the dashboard port). ``None``: ``ray job submit``'s own
    default, the ``RAY_ADDRESS`` environment variable."""
    working_dir: str = "."
    """Uploaded as each job's working directory: gyre's checkout (``.gitignore``d paths are left out), so ``base``
    is relative to it. The runs' directory (``{run_dir}/{sweep name}``, made absolute here) must be a path the
    cluster writes and this machine reads (a shared filesystem) for ``gyre sweep status`` and resuming."""


Backend = Annotated[LocalBackend | RayJobBackend, Field(discriminator="type")]


class SweepConfig(BaseModel):
    """One sweep: every cell is the base recipe with ``set``, one combination of ``grid`` values, one row of
    ``zip`` and one of ``seeds`` applied as dotted overrides (``gyre run --set``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str
    """Path of the base recipe (YAML); a relative path resolves from where gyre runs, like ``gyre run RECIPE``."""
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """The sweep's name: its runs, ``sweep.json`` and ``logs/`` go to ``{run_dir}/{name}/``. ``None``: the sweep
    file's name without ``.yaml``."""
    run_dir: str = "runs"
    """Directory holding the sweep's directory (each cell's recipe gets ``run_dir: {run_dir}/{name}``)."""
    set: dict[str, Any] = {}
    """Dotted overrides applied to every cell, e.g. ``{learner.num_steps: 40, determinism: lockstep}``."""
    grid: dict[str, list[Any]] = {}
    """Dotted key → list of values; the cells are the cartesian product (the last key varies fastest)."""
    zip: dict[str, list[Any]] = {}
    """Dotted key → list of values, all lists of one length: value i of every key goes to the same cell
    (``{lockstep_lag: [0, 4], replay.max_staleness: [0, 4]}`` gives two cells, not four). Combined with
    ``grid`` as a product."""
    seeds: list[int] = []
    """Each cell is run once per seed (the recipe's ``seed``: lockstep sampling seeds, the learner's RNG, the
    dataset's shuffles). Empty: once, with the recipe's own seed."""
    run_name: str | None = None
    """Run-name template: ``{key}`` is the cell's value of a ``grid``/``zip``/``set`` key, written in full
    (``{learner.algorithm.is_weight}``) or by a unique dotted suffix (``{is_weight}``), ``{seed}``, ``{index}``
    (the cell's number), or any base-recipe key (``{name}``; ``{seed}`` without seeds is the recipe's); a format spec may follow (``{lr:g}``). Two cells
    with one name are refused. ``None``: ``{name}`` then ``-{last key part}{value}`` per grid/zip key and
    ``-s{seed}`` with seeds."""
    parallel: int = Field(1, ge=1)
    """Runs at a time. Locally each run is a whole gyre deployment (its own Ray, vLLM, DeepSpeed): more than one
    needs the cores and memory for all of them."""
    backend: Backend = LocalBackend()
    """Where runs go: ``local`` (``gyre run`` subprocesses here) or ``ray-job`` (``ray job submit`` to a cluster);
    a bare ``local`` / ``ray-job`` string is that backend with its defaults."""

    @field_validator("backend", mode="before")
    @classmethod
    def _bare_backend(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @field_validator("set", "grid", "zip")
    @classmethod
    def _dotted_keys(cls, value: dict, info) -> dict:
        for key in value:
            if not key or any(not part for part in key.split(".")):
                raise ValueError(f"{info.field_name}: {key!r} is not a dotted recipe key like learner.num_steps")
            if key in RESERVED_KEYS:
                raise ValueError(f"{info.field_name}: {key} is set by the sweep itself (run_name, the sweep's "
                                 "run_dir, --resume auto); remove it")
        if info.field_name in ("grid", "zip"):
            empty = [k for k, values in value.items() if not values]
            if empty:
                raise ValueError(f"{info.field_name}.{empty[0]}: an empty list of values gives no cell")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        lengths = {key: len(values) for key, values in self.zip.items()}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{k} has {n}" for k, n in lengths.items())
            raise ValueError(f"zip: every list must have the same length; {listed} values")
        sources = [("set", self.set), ("grid", self.grid), ("zip", self.zip)]
        for (a, da), (b, db) in itertools.combinations(sources, 2):
            both = sorted(set(da) & set(db))
            if both:
                raise ValueError(f"{both[0]} is in both {a} and {b}; give each key in one place")
        if self.seeds:
            clash = [src for src, d in sources if "seed" in d]
            if clash:
                raise ValueError(f"seed is in {clash[0]} and seeds is set; give the seeds in seeds only")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"seeds {self.seeds} repeats a seed")
        return self


@dataclass(frozen=True)
class Cell:
    """One run of a sweep."""

    index: int
    """Position in the sweep (0-based): grid product order, then zip row, then seed."""
    name: str
    """The run's name (the template rendered); its directory is ``{sweep dir}/{name}``."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The cell's own dotted overrides: its grid values, zip row and seed (``set`` is not repeated here)."""

    def label(self) -> str:
        """``key=value ...`` of the cell's overrides (for messages and the status table)."""
        return " ".join(f"{k}={v}" for k, v in self.overrides.items()) or "(base recipe)"


def read_sweep(path: str | Path) -> SweepConfig:
    """Read and validate a sweep file.

    Raises:
        SweepError: missing file, bad YAML, not a mapping, unknown key, wrong type, a reserved key, unequal zip
            lengths, a key given twice; the message names the file and the key.
    """
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SweepError(f"sweep file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"sweep file {path} must be a mapping at top level, got {type(data).__name__}")
    try:
        config = SweepConfig.model_validate(data)
    except ValidationError as exc:
        problems = ["".join(f"{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "")
                    + ("unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, "))
                    for e in exc.errors()]
        raise SweepError(f"sweep file {path}: " + "; ".join(problems)) from None
    return config.model_copy(update={"name": config.name or path.name.removesuffix(".yaml").removesuffix(".yml")})


_PLACEHOLDER = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def _lookup(key: str, cell: dict[str, Any], base: dict[str, Any], index: int) -> Any:
    """A placeholder's value: ``index``, a cell key (full or unique dotted suffix), else a base-recipe key."""
    if key == "index":
        return index
    if key == "seed" and "seed" not in cell and "seed" not in base:
        return 0  # the recipe's default seed
    if key in cell:
        return cell[key]
    suffix = [k for k in cell if k.endswith("." + key)]
    if len(suffix) > 1:
        raise SweepError(f"run_name: {{{key}}} matches {', '.join(sorted(suffix))}; write one in full")
    if suffix:
        return cell[suffix[0]]
    node: Any = base
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise SweepError(f"run_name: {{{key}}} is no key of the cell ({', '.join(cell) or 'none'}), not "
                             "index and not a key of the base recipe")
        node = node[part]
    return node


def render_name(template: str, cell: dict[str, Any], base: dict[str, Any], index: int) -> str:
    """The run name ``template`` gives a cell (see ``SweepConfig.run_name``).

    Raises:
        SweepError: a placeholder that names no key, names two by suffix, or whose format spec does not apply.
    """
    def sub(match: re.Match) -> str:
        key, spec = match.group(1).strip(), match.group(2) or ""
        value = _lookup(key, cell, base, index)
        try:
            return format(value, spec)
        except (ValueError, TypeError) as exc:
            raise SweepError(f"run_name: {{{key}:{spec}}} cannot format {value!r}: {exc}") from None

    return _PLACEHOLDER.sub(sub, template)


def default_template(config: SweepConfig) -> str:
    """``{name}-{leaf}{value}...-s{seed}``: the base name, then each grid/zip key's last part and value."""
    keys = [*config.grid, *config.zip]
    parts = ["{name}", *(f"{k.rsplit('.', 1)[-1]}{{{k}}}" for k in keys), *(["s{seed}"] if config.seeds else [])]
    return "-".join(parts)


def expand_cells(config: SweepConfig, base: dict[str, Any]) -> list[Cell]:
    """Every cell of the sweep, in order: grid product (last key fastest) × zip rows × seeds (fastest).

    Args:
        config: the sweep.
        base: the base recipe's YAML mapping, for ``{key}`` placeholders naming a base-recipe key (``{name}``).

    Raises:
        SweepError: a run-name placeholder that names nothing, or two cells whose names are equal (both named).
    """
    grid = [dict(zip(config.grid, values)) for values in itertools.product(*config.grid.values())]
    rows = len(next(iter(config.zip.values()), [None]))
    zipped = [{k: v[i] for k, v in config.zip.items()} for i in range(rows)]
    seeds = [{"seed": s} for s in config.seeds] or [{}]
    template = config.run_name or default_template(config)
    merged = {**base, **{k: v for k, v in config.set.items() if "." not in k}}
    cells: list[Cell] = []
    seen: dict[str, Cell] = {}
    for g, z, s in itertools.product(grid, zipped, seeds):
        overrides = {**g, **z, **s}
        index = len(cells)
        try:
            name = render_name(template, {**config.set, **overrides}, merged, index)
        except SweepError as exc:
            raise SweepError(f"cell {index} ({Cell(index, '', overrides).label()}): {exc}") from None
        cell = Cell(index, name, overrides)
        if name in seen:
            raise SweepError(f"run_name {template!r} gives cell {seen[name].index} ({seen[name].label()}) and cell "
                             f"{index} ({cell.label()}) the same name {name!r}; add the keys that differ")
        seen[name] = cell
        cells.append(cell)
    return cells
