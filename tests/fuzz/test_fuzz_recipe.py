"""Fuzz ``load_recipe`` with YAML documents around the real recipe: changed values of every type, unknown
and missing keys, random text and bytes, alias bombs. It returns a valid ``Recipe`` or raises
``RecipeError`` naming a key; any other exception type is a bug (the cases at the end were such bugs:
non-UTF-8 bytes, deep nesting, ``--set`` through a scalar)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, strategies as st

from gyre.services.control.recipe.schema import Recipe, RecipeError, load_recipe
from tests.tiny_model import SMOLLM2_DIR

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "deploy/recipes/smollm2-arith.yaml").read_text())
BASE["model"] = str(SMOLLM2_DIR.resolve())

pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(),
                                reason=f"{SMOLLM2_DIR} missing (`make model`): the base recipe would not load")

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=12),
                    st.floats(allow_nan=True, allow_infinity=True))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def _dict_paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    for key, value in node.items():
        if isinstance(value, dict):
            out += _dict_paths(value, prefix + (key,))
    return out


DICT_PATHS = _dict_paths(BASE)


def load_text(tmp_path_factory, text: str | bytes):
    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return load_recipe(path)


@st.composite
def mutated(draw) -> tuple[dict, tuple]:
    """The real recipe with one change at a random dict path: a key set to any value (known or new
    key), or deleted. Returns ``(document, path of the changed key)``."""
    doc, parent_path = copy.deepcopy(BASE), draw(st.sampled_from(DICT_PATHS))
    parent = doc
    for key in parent_path:
        parent = parent[key]
    key = draw(st.one_of(st.sampled_from(sorted(parent)), st.text(min_size=1, max_size=8)))
    if key in parent and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(VALUES)
    return doc, parent_path + (key,)


def test_the_base_recipe_loads(tmp_path_factory):
    """The control: every rejection below starts from a document that loads."""
    assert isinstance(load_text(tmp_path_factory, yaml.safe_dump(BASE)), Recipe)


@given(case=mutated())
def test_a_changed_key_loads_or_is_named(tmp_path_factory, case):
    doc, path = case
    try:
        recipe = load_text(tmp_path_factory, yaml.safe_dump(doc, allow_unicode=True))
    except RecipeError as exc:
        message = str(exc)
        assert any(str(k) in message for k in path), f"{message!r} names none of {path}"
        return
    assert isinstance(recipe, Recipe)


@given(text=st.one_of(st.text(max_size=300),
                      st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace"))))
def test_random_text_is_a_recipe_error(tmp_path_factory, text):
    """Any text (control characters, tabs, NULs, stray YAML syntax); non-UTF-8 bytes are the known bug below."""
    with pytest.raises(RecipeError, match="recipe .*recipe.yaml"):
        load_text(tmp_path_factory, text)


@given(levels=st.integers(1, 5), width=st.integers(2, 10), key=st.sampled_from(["seed", "task", "bogus"]))
def test_alias_bombs_within_limits_are_named(tmp_path_factory, levels, width, key):
    """``width ** levels`` leaves (up to 10^5) built from aliases, put under a typed, a section and an
    unknown key: PyYAML shares the nodes, pydantic names the key without expanding them all."""
    lines = ["a0: &a0 [1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    doc = yaml.safe_dump({k: v for k, v in BASE.items() if k != key}) + "\n".join(lines) + f"\n{key}: *a{levels}\n"
    with pytest.raises(RecipeError) as err:
        load_text(tmp_path_factory, doc)
    assert f"{key}:" in str(err.value) and "a0: unknown key" in str(err.value)


# ---- once bugs, now refused ----------------------------------------------------------------------------------
def _deep(depth: int) -> str:
    return yaml.safe_dump(BASE) + "bogus: " + "[" * depth + "]" * depth + "\n"


@pytest.mark.parametrize("text", [
    pytest.param(yaml.safe_dump(BASE).encode() + b"# \xff\xfe\n", id="non-utf8-comment"),
    pytest.param(b"name: \xe9t\xe9\n", id="latin1-value"),
    pytest.param(_deep(3000), id="nesting-3000"),
])
def test_known_bad_documents_are_recipe_errors(tmp_path_factory, text):
    with pytest.raises(RecipeError, match="recipe "):
        load_text(tmp_path_factory, text)


@pytest.mark.parametrize("overrides", [
    pytest.param({"name.x": 1}, id="into-a-string"),
    pytest.param({"task.params.operators.x": 1}, id="into-a-list"),
])
def test_overrides_through_a_non_mapping_are_recipe_errors(overrides):
    with pytest.raises(RecipeError, match=list(overrides)[0].split(".")[0]):
        load_recipe(REPO / "deploy/recipes/smollm2-arith.yaml", overrides)


def test_nan_in_a_typed_key_is_named(tmp_path_factory):
    with pytest.raises(RecipeError, match="learner.num_steps"):
        load_text(tmp_path_factory, yaml.safe_dump({**BASE, "learner": {**BASE["learner"], "num_steps": math.nan}}))
