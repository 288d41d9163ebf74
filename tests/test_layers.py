"""The package's layers are layers: read from the source's imports, no sub-package
imports one above it, no modules import each other in a circle, and no private name
(`_name`) is reached across sub-packages. The order is the one `docs/index.md`
states."""

import ast
import pathlib
import re
from dataclasses import dataclass

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "quax_tangents"

# Bottom first. A sub-package may import those before it in this list, never those
# after it; those on one row may not import each other. `docs/index.md` states this.
LAYERS = [
    ("_core",),
    ("_types",),
    ("_differentiable", "_distributed", "_marks"),
    ("_autodiff",),
    ("optax",),
    ("<top>",),  # quax_tangents/__init__.py and any module directly in the package
]


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted
    names: tuple[str, ...]  # the names taken from it (empty for `import x`)
    line: int


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _imports_of(path: pathlib.Path) -> list[Import]:
    module = _module_name(path)
    here = module.split(".") if _is_package(path) else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(alias.name for alias in node.names)
            found.append(Import(module, target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, (), node.lineno))
    return [i for i in found if i.target.split(".")[0] == "quax_tangents"]


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = [i for p in MODULES.values() for i in _imports_of(p)]


def _resolved(imp: Import) -> list[str]:
    """The package modules an import reads: `from pkg import mod` reads `pkg.mod`."""
    modules = [imp.target] if imp.target in MODULES else []
    modules += [
        f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in MODULES
    ]
    return modules or [imp.target]


def _sub_package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or f"quax_tangents.{parts[1]}" not in MODULES:
        return "<top>"
    if not _is_package(MODULES[f"quax_tangents.{parts[1]}"]):
        return "<top>"
    return parts[1]


def _level(sub_package: str) -> int:
    for level, row in enumerate(LAYERS):
        if sub_package in row:
            return level
    raise AssertionError(
        f"sub-package {sub_package} has no place in LAYERS: add it here and to "
        "docs/index.md"
    )


def test_every_sub_package_has_a_layer():
    for module in MODULES:
        _level(_sub_package(module))


def test_no_sub_package_imports_one_above_it_or_beside_it():
    back_edges = []
    for imp in IMPORTS:
        source = _sub_package(imp.module)
        for target in _resolved(imp):
            destination = _sub_package(target)
            if source != destination and _level(destination) >= _level(source):
                back_edges.append(f"{imp.module}:{imp.line} imports {target}")
    assert not back_edges, "imports against the layers:\n" + "\n".join(back_edges)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_modules_import_each_other_in_a_circle():
    # A package's `__init__` re-exporting its modules is not an edge back to it:
    # importing `pkg.mod` runs `pkg/__init__.py` first by Python's rules anyway.
    graph: dict[str, set[str]] = {}
    for imp in IMPORTS:
        for target in _resolved(imp):
            if target != imp.module and not imp.module.startswith(target + "."):
                graph.setdefault(imp.module, set()).add(target)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_names_across(imp: Import) -> list[str]:
    source = _sub_package(imp.module)
    return [
        name
        for name in imp.names
        if name.startswith("_")
        and f"{imp.target}.{name}" not in MODULES  # a private module is fine
        and _sub_package(imp.target) != source
    ]


def _private_attributes_across() -> list[str]:
    """`module._name` where `module` was imported from another sub-package."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        foreign = {}
        for imp in _imports_of(path):
            if _sub_package(imp.target) == _sub_package(module):
                continue
            for name in imp.names:
                if f"{imp.target}.{name}" in MODULES:
                    foreign[name] = f"{imp.target}.{name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in foreign
                and node.attr.startswith("_")
            ):
                found.append(
                    f"{module}:{node.lineno} reads {foreign[node.value.id]}.{node.attr}"
                )
    return found


def test_no_private_name_is_reached_across_sub_packages():
    reached = [
        f"{imp.module}:{imp.line} imports {name} from {imp.target}"
        for imp in IMPORTS
        for name in _private_names_across(imp)
    ]
    reached += _private_attributes_across()
    assert not reached, "\n".join(reached)


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_no_module_is_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= 600, f"{module} has {lines} lines; split it by what it does"


def test_the_docs_state_the_same_order():
    text = (PACKAGE.parent / "docs" / "index.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `quax_tangents/(\w+)/` \|", text, re.MULTILINE)
    stated = {name: int(level) for level, name in rows}
    assert stated, "docs/index.md has no layer table"
    assert stated == {
        name: level + 1 for level, row in enumerate(LAYERS[:-1]) for name in row
    }
