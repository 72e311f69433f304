"""gyre's own modules import each other without a circle, and the cores stay free of the transports.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import x`` / ``from x import y``
of one of gyre's packages counts, at module level or inside a function (a deferred import that closes a
circle is still a circle, only one Python happens to survive), ``if TYPE_CHECKING:`` blocks included (type
hints name the layering too). Generated ``*_pb2*.py`` files are left out.

The cores' rule (docs/concepts/architecture.md): ``replay/``, ``rollout/`` and ``learner/`` run without gRPC
or Ray — the services wrap them — so importing a core module must not import ``grpc`` or ``ray``, neither
itself at module level nor through a gyre module it imports at module level (package ``__init__`` files
included). Imports inside functions are allowed (a core may offer an optional Ray/gRPC path).

The services' layering (same page): under ``services/``, ``common/`` imports no service package, a service
(``replay/``, ``learner/``, ``rollout/``, ``reward_model/``) imports no other service's package and no core but its
own (``SERVICE_CORES``), control imports the services and the CLI imports control, never the other way round
(``SERVICE_LAYERS``; every import counts). Below them, the cores and the ground packages (``proto/``, ``utils/``,
``faults/``) import nothing of ``services/`` (``GROUND``).

Every module is named by gyre's import name (``gyre.learner.engine``); a bare ``import learner`` or
``from proto import ...`` anywhere in the repository (``tests/``, ``bench/`` and ``examples/`` included) is
refused: it would load a second copy of a module, or proto-plus's ``proto``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("services", "proto", "utils", "faults", "learner", "rollout", "replay", "deploy")
"""The folders ``setup.py`` maps under ``gyre``: module ``gyre.<folder>.<...>``."""
CORES = ("replay", "rollout", "learner")
GROUND = ("proto", "utils", "faults") + CORES
TRANSPORTS = ("grpc", "ray")
CORE_TRANSPORT_EXCEPTIONS: dict[str, str] = {}
"""core module -> why it may import a transport at module level. Empty: no core module does today."""


@functools.cache
def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every gyre source module (``gyre.<folder>...``; ``bench/`` modules, run
    from a checkout and not installed, under their own ``bench.<...>``)."""
    out = {"gyre": REPO / "gyre" / "__init__.py"}
    for package, prefix in [(p, ("gyre",)) for p in PACKAGES] + [("bench", ())]:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = prefix + path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """``(dotted name, at module level)`` for every import in ``path``: ``import a.b`` gives ``a.b``,
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module or a name); relative imports are
    resolved against ``module``'s package. Module level: not inside a function or lambda."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, top))
            out.extend((f"{base}.{alias.name}", top) for alias in node.names)
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), True)
    return out


@functools.cache
def all_imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> ``_imports`` of its file (each file parsed once per test session)."""
    return {module: _imports(module, path) for module, path in module_files().items()}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The gyre module ``name`` imports (its longest prefix that is one), or ``None``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(module_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the gyre modules it imports (itself and, from a package's ``__init__``, its parents left out)."""
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, top in all_imports()[module]:
            target = _resolve(name, modules)
            if target is None or target == module or (module_level_only and not top):
                continue
            if path.name == "__init__.py" and module.startswith(target + "."):
                continue
            graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_planted_circle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_among_gyre_modules():
    graph = import_graph()
    found = cycles(graph)
    report = "\n".join(
        f"  {' <-> '.join(c)}\n" + "".join(f"      {m} imports {sorted(graph[m] & set(c))}\n" for m in c)
        for c in found)
    assert not found, (f"{len(found)} import circle(s) among gyre's modules (deferred imports count; move the "
                       f"shared part to a module both import, or pass a callable):\n{report}")


def transport_chain(module: str, graph: dict[str, set[str]], direct: dict[str, set[str]]) -> list[str] | None:
    """The module-level import chain from ``module`` to a transport it pulls in (``[module, ..., "grpc"]``), or
    ``None``. ``graph``: module-level imports among gyre modules; ``direct``: module -> transports it imports
    itself at module level. Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first, so
    parent packages count."""
    seen, queue = {module: [module]}, [module]
    while queue:
        m = queue.pop(0)
        if direct.get(m):
            return seen[m] + [sorted(direct[m])[0]]
        parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)} & set(graph)
        for nxt in sorted(graph[m] | parents):
            if nxt not in seen:
                seen[nxt] = seen[m] + [nxt]
                queue.append(nxt)
    return None


