"""``gyre sweep``'s file and cells: grid × zip × seeds, run-name templates, refusals that name the key or cell."""

from pathlib import Path

import pytest
import yaml

from gyre.services.cli.sweep import _yaml_value, plan_sweep, run_command
from gyre.services.cli.sweep_config import SweepConfig, SweepError, expand_cells, read_sweep
from tests.tiny_model import SMOLLM2_DIR

BASE = {"name": "tiny-test", "seed": 7, "learner": {"num_steps": 3}}


def _cells(**sweep):
    return expand_cells(SweepConfig(base="x.yaml", **sweep), BASE)


def test_grid_times_zip_times_seeds_in_order():
    cells = _cells(grid={"lockstep_lag": [0, 2], "learner.algorithm.is_weight": ["none", "tis_token"]},
                   zip={"learner.engine.lr": [1.0e-3, 2.0e-3], "learner.engine.seed": [1, 2]}, seeds=[0, 1],
                   run_name="lag{lockstep_lag}-{is_weight}-lr{lr:g}-s{seed}")
    assert len(cells) == 2 * 2 * 2 * 2
    assert [c.index for c in cells] == list(range(16))
    assert cells[0].overrides == {"lockstep_lag": 0, "learner.algorithm.is_weight": "none", "learner.engine.lr": 1.0e-3,
                                  "learner.engine.seed": 1, "seed": 0}
    assert [c.name for c in cells[:5]] == ["lag0-none-lr0.001-s0", "lag0-none-lr0.001-s1", "lag0-none-lr0.002-s0",
                                           "lag0-none-lr0.002-s1", "lag0-tis_token-lr0.001-s0"]
    assert cells[-1].name == "lag2-tis_token-lr0.002-s1"
    # zip pairs values (never lr 1e-3 with engine seed 2), grid crosses them
    assert {(c.overrides["learner.engine.lr"], c.overrides["learner.engine.seed"]) for c in cells} == {(1.0e-3, 1), (2.0e-3, 2)}


def test_the_default_name_and_base_recipe_placeholders():
    cells = _cells(grid={"lockstep_lag": [0, 4]}, seeds=[3])
    assert [c.name for c in cells] == ["tiny-test-lockstep_lag0-s3", "tiny-test-lockstep_lag4-s3"]
    # {name} and {learner.num_steps} from the base recipe, {seed} without seeds: the base recipe's seed
    assert [c.name for c in _cells(grid={"lockstep_lag": [1]}, run_name="{name}-{learner.num_steps}-{seed}-{index}")] \
        == ["tiny-test-3-7-0"]
    # a set: key counts as the cell's (its value overrides the base recipe's)
    assert _cells(set={"learner.num_steps": 9}, run_name="n{num_steps}")[0].name == "n9"
    assert len(_cells()) == 1 and _cells()[0].overrides == {}  # no grid, zip or seeds: the base recipe once


def test_two_cells_with_one_name_are_refused_naming_both():
    with pytest.raises(SweepError) as err:
        _cells(grid={"lockstep_lag": [0, 2]}, seeds=[0, 1], run_name="lag{lockstep_lag}")
    assert str(err.value) == ("run_name 'lag{lockstep_lag}' gives cell 0 (lockstep_lag=0 seed=0) and cell 1 "
                              "(lockstep_lag=0 seed=1) the same name 'lag0'; add the keys that differ")


@pytest.mark.parametrize("template, message", [
    ("{nope}", "cell 0 (lockstep_lag=0): run_name: {nope} is no key of the cell (learner.engine.lr, lockstep_lag), not index and not "
               "a key of the base recipe"),
    ("{lr:d}", "cell 0 (lockstep_lag=0): run_name: {lr:d} cannot format"),
])
def test_a_placeholder_that_names_nothing_is_refused(template, message):
    with pytest.raises(SweepError) as err:
        _cells(grid={"lockstep_lag": [0]}, set={"learner.engine.lr": 0.5}, run_name=template)
    assert str(err.value).startswith(message)


def test_an_ambiguous_suffix_is_refused():
    with pytest.raises(SweepError, match=r"\{seed\} matches learner.engine.seed, task.seed; write one in full"):
        _cells(grid={"task.seed": [1, 2], "learner.engine.seed": [1]}, run_name="{seed}")


