"""``deploy/ray_entry.py``: arguments it hands to ``gyre run`` and the errors it gives (``gyre run`` itself is a
test double here; the slow deploy tests run the real one)."""

import os

import pytest

from gyre.services.cli import main as cli_main
from gyre.deploy import ray_entry
from tests.deploy.system import REPO


@pytest.fixture
def captured(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli_main, "main", lambda argv: calls.append((list(argv), os.getcwd())) or 0)
    monkeypatch.chdir(tmp_path)  # like `ray submit`: the script runs from the head's home, not the checkout
    return calls


def test_relative_recipe_resolves_from_the_checkout_and_forces_auto(captured):
    assert ray_entry.main(["deploy/recipes/tiny-cluster.yaml", "--set", "ray.address=local",
                           "--set", "learner.num_steps=1"]) == 0
    (argv, cwd), = captured
    assert argv == ["run", str(REPO / "deploy/recipes/tiny-cluster.yaml"), "--set", "ray.address=local",
                    "--set", "learner.num_steps=1", "--set", "ray.address=auto"]  # the last --set wins
    assert cwd == str(REPO)  # relative model/run_dir in the recipe resolve from the checkout


def test_recipe_that_exists_in_the_cwd_is_used_as_given(captured, tmp_path):
    (tmp_path / "mine.yaml").write_text("name: x\n")
    assert ray_entry.main(["mine.yaml"]) == 0
    assert captured[0][0][:2] == ["run", str(tmp_path / "mine.yaml")]


@pytest.mark.parametrize("argv, named", [([], "nothing"), (["--set", "a=1"], "'--set'")])
def test_missing_recipe_is_an_error_naming_what_came(captured, capsys, argv, named):
    assert ray_entry.main(argv) == 2
    assert f"expected a recipe path first, got {named}" in capsys.readouterr().err
    assert captured == []
