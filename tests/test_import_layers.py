"""The package's imports form no circle: every import of every module, those inside
functions too (a deferred import is still a dependency), read with `ast`.

Two graphs are checked. The module graph: one node per module (`gemmspec.x`,
`gemmspec.y.z`; a package's `__init__.py` is the node of the package itself). The
package-level graph: one node per top-level room of the package, a module
`gemmspec/x.py` or a package `gemmspec/y/` with everything below it; imports inside
one room are not edges there, so submodules of a package may import each other, as
long as the module graph stays free of cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gemmspec"
ROOT = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` (at `path`) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(target: str) -> str | None:
        # The longest known module that `target` names (a name imported from a module
        # is an attribute of it, unless it is a submodule).
        while target:
            if target in known:
                return target
            target = target.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = resolve(alias.name)
                if found:
                    out.add(found)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found = resolve(f"{module}.{alias.name}") if alias.name != "*" else None
                found = found or resolve(module)
                if found:
                    out.add(found)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imported(name, path, known) for name, path in modules.items()}


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = rooms.setdefault(_room(module), set())
        edges |= {_room(t) for t in targets if _room(t) != _room(module)}
    return rooms


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the list of its nodes, first repeated last; None if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_reader_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "gemmspec"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    import gemmspec.c\n")
    (pkg / "c.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import thing\nfrom .. import a\n")
    known = {"gemmspec", "gemmspec.a", "gemmspec.c", "gemmspec.sub", "gemmspec.sub.b"}
    assert _imported("gemmspec", pkg / "__init__.py", known) == {"gemmspec.a"}
    assert _imported("gemmspec.a", pkg / "a.py", known) == {"gemmspec.sub.b", "gemmspec.c"}
    assert _imported("gemmspec.sub", pkg / "sub" / "__init__.py", known) == {"gemmspec.sub.b"}
    assert _imported("gemmspec.sub.b", pkg / "sub" / "b.py", known) == {"gemmspec.c", "gemmspec.a"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_modules_import_each_other_without_a_cycle():
    graph = _graph()
    assert len(graph) > 10
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_rooms_of_the_package_import_each_other_without_a_cycle():
    rooms = _package_graph(_graph())
    cycle = _cycle(rooms)
    assert cycle is None, "import cycle between parts of the package: " + " -> ".join(cycle)
