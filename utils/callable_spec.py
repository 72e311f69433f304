"""How a recipe names a Python callable of the user's: ``"pkg.module:fn"`` or ``"path/to/file.py:fn"``.

Shared by the rollout's reward functions (``rollout.rewards.function``) and the learner's custom objectives
(``learner.objectives``); each wraps ``CallableSpecError`` into its own error that names the recipe key.

- ``"pkg.module:fn"``: imported with ``importlib`` (on a cluster the module reaches the actors with the recipe's
  ``ray.runtime_env``: ``working_dir`` / ``py_modules``). A module already imported whose file changed since it was
  last loaded here is re-executed from its new source (as ``importlib.reload`` does), so the bytes that run are
  the bytes returned (and hashed into a version by the caller).
- ``"path/to/file.py:fn"``: the file's bytes executed into a fresh module on every load; a relative path is
  resolved by the caller (``resolve_file_spec``).
- ``fn`` may be dotted (``"pkg.module:Class.method"``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


class CallableSpecError(ValueError):
    """A spec that does not name a loadable callable; the message says what is wrong (without the spec: the
    caller names it and its recipe key)."""


def split_spec(spec: str) -> tuple[str, str]:
    """``"a.b:fn"`` → ``("a.b", "fn")``; ``"dir/r.py:fn"`` → ``("dir/r.py", "fn")``.

    Raises:
        CallableSpecError: no ``:``, an empty part, or an attribute that is not a dotted identifier, or a
            target that is neither a dotted module name nor a ``.py`` file.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise CallableSpecError("not of the form target:function")
    if not target.endswith(".py") and not all(p.isidentifier() for p in target.split(".")):
        raise CallableSpecError(f"{target!r} is neither a dotted module name nor a .py file")
    return target, attr


def is_file_spec(spec: str) -> bool:
    """True when ``spec``'s target is a ``.py`` file rather than a module."""
    return spec.rpartition(":")[0].endswith(".py")


def resolve_file_spec(spec: str, base: Path) -> str:
    """``spec`` with a relative ``file.py`` target made absolute against ``base`` (modules unchanged)."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py") and not Path(target).expanduser().is_absolute():
        return f"{(base / Path(target).expanduser()).resolve()}:{attr}"
    return spec


_MODULE_SHA: dict[str, str] = {}
"""Module name → sha256 of its source file when it was last (re)loaded here."""


def _load_file(target: str) -> tuple[Any, bytes]:
    path = Path(target).expanduser()
    if not path.is_file():
        raise CallableSpecError(f"file {path} does not exist")
    source = path.read_bytes()
    name = "gyre_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # dataclasses look their module up by name
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # the bytes that are returned
    except Exception as exc:
        raise CallableSpecError(f"importing {path} raised {type(exc).__name__}: {exc}") from None
    return module, source


def _load_module(target: str) -> tuple[Any, bytes]:
    try:
        module = importlib.import_module(target)
        origin = getattr(module, "__file__", None)
        if not origin or not origin.endswith(".py"):
            raise CallableSpecError(f"module {target!r} has no Python source file to hash for the version")
        source = Path(origin).read_bytes()
        sha = hashlib.sha256(source).hexdigest()
        if _MODULE_SHA.get(target, sha) != sha:  # edited since it was loaded: run the bytes that are returned
            exec(compile(source, origin, "exec"), module.__dict__)  # as importlib.reload, without a stale .pyc
        _MODULE_SHA[target] = sha
    except CallableSpecError:
        raise
    except Exception as exc:
        raise CallableSpecError(f"module {target!r} does not import: {type(exc).__name__}: {exc}") from None
    return module, source


def load_callable(spec: str) -> tuple[Callable, bytes]:
    """Import the callable ``spec`` names; returns it and the source bytes of the file that defines its module.

    Raises:
        CallableSpecError: bad form (``split_spec``), a missing file, a module or file that does not import, a
            missing attribute (the module's public callables are listed), or an attribute that is not callable.
    """
    target, attr = split_spec(spec)
    module, source = _load_file(target) if target.endswith(".py") else _load_module(target)
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise CallableSpecError(f"{target} has no attribute {attr!r} (its callables: {', '.join(public) or 'none'})")
        fn = getattr(fn, part)
    if not callable(fn):
        raise CallableSpecError(f"{attr!r} is a {type(fn).__name__}, not callable")
    return fn, source