def test_transport_chain_follows_module_level_imports_and_parent_packages():
    graph = {"core": {"core.util"}, "core.util": {"svc.client"}, "svc": set(), "svc.client": set(), "other": set()}
    assert transport_chain("core.util", graph, {"svc": {"grpc"}}) == ["core.util", "svc.client", "svc", "grpc"]
    assert transport_chain("other", graph, {"svc": {"grpc"}}) is None


def test_core_modules_import_no_grpc_or_ray_at_import_time():
    modules = module_files()
    graph = import_graph(module_level_only=True)
    direct = {m: {name.split(".")[0] for name, top in all_imports()[m] if top} & set(TRANSPORTS) for m in modules}
    assert any(direct.values()), "no gyre module imports grpc or ray at module level: the check reads nothing"
    bad = {}
    for module in sorted(m for m in modules if m.split(".")[:2] in [["gyre", c] for c in CORES]
                         and m not in CORE_TRANSPORT_EXCEPTIONS):
        if chain := transport_chain(module, graph, direct):
            bad[module] = " -> ".join(chain)
    assert not bad, ("core modules (replay/, rollout/, learner/) that import grpc or ray when imported (import it "
                     "inside the function that needs it, or move that code to services/):\n"
                     + "\n".join(f"  {m}: {chain}" for m, chain in bad.items()))


SERVICE_LAYERS: dict[str, set[str]] = {
    "common": {"common"},
    **{s: {s, "common"} for s in ("replay", "learner", "rollout", "reward_model")},
    "control": {"control", "common", "replay", "learner", "rollout", "reward_model"},
    "cli": {"cli", "control", "common", "replay", "learner", "rollout", "reward_model"},
}
"""``services/`` package -> the ``services`` packages it may import (docs/concepts/architecture.md): ``common`` is
shared plumbing and imports no service; a service (replay, learner, rollout, reward_model) imports only itself and
``common``, never another service's package; control imports the services, the CLI imports control."""

SERVICE_CORES: dict[str, set[str]] = {
    "common": set(), "replay": {"replay"}, "learner": {"learner"}, "rollout": {"rollout"},
    "reward_model": {"rollout.rewards"}, "control": set(CORES), "cli": set(CORES),
}
"""``services/`` package -> the core (sub)packages it may import: a service wraps its own core (the reward-model
service scores the rewards of ``rollout/rewards/``); a contract two services share lives in ``proto/``; control and
the CLI assemble every core."""


def _within(target: str, roots) -> bool:
    return any(target == f"gyre.{r}" or target.startswith(f"gyre.{r}.") for r in roots)


def layering_violations(imports: dict[str, list[tuple[str, bool]]], modules) -> list[str]:
    """``"a imports b"`` for every import (any level, deferred ones included) that the layering forbids: from one
    ``services/`` package into another that ``SERVICE_LAYERS`` does not allow, from a ``services/`` package into a
    core outside its ``SERVICE_CORES``, and from a ``GROUND`` package into ``services/``. A ``services/`` package
    missing from the tables is reported too."""
    bad = []
    for module in sorted(imports):
        parts = module.split(".")
        ground = len(parts) >= 2 and parts[0] == "gyre" and parts[1] in GROUND
        service = parts[:2] == ["gyre", "services"] and len(parts) >= 3
        if not (ground or service):
            continue
        if service and (parts[2] not in SERVICE_LAYERS or parts[2] not in SERVICE_CORES):
            bad.append(f"{module}: services.{parts[2]} has no row in SERVICE_LAYERS / SERVICE_CORES")
            continue
        for name, _top in imports[module]:
            target = _resolve(name, modules)
            if target is None:
                continue
            if ground and _within(target, ["services"]):
                bad.append(f"{module} imports {target}")
            elif service and _within(target, ["services"]) and target.count(".") >= 2 \
                    and target.split(".")[2] not in SERVICE_LAYERS[parts[2]]:
                bad.append(f"{module} imports {target}")
            elif service and _within(target, CORES) and not _within(target, SERVICE_CORES[parts[2]]):
                bad.append(f"{module} imports {target}")
    return sorted(set(bad))


