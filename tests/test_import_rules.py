"""Who may import whom: the package layout's rules, checked on the source with `ast`.

Every import counts, at module level and inside functions (a function-level import is
still a dependency; it only hides a cycle from the interpreter). Imports under
``if TYPE_CHECKING:`` do not: they are annotations, never executed.

Layers, lowest first; a layer imports only itself and the layers its `LAYERS` entry names:

    kernels < workers < base (errors, config, event_loop, _proto, control.eviction,
            prefix_keys) < control < wire
            < client, obs < engine < api < integrations < cli

(the integrations also import `workers`: a co-located model runs its leased steps on the
worker's pool with the pool's kernels, `workers.lease_client`)

- `control` is pure: `cache_service.errors` and `cache_service.prefix_keys` only, and no torch, Triton, Ray, gRPC or numpy;
- `kernels` and `workers` never import `cache_service`; `kernels` never imports `workers`;
- the client imports only `wire`, the proto, `cache_service.errors` and `prefix_keys`, and nothing it loads (transitively) is the
  engine, the API, metrics or `workers`: a model executor's process loads none of them;
- nothing imports `cache_service.cli` or the integrations but themselves;
- the engine imports no gRPC: it raises domain errors, the API maps them to statuses;
- only the server imports the coordinator itself; the decoders build its values
  (`engine.values`);
- no import cycles between modules.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache_service", "workers", "kernels")

# Modules that belong to a layer other than their package prefix says.
MODULE_LAYERS = {
    "cache_service": "base",
    "cache_service.errors": "base",
    "cache_service.config": "base",
    "cache_service.event_loop": "base",
    "cache_service._proto": "base",
    "cache_service.health_probe": "cli",  # `python -m cache_service.health_probe`
    # The eviction policies import nothing of cache_service, so the config can check a
    # policy name when it loads.
    "cache_service.control.eviction": "base",
    # The prefix key encoding, shared by the control plane and the client's block_hashes.
    "cache_service.prefix_keys": "base",
}
PACKAGE_LAYERS = {
    "kernels": "kernels",
    "workers": "workers",
    "cache_service.control": "control",
    "cache_service.wire": "wire",
    "cache_service.client": "client",
    "cache_service.obs": "obs",
    "cache_service.engine": "engine",
    "cache_service.api": "api",
    "cache_service.integrations": "integrations",
    "cache_service.cli": "cli",
}
# layer -> what it may import besides itself: layer names, or single modules.
LAYERS: dict[str, set[str]] = {
    "kernels": set(),
    "workers": {"kernels"},
    "base": {"workers"},
    "control": {
        "cache_service.errors",
        "cache_service.control.eviction",
        "cache_service.prefix_keys",
    },
    "wire": {"base", "workers"},
    # cache_service.errors imports nothing: the client reads the server's deadline verdict
    # text from it.
    "client": {"cache_service._proto", "cache_service.errors", "cache_service.prefix_keys", "wire"},
    "obs": {"base", "control", "wire"},
    "engine": {"base", "control", "wire", "workers"},
    "api": {"base", "control", "wire", "obs", "engine", "workers"},
    # A co-located model maps the worker's pool and runs leased steps with its kernels.
    "integrations": {"base", "client", "api", "workers"},
    "cli": {"base", "control", "wire", "client", "obs", "engine", "api", "workers"},
}
# layer -> third-party top-level packages it must not import.
FORBIDDEN_EXTERNAL = {
    "control": {"torch", "triton", "ray", "grpc", "google", "numpy"},
    "kernels": {"ray", "grpc", "google"},
    "workers": {"grpc", "google"},
    "client": {"ray"},
    "engine": {"grpc", "google"},
}
# module -> the only modules that may import it.
ONLY_FROM = {"cache_service.engine.coordinator": {"cache_service.api.service"}}
# layer -> layers that nothing it imports, however indirectly, may belong to.
FORBIDDEN_TRANSITIVE = {
    "client": {"workers", "kernels", "control", "obs", "engine", "api", "cli", "integrations"},
}


# ---------------------------------------------------------------------------- the checker


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under each package."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if "_proto" in parts:  # generated stubs: one node
                parts = parts[: parts.index("_proto") + 1]
            elif parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), path)
    return found


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _import_nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> tuple[set[str], set[str]]:
    """(project modules, third-party top-level packages) that module `name` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    internal: set[str] = set()
    external: set[str] = set()
    roots = {m.split(".")[0] for m in modules}
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names]
        for target in targets:
            if target.split(".")[0] in roots:
                found = resolve(target)
                if found and found != name:
                    internal.add(found)
            else:
                external.add(target.split(".")[0])
    return internal, external


