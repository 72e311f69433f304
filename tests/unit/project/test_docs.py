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

from gyre.services.cli.main import build_parser
from gyre.services.cli.reference_docs import _docstrings, _models_in, cli_reference, field_docstrings, recipe_reference
from gyre.services.control.recipe.schema import Recipe

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


LAYOUT_ROOTS = ("gyre", "proto", "utils", "faults", "replay", "rollout", "learner", "services", "deploy", "bench")
"""The folders whose source files the architecture page's Layout names, one by one."""


def layout_names(page: str) -> dict[str, set[str]]:
    """Folder (``services/control/recipe``) → the words its entry in the ``## Layout`` code block holds. A line
    that starts (after its indent) with ``name/`` opens that folder's entry, nested under the nearest less
    indented open folder; the lines after it, until the next folder line, continue the entry."""
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    current = None
    for line in block.splitlines():
        m = re.match(r"^(\s*)([\w.-]+)/(?:\s|$)", line)
        indent = len(line) - len(line.lstrip())
        if m and (current is None or indent <= stack[-1][0] + 2):
            while stack and stack[-1][0] >= indent:
                stack.pop()
            current = "/".join([s for _, s in stack] + [m.group(2)])
            stack.append((indent, m.group(2)))
            entries.setdefault(current, set())
            line = line[m.end():]
        if current is not None:
            entries[current] |= set(re.findall(r"[\w.-]+", line))
    return entries


def test_layout_reads_nested_folders_and_their_continuation_lines():
    page = ("## Layout\n\n```\nproto/      trajectory, gen\n            journal\nservices/   intro\n  common/   logs\n"
            "    deep/ names\n  cli/      main (`gyre`)\n```\n")
    assert layout_names(page) == {"proto": {"trajectory", "gen", "journal"}, "services": {"intro"},
                                  "services/common": {"logs"}, "services/common/deep": {"names"},
                                  "services/cli": {"main", "gyre"}}


def test_the_architecture_layout_names_every_source_file():
    entries = layout_names((REPO / "docs" / "concepts" / "architecture.md").read_text())
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *LAYOUT_ROOTS],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    sources = [Path(f) for f in listed if f.endswith(".py") and "_pb2" not in f and not Path(f).name.startswith("__")]
    assert len(sources) > 150, f"only {len(sources)} source files listed: the check reads nothing"
    missing = [str(f) for f in sources if f.stem not in entries.get(str(f.parent), set())]
    assert not missing, ("source files the Layout of docs/concepts/architecture.md does not name in their folder's "
                         "entry (add each, with what it holds):\n  " + "\n  ".join(missing))
