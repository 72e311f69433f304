"""Reference pages generated from the code, so they cannot drift from it.

``recipe_reference()`` renders every key of a recipe (``services.control.recipe.schema.Recipe`` and the component configs it
nests) as Markdown tables: dotted key, type, default, and the field's docstring. ``cli_reference()`` renders
``gyre --help`` and each subcommand's help from the argparse parser; ``objectives_reference()`` the custom-objective
tensor contract (``learner.objectives``). The docs site calls them at build time
(``docs/hooks.py``), replacing the ``<!-- generated:... -->`` markers of ``docs/reference/*.md``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def field_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of ``cls``'s own annotated fields (the string literal after ``name: type = ...``),
    as pydantic's ``use_attribute_docstrings`` reads them; ``{}`` when the source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def _docstrings(model: type[BaseModel]) -> dict[str, str]:
    out: dict[str, str] = {}
    for base in reversed(model.__mro__):  # a subclass's docstring wins over its base's
        if isinstance(base, type) and issubclass(base, BaseModel) and base is not BaseModel:
            out.update(field_docstrings(base))
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (``X``, ``X | None``, ``list[X]``, ``Annotated[A | B, ...]``)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += [m for m in _models_in(arg) if m not in out]
    return out


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{v!r}`" if not isinstance(v, str) else f'`"{v}"`' for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _constraints(info: FieldInfo) -> str:
    marks = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "min length", "max_length": "max length",
             "pattern": "pattern"}
    out = []
    for item in info.metadata:
        for attr, mark in marks.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{mark} `{value}`" if attr != "pattern" else f"pattern `{value}`")
    return ", ".join(out)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()
    else:
        value = info.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(section)"
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return f"`{text}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(prefix: str) -> str:
    """The id mkdocs' toc extension gives the heading ``## `prefix```."""
    return "".join(c for c in prefix.lower() if c.isalnum() or c in "-_ ").strip().replace(" ", "-")


def _shallowest_keys(root: type[BaseModel]) -> dict[type, str]:
    """Each config class → the shortest key it is configured under (breadth first): its keys are listed there."""
    out: dict[type, str] = {}
    queue = [(root, "")]
    while queue:
        model, prefix = queue.pop(0)
        if model in out:
            continue
        out[model] = prefix
        for name, info in model.model_fields.items():
            queue += [(sub, f"{prefix}.{name}" if prefix else name) for sub in _models_in(info.annotation)]
    return out


def _section(model: type[BaseModel], prefix: str, out: list[str], home: dict[type, str]) -> None:
    if home[model] != prefix:  # the same component configured in two places: its keys are listed once
        out += [f"## `{prefix}`", "", f"The same keys as [`{home[model]}`](#{_anchor(home[model])}).", ""]
        return
    doc = inspect.cleandoc(model.__doc__ or "")
    tag = model.model_fields.get("type")
    variant = ""  # a member of a discriminated union (weight_transport) is titled by its ``type``
    if tag is not None and typing.get_origin(tag.annotation) is Literal:
        variant = f" with `type: {typing.get_args(tag.annotation)[0]}`"
    out += [f"## `{prefix or '(top level)'}`{variant}", "", f"*{model.__module__}.{model.__name__}*. " + _cell(doc), "",
            "| key | type | default | description |", "|---|---|---|---|"]
    docs, nested = _docstrings(model), []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        limits = _constraints(info)
        type_text = _type_name(info.annotation) + (f" ({limits})" if limits else "")
        out.append(f"| `{key}` | {type_text} | {_default(info)} | {_cell(docs.get(name, ''))} |")
        nested += [(key, m) for m in _models_in(info.annotation)]
    out.append("")
    for key, sub in nested:
        _section(sub, key, out, home)


def recipe_reference() -> str:
    """Markdown: one table per recipe section, every key with its type, default and docstring."""
    from gyre.services.control.recipe.schema import Recipe

    out: list[str] = []
    _section(Recipe, "", out, _shallowest_keys(Recipe))
    return "\n".join(out)


def objectives_reference() -> str:
    """Markdown: the custom-objective tensor contract, one table per input dataclass of ``learner.objectives``
    (``AdvantageInputs``, ``LossInputs``), each field with its docstring, and ``LossInputs.aggregate``."""
    import dataclasses

    from gyre.learner.algo.objectives import AdvantageInputs, LossInputs

    out: list[str] = []
    for cls in (AdvantageInputs, LossInputs):
        docs = field_docstrings(cls)
        out += [f"### `{cls.__name__}`", "", _cell(inspect.cleandoc(cls.__doc__ or "")), "",
                "| field | description |", "|---|---|"]
        out += [f"| `{f.name}` | {_cell(docs.get(f.name, ''))} |" for f in dataclasses.fields(cls)]
        out.append("")
    out += ["`LossInputs.aggregate(per_token)`: " + _cell(inspect.cleandoc(LossInputs.aggregate.__doc__ or "")), ""]
    return "\n".join(out)


def cli_reference() -> str:
    """Markdown: ``gyre --help`` and every subcommand's ``--help``, as the parser prints them."""
    import argparse

    from gyre.services.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["### `gyre`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, command in sub.choices.items():
        out += [f"### `gyre {name}`", "", "```text", command.format_help().rstrip(), "```", ""]
        nested = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
        for action, parser_ in (nested.choices.items() if nested is not None else ()):  # gyre reward swap
            out += [f"### `gyre {name} {action}`", "", "```text", parser_.format_help().rstrip(), "```", ""]
    return "\n".join(out)