def layer_of(module: str, module_layers: Mapping[str, str], package_layers: Mapping[str, str]):
    """The layer of `module`: its own entry, else its longest package prefix's."""
    if module in module_layers:
        return module_layers[module]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        layer = package_layers.get(".".join(parts[:i]))
        if layer is not None:
            return layer
    raise KeyError(f"module {module} belongs to no layer: add it to the import rules")


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def violations(
    root: Path,
    packages: Iterable[str],
    module_layers: Mapping[str, str],
    package_layers: Mapping[str, str],
    layers: Mapping[str, set[str]],
    forbidden_external: Mapping[str, set[str]],
    forbidden_transitive: Mapping[str, set[str]],
    only_from: Mapping[str, set[str]] | None = None,
) -> list[str]:
    """Every broken rule, one line each (empty when the tree keeps them all)."""
    modules = find_modules(root, packages)
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    layer = {m: layer_of(m, module_layers, package_layers) for m in modules}
    reserved = only_from or {}
    for name, path in modules.items():
        internal, external = imports_of(name, path, modules)
        graph[name] = internal
        allowed = layers[layer[name]]
        for target in sorted(internal):
            ok = layer[target] == layer[name] or layer[target] in allowed or target in allowed
            if not ok:
                problems.append(f"{name} ({layer[name]}) imports {target} ({layer[target]})")
            readers = reserved.get(target)
            if readers is not None and name not in readers:
                problems.append(f"{name} imports {target}, reserved to {sorted(readers)}")
        for pkg in sorted(external & forbidden_external.get(layer[name], set())):
            problems.append(f"{name} ({layer[name]}) imports {pkg}")
    for component in cycles(graph):
        problems.append("import cycle: " + " -> ".join(component))
    for name in sorted(modules):
        banned = forbidden_transitive.get(layer[name])
        if not banned:
            continue
        seen, todo = {name}, [name]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        for target in sorted(t for t in seen if layer[t] in banned):
            problems.append(f"{name} ({layer[name]}) loads {target} ({layer[target]})")
    return problems


def _layer_order_is_acyclic(layers: Mapping[str, set[str]], package_layers) -> bool:
    graph = {
        name: {t if t in layers else layer_of(t, MODULE_LAYERS, package_layers) for t in allowed}
        - {name}
        for name, allowed in layers.items()
    }
    return not cycles(graph)


# ---------------------------------------------------------------------------- the tests


def test_the_project_keeps_its_import_rules() -> None:
    problems = violations(
        ROOT,
        PACKAGES,
        MODULE_LAYERS,
        PACKAGE_LAYERS,
        LAYERS,
        FORBIDDEN_EXTERNAL,
        FORBIDDEN_TRANSITIVE,
        ONLY_FROM,
    )
    assert problems == []


def test_the_rules_only_point_down() -> None:
    # The allowed imports between layers form an order: no two layers may import each other.
    assert _layer_order_is_acyclic(LAYERS, PACKAGE_LAYERS)
    modules = find_modules(ROOT, PACKAGES)
    # The checker saw the real tree (it can fail): every layer has modules.
    seen = {layer_of(m, MODULE_LAYERS, PACKAGE_LAYERS) for m in modules}
    assert seen == set(LAYERS)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


_TOY_PACKAGES = {"pkg": "low", "pkg.high": "high", "pkg.low": "low"}
_TOY_LAYERS = {"low": set(), "high": {"low"}}
_TOY_CLEAN = {
    "pkg/__init__.py": "",
    "pkg/low/__init__.py": "",
    "pkg/low/a.py": "import json\n\nVALUE = 1\n",
    "pkg/low/b.py": "from pkg.low.a import VALUE\n",
    "pkg/high/__init__.py": "",
    "pkg/high/c.py": """\
        from typing import TYPE_CHECKING

        from pkg.low import b

        if TYPE_CHECKING:
            from pkg.high.d import Thing


        def use() -> int:
            from pkg.high import d

            return d.THING
    """,
    "pkg/high/d.py": "import pkg.low.a as a\n\nTHING = a.VALUE\n",
}


def _toy_problems(root: Path, forbidden_external=None) -> list[str]:
    return violations(root, ("pkg",), {}, _TOY_PACKAGES, _TOY_LAYERS, forbidden_external or {}, {})


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    _write(tmp_path, _TOY_CLEAN)
    assert _toy_problems(tmp_path) == []


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        # an upward import at module level
        (
            "pkg/low/e.py",
            "from pkg.high.d import THING\n",
            "pkg.low.e (low) imports pkg.high.d (high)",
        ),
        # an upward import hidden in a function
        (
            "pkg/low/e.py",
            "def f():\n    import pkg.high.c\n",
            "pkg.low.e (low) imports pkg.high.c (high)",
        ),
        # a relative import is resolved like an absolute one
        ("pkg/low/e.py", "from ..high import c\n", "pkg.low.e (low) imports pkg.high.c (high)"),
    ],
)
def test_checker_catches_an_upward_import(
    tmp_path: Path, rel: str, text: str, expected: str
) -> None:
    _write(tmp_path, {**_TOY_CLEAN, rel: text})
    assert _toy_problems(tmp_path) == [expected]


def test_checker_catches_a_cycle_behind_a_function_level_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {**_TOY_CLEAN, "pkg/high/d.py": "def f():\n    from pkg.high.c import use\n"},
    )
    assert _toy_problems(tmp_path) == ["import cycle: pkg.high.c -> pkg.high.d"]


def test_checker_catches_a_forbidden_framework(tmp_path: Path) -> None:
    _write(tmp_path, _TOY_CLEAN)
    assert _toy_problems(tmp_path, {"low": {"json"}}) == ["pkg.low.a (low) imports json"]


def test_checker_catches_a_reserved_module_imported_elsewhere(tmp_path: Path) -> None:
    _write(tmp_path, _TOY_CLEAN)
    problems = violations(
        tmp_path, ("pkg",), {}, _TOY_PACKAGES, _TOY_LAYERS, {}, {}, {"pkg.low.a": {"pkg.low.b"}}
    )
    assert problems == ["pkg.high.d imports pkg.low.a, reserved to ['pkg.low.b']"]
