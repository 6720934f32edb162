"""The import graph of pagestream/, services/, pagestream_kernels/ and benchmarks/, read with `ast`.

Every import counts: module level, inside functions, under `if TYPE_CHECKING:`, and
`importlib.import_module("...")` with a literal name. The rules are DESIGN §1's:

- no import circles;
- dependencies point one way: benchmarks import the package, never the reverse;
- the scheduler never imports torch;
- only the proto package, the pb <-> domain conversion, the servicers and the gRPC
  transports touch the generated `*_pb2` / `*_pb2_grpc` modules;
- the frontend reaches the engine core through its client interface, never the scheduler's
  or the worker's classes; the roles module starts the worker service but does not reach
  into the worker for anything else.

A rule with a known, tracked violation lists it in KNOWN_VIOLATIONS; the test fails both on
a new violation and on a listed one that is gone (so the list only ever shrinks).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pagestream", "services", "pagestream_kernels", "benchmarks")

# (rule, importer, imported): known violations, each with who fixes it.
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a project module, or the dotted name of an outside one
    line: int
    top_level: bool  # executed when the importer is imported (not in a function/TYPE_CHECKING)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


def _resolve(name: str) -> str:
    """The deepest project module that `name` names (or `name` itself for outside code)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in _modules():
            return candidate
    return name


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, top_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it runs at import time."""
    for child in ast.iter_child_nodes(node):
        deferred = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
            isinstance(child, ast.If) and _is_type_checking(child)
        )
        child_top = top_level and not deferred
        yield child, child_top
        yield from _walk(child, child_top)


def _names(importer: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [_resolve(alias.name) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        module = _absolute(importer, node)
        return [_resolve(f"{module}.{alias.name}") for alias in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [_resolve(node.args[0].value)]
    return []


@cache
def _imports() -> tuple[Import, ...]:
    found = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, top_level in _walk(tree, True):
            for name in _names(module, node):
                if name and name != module:
                    found.append(Import(module, name, node.lineno, top_level))
    return tuple(found)


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in _modules()}
    for imp in _imports():
        if imp.imported in graph:
            graph[imp.importer].add(imp.imported)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_path_through(graph, set(c), c[0]) for c in components]


def _path_through(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """A shortest import path from `start` back to itself inside one component."""
    paths = {succ: [start, succ] for succ in sorted(graph[start] & members)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    nxt.append(succ)
        frontier = nxt
    return paths[start]


def _where(imp: Import) -> str:
    path = _modules()[imp.importer].relative_to(ROOT)
    return f"{path}:{imp.line} imports {imp.imported}"


def _check(rule: str, offending: list[Import]) -> None:
    found = {(rule, imp.importer, imp.imported) for imp in offending}
    known = {v for v in KNOWN_VIOLATIONS if v[0] == rule}
    new = [_where(imp) for imp in offending if (rule, imp.importer, imp.imported) not in known]
    assert not new, f"rule {rule!r} broken:\n  " + "\n  ".join(sorted(set(new)))
    gone = sorted(known - found)
    assert not gone, f"rule {rule!r}: listed violations are fixed, drop them: {gone}"


# ---- the rules -------------------------------------------------------------------------
def test_the_graph_is_read():
    modules = _modules()
    assert "services.scheduler.scheduler" in modules and "pagestream.cli" in modules
    edges = _graph()
    assert "services.scheduler.request" in edges["services.scheduler.scheduler"]
    # A function-level import is an edge too.
    assert "benchmarks.cli" in edges["benchmarks.__main__"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_benchmarks_are_never_imported_by_the_package():
    offending = [
        imp
        for imp in _imports()
        if _in(imp.imported, "benchmarks") and not _in(imp.importer, "benchmarks")
    ]
    _check("benchmarks", offending)


def test_the_scheduler_never_imports_torch():
    direct = [
        imp
        for imp in _imports()
        if _in(imp.importer, "services.scheduler") and _in(imp.imported, "torch")
    ]
    _check("scheduler-torch", direct)


# Outside packages whose import loads torch.
TORCH_LOADERS = ("torch", "transformers", "safetensors.torch")


def _torch_path(start: str, top: dict[str, list[Import]]) -> str | None:
    """How importing `start` loads torch (following import-time imports), or None."""
    seen, todo, via = {start}, [start], {start: [start]}
    while todo:
        module = todo.pop()
        for imp in top.get(module, []):
            if _in(imp.imported, *TORCH_LOADERS):
                return f"{' -> '.join(via[module])}: {_where(imp)}"
            if imp.imported in _modules() and imp.imported not in seen:
                seen.add(imp.imported)
                via[imp.imported] = [*via[module], imp.imported]
                todo.append(imp.imported)
    return None


def test_importing_the_scheduler_or_common_loads_no_torch():
    """torch (and transformers) only inside the functions that need them: the scheduler
    imports services/common and still runs without torch."""
    top: dict[str, list[Import]] = {}
    for imp in _imports():
        if imp.top_level:
            top.setdefault(imp.importer, []).append(imp)
    starts = [m for m in _modules() if _in(m, "services.scheduler", "services.common")]
    paths = [path for start in starts if (path := _torch_path(start, top))]
    assert not paths, "imports that load torch:\n  " + "\n  ".join(paths)


# Who may touch the generated protobuf modules (services.common.proto.*.*_pb2[_grpc]):
# the proto package, the pb <-> domain conversion, the servicers (and the Generation
# servicer's message module and server), and the gRPC transport of each hop (the other
# end of the servicers: frontend -> engine core, engine core -> workers).
PB2_PACKAGES = ("services.common.proto", "services.common.convert")
PB2_MODULES = {
    "services.frontend.generation_pb",  # GenerateRequest/Response <-> the Frontend's terms
    "services.frontend.pooling_pb",  # EmbedRequest/Response <-> the Frontend's terms
    "services.frontend.frontend_server",  # registers the Generation servicer
    "services.frontend.grpc_engine_client",  # frontend -> engine core over EngineCore.Connect
    "services.scheduler.executor.worker_group",  # engine core -> a worker group
}


def _is_pb2(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return _in(module, "services.common.proto") and (
        last.endswith("_pb2") or last.endswith("_pb2_grpc")
    )


def _may_touch_pb2(module: str) -> bool:
    return (
        _in(module, *PB2_PACKAGES)
        or module in PB2_MODULES
        or module.rsplit(".", 1)[-1].endswith("_service")
    )


def test_only_the_grpc_edges_touch_pb2():
    offending = [
        imp
        for imp in _imports()
        if _is_pb2(imp.imported)
        and not _may_touch_pb2(imp.importer)
        and not _in(imp.importer, "benchmarks")  # a client of the public API, as a user is
    ]
    _check("pb2", offending)


def test_the_frontend_imports_neither_scheduler_nor_worker():
    offending = [
        imp
        for imp in _imports()
        if _in(imp.importer, "services.frontend")
        and _in(imp.imported, "services.scheduler", "services.worker")
    ]
    _check("frontend", offending)


def test_services_import_no_other_service_or_the_public_package():
    """services/<x> imports services/common and itself; nothing imports upwards."""
    offending = []
    for imp in _imports():
        if not _in(imp.importer, "services") or not _in(imp.imported, "services", "pagestream"):
            continue
        own = ".".join(imp.importer.split(".")[:2])
        if _in(imp.imported, "pagestream") or (
            not _in(imp.imported, "services.common", own) and imp.imported != "services"
        ):
            offending.append(imp)
    _check("services", offending)


def test_roles_start_the_worker_but_do_not_reach_into_it():
    offending = [
        imp
        for imp in _imports()
        if imp.importer == "pagestream.roles"
        and _in(imp.imported, "services.worker")
        and imp.imported != "services.worker.worker_service"
    ]
    _check("roles", offending)