def test_layering_finds_planted_cross_service_core_and_ground_imports():
    modules = dict.fromkeys(["gyre.services", "gyre.services.common.x", "gyre.services.learner.a",
                             "gyre.services.replay.b", "gyre.services.control.c", "gyre.rollout.weights",
                             "gyre.rollout.rewards.base", "gyre.services.reward_model.d", "gyre.proto.e",
                             "gyre.learner.f"])
    imports = {"gyre.services.common.x": [("gyre.services.replay.b", False)],
               "gyre.services.learner.a": [("gyre.services.replay.b.Thing", True), ("gyre.services.common.x", True),
                                           ("gyre.rollout.weights.NcclTransportConfig", True), ("gyre.learner.f", True)],
               "gyre.services.replay.b": [("gyre.services.common.x", True)],
               "gyre.services.control.c": [("gyre.services.learner.a", True), ("gyre.services.replay.b", True),
                                           ("gyre.rollout.weights", True)],
               "gyre.services.reward_model.d": [("gyre.rollout.rewards.base", True), ("gyre.rollout.weights", False)],
               "gyre.proto.e": [("gyre.services.common.x", False)],
               "gyre.learner.f": [("gyre.services.learner.a.run", True), ("gyre.proto.e", True)]}
    assert layering_violations(imports, modules) == [
        "gyre.learner.f imports gyre.services.learner.a",
        "gyre.proto.e imports gyre.services.common.x",
        "gyre.services.common.x imports gyre.services.replay.b",
        "gyre.services.learner.a imports gyre.rollout.weights",
        "gyre.services.learner.a imports gyre.services.replay.b",
        "gyre.services.reward_model.d imports gyre.rollout.weights"]


def test_no_service_imports_another_services_package_or_core():
    bad = layering_violations(all_imports(), module_files())
    assert not bad, ("imports the layering forbids (SERVICE_LAYERS, SERVICE_CORES, GROUND): move what two services "
                     "share into services/common/, a contract two of them share into proto/, and what a core needs "
                     "from a service behind a callable it is given:\n" + "\n".join(f"  {b}" for b in bad))


BARE_ROOTS = ("tests", "bench", "examples", "docs")
"""Folders outside the installed packages whose Python must import gyre by its import name too."""


def bare_imports(path: Path, root: Path = REPO) -> list[str]:
    """``"file:line: import ..."`` for every import in ``path`` of one of ``PACKAGES`` without ``gyre.``."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        names = [n for n in names if n.split(".")[0] in PACKAGES]
        bad += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names]
    return bad


def test_bare_imports_finds_a_planted_one(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("import gyre.proto.trajectory\nfrom proto import replay_pb2\nimport learner.engine as e\n"
                       "from gyre.services.cli import main\ndef f():\n    from services.cli import main\n")
    assert [b.split(": ", 1)[1] for b in bare_imports(planted, tmp_path)] == ["proto", "learner.engine", "services.cli"]


def test_every_import_of_gyre_code_uses_the_gyre_name():
    files = [p for p in module_files().values()]
    files += [p for root in BARE_ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 400, f"only {len(files)} Python files found under {REPO}: the check reads nothing"
    bad = [b for p in files if "_pb2" not in p.name for b in bare_imports(p)]
    assert not bad, ("imports of gyre's packages without the gyre. prefix (a second copy of the module, or proto-plus's "
                     "`proto`): write `from gyre.<package> import ...`:\n" + "\n".join(f"  {b}" for b in bad))
