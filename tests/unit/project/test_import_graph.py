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
(``replay/``, ``learner/``, ``rollout/``, ``reward_model/``) imports no other service's package, control imports
the services and the CLI imports control, never the other way round (``SERVICE_LAYERS``; every import counts).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("services", "proto", "faults", "learner", "rollout", "replay", "deploy", "bench")
CORES = ("replay", "rollout", "learner")
TRANSPORTS = ("grpc", "ray")
CORE_TRANSPORT_EXCEPTIONS: dict[str, str] = {}
"""core module -> why it may import a transport at module level. Empty: no core module does today."""


@functools.cache
def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every gyre source module (a package under its own name)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
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
    for module in sorted(m for m in modules if m.split(".")[0] in CORES and m not in CORE_TRANSPORT_EXCEPTIONS):
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


def layering_violations(imports: dict[str, list[tuple[str, bool]]], modules) -> list[str]:
    """``"a imports b"`` for every import (any level, deferred ones included) from one ``services/`` package into
    another that ``SERVICE_LAYERS`` does not allow; a ``services/`` package missing from the table is reported too."""
    bad = []
    for module in sorted(imports):
        parts = module.split(".")
        if parts[0] != "services" or len(parts) < 2:
            continue
        allowed = SERVICE_LAYERS.get(parts[1])
        if allowed is None:
            bad.append(f"{module}: services.{parts[1]} has no row in SERVICE_LAYERS")
            continue
        for name, _top in imports[module]:
            target = _resolve(name, modules)
            if target is None or not target.startswith("services."):
                continue
            if target.split(".")[1] not in allowed:
                bad.append(f"{module} imports {target}")
    return sorted(set(bad))


def test_layering_finds_a_planted_cross_service_import():
    modules = dict.fromkeys(["services", "services.common.x", "services.learner.a", "services.replay.b",
                             "services.control.c"])
    imports = {"services.common.x": [("services.replay.b", False)],
               "services.learner.a": [("services.replay.b.Thing", True), ("services.common.x", True)],
               "services.replay.b": [("services.common.x", True)],
               "services.control.c": [("services.learner.a", True), ("services.replay.b", True)]}
    assert layering_violations(imports, modules) == ["services.common.x imports services.replay.b",
                                                     "services.learner.a imports services.replay.b"]


def test_no_service_imports_another_services_package():
    bad = layering_violations(all_imports(), module_files())
    assert not bad, ("imports across services/ packages that the layering forbids (SERVICE_LAYERS): move what two "
                     "services share into services/common/ (or a core package if it is pure logic):\n"
                     + "\n".join(f"  {b}" for b in bad))
