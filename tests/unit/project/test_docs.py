"""The docs site builds with ``mkdocs build --strict`` (no broken link, anchor or nav entry), its generated
reference pages list every recipe key and command, every recipe key has a docstring, and the README stays a
screenful."""

import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from services.cli.main import build_parser
from services.cli.reference_docs import _docstrings, _models_in, cli_reference, field_docstrings, recipe_reference
from services.control.recipe import Recipe

REPO = Path(__file__).resolve().parents[3]


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel], str]]:
    out = []
    for name, info in model.model_fields.items():
        out.append((f"{prefix}{name}", model, name))
        for sub in _models_in(info.annotation):
            out += _all_keys(sub, f"{prefix}{name}.")
    return out


def test_every_recipe_key_has_a_docstring():
    missing = sorted({f"{model.__name__}.{name} ({key})" for key, model, name in _all_keys(Recipe)
                      if not _docstrings(model).get(name)})
    assert missing == [], "document these fields (a string literal under each), the recipe reference shows it"


def test_the_recipe_reference_lists_every_key_of_every_section():
    page = recipe_reference()
    documented = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    # a component configured in two places (a mixture component's dataset) is listed once; the other section
    # says "The same keys as [`task.dataset`]"
    aliases = dict(re.findall(r"^## `([^`]+)`\n\nThe same keys as \[`([^`]+)`\]", page, flags=re.M))

    def listed(key: str) -> bool:
        return key in documented or any(key.startswith(alias + ".") and target + key[len(alias):] in documented
                                        for alias, target in aliases.items())

    assert [key for key, _, _ in _all_keys(Recipe) if not listed(key)] == []
    assert "`learner.algorithm.loss_agg_mode`" in page and "`replay.wal.durability`" in page
    assert '`"token-mean"`' in page  # a Literal's values are spelled out


def test_field_docstrings_reads_the_literal_under_each_field():
    class Example(BaseModel):
        documented: int = 1
        """Its docstring."""
        bare: str = "x"
        nested: typing.Optional[int] = None
        """Another
        line."""

    assert field_docstrings(Example) == {"documented": "Its docstring.", "nested": "Another\nline."}


def test_the_cli_reference_has_every_command():
    page = cli_reference()
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    for command in sub.choices:
        assert f"### `gyre {command}`" in page
    assert "--force-resume" in page


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (the docs extra; make setup-dev installs it)")
def test_mkdocs_build_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    # PYTHONPATH: docs/hooks.py imports this checkout's services, not whichever checkout the venv installed
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(mkdocs.parent), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    recipe = (tmp_path / "site" / "reference" / "recipe" / "index.html").read_text()
    assert "learner.algorithm.ppo_epochs" in recipe and "generated:recipe" not in recipe
    assert "gyre scale" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def test_readme_is_a_screenful_and_shows_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    assert "make run" in readme and "make test" in readme
    for link in re.findall(r"\]\(((?:docs/)[^)#]+)", readme):
        assert (REPO / link).exists(), link