@pytest.mark.parametrize("sweep, message", [
    ({"zip": {"lockstep_lag": [0, 2], "replay.max_staleness": [0, 2, 4]}},
     "zip: every list must have the same length; lockstep_lag has 2, replay.max_staleness has 3 values"),
    ({"grid": {"name": ["a", "b"]}}, "grid: name is set by the sweep itself"),
    ({"set": {"run_dir": "x"}}, "set: run_dir is set by the sweep itself"),
    ({"grid": {"learner.resume": ["none"]}}, "grid: learner.resume is set by the sweep itself"),
    ({"grid": {"lockstep_lag": []}}, "grid.lockstep_lag: an empty list of values gives no cell"),
    ({"grid": {"a..b": [1]}}, "grid: 'a..b' is not a dotted recipe key"),
    ({"grid": {"seed": [1]}, "seeds": [0]}, "seed is in grid and seeds is set"),
    ({"grid": {"lockstep_lag": [1]}, "zip": {"lockstep_lag": [2]}}, "lockstep_lag is in both grid and zip"),
    ({"seeds": [1, 1]}, "seeds [1, 1] repeats a seed"),
    ({"parallel": 0}, "parallel: Input should be greater than or equal to 1"),
    ({"backend": "slurm"}, "backend: Input tag 'slurm' found using 'type' does not match"),
    ({"grids": {}}, "grids: unknown key"),
])
def test_bad_sweep_files_are_refused_naming_the_key(tmp_path, sweep, message):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "deploy/recipes/tiny-test.yaml", **sweep}, sort_keys=False))
    with pytest.raises(SweepError) as err:
        read_sweep(path)
    assert str(err.value).startswith(f"sweep file {path}: ") and message in str(err.value), str(err.value)


def test_the_sweep_name_defaults_to_the_file_name_and_backend_strings(tmp_path):
    path = tmp_path / "lag-ablation.yaml"
    path.write_text("base: b.yaml\nbackend: ray-job\n")
    config = read_sweep(path)
    assert config.name == "lag-ablation" and config.backend.type == "ray-job" and config.backend.address is None


def _sweep_file(tmp_path, **extra):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "deploy/recipes/tiny-test.yaml", "run_dir": str(tmp_path / "runs"),
                                    "set": {"model": str(SMOLLM2_DIR)}, **extra}, sort_keys=False))
    return path


def test_every_cell_recipe_is_loaded_up_front_and_a_bad_one_is_named(tmp_path):
    path = _sweep_file(tmp_path, grid={"lockstep_lag": [0, 1], "learner.algorithm.is_weight": ["tis_token", "bogus"]},
                       run_name="l{lockstep_lag}-{is_weight}")
    with pytest.raises(SweepError) as err:
        plan_sweep(path)
    text = str(err.value)
    assert text.startswith(f"sweep {path}: cell 1 (lockstep_lag=0 learner.algorithm.is_weight=bogus, run l0-bogus): "
                           "recipe "), text
    assert "learner.algorithm.is_weight: Input should be" in text and "(got 'bogus')" in text
    unknown = _sweep_file(tmp_path, grid={"learner.algorithm.is_wait": ["none"]})
    with pytest.raises(SweepError, match=r"cell 0 \(learner.algorithm.is_wait=none, .*is_wait: unknown key"):
        plan_sweep(unknown)


def test_a_plan_gives_each_run_its_overrides_and_the_command_resumes_auto(tmp_path):
    path = _sweep_file(tmp_path, set={"model": str(SMOLLM2_DIR), "learner.num_steps": 4},
                       grid={"learner.engine.lr": [1.0e-5, 0.5]}, seeds=[3], run_name="lr{lr}")
    plan = plan_sweep(path)
    assert plan.sweep_dir == tmp_path / "runs" / "s" and [c.name for c in plan.cells] == ["lr1e-05", "lr0.5"]
    assert plan.num_steps == {"lr1e-05": 4, "lr0.5": 4}
    argv = run_command(plan, plan.cells[0])
    assert argv[1:5] == ["-m", "gyre.services.cli", "run", str(plan.base)] and argv[-2:] == ["--resume", "auto"]
    pairs = argv[5:-2]
    assert pairs[0::2] == ["--set"] * (len(pairs) // 2)
    sets = dict(p.split("=", 1) for p in pairs[1::2])
    assert sets == {"model": str(SMOLLM2_DIR), "learner.num_steps": "4", "learner.engine.lr": "1.0e-05",
                    "seed": "3", "name": "lr1e-05", "run_dir": str(plan.sweep_dir)}
    assert yaml.safe_load(sets["learner.engine.lr"]) == 1.0e-5  # read back by gyre run --set as the same float


@pytest.mark.parametrize("value", [1.0e-5, 0.001, 3, True, None, "none", "null", "true", "1e-3", "a b", [1, 2],
                                   {"a": 1}])
def test_set_values_read_back_as_the_same_value(value):
    assert yaml.safe_load(_yaml_value(value)) == value


def test_a_ray_job_command_submits_gyre_run_to_the_cluster(tmp_path):
    path = _sweep_file(tmp_path, backend={"type": "ray-job", "address": "http://head:8265"}, seeds=[1])
    plan = plan_sweep(path)
    argv = run_command(plan, plan.cells[0], "job-1")
    assert Path(argv[0]).name == "ray" and argv[1:9] == ["job", "submit", "--address", "http://head:8265",
                                                         "--working-dir", ".", "--submission-id", "job-1"]
    rest = argv[argv.index("--") + 1:]
    assert rest[:5] == ["python", "-m", "gyre.services.cli", "run", "deploy/recipes/tiny-test.yaml"]
    assert rest[-4:] == ["--set", "ray.address=auto", "--resume", "auto"]
