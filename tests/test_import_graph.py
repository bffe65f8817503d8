"""The project's module import graph is acyclic, only the launch site imports actors, and no module
is over MAX_MODULE_LINES lines."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("raytrec", "actors", "jobs", "simulation")


#: The most lines a module of the library may have: a longer one holds two ideas.
MAX_MODULE_LINES = 650
#: Modules allowed over the limit for now, each being split elsewhere.
LONG_MODULES: dict[str, str] = {}


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(*, type_only_too: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports; ``type_only_too``: with the imports under
    ``if TYPE_CHECKING:`` (by default left out: they never run)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        # Imports under "if TYPE_CHECKING:" are for the type checker only and never run: they
        # make no cycle, but a component naming the coordinator it belongs to still holds it.
        type_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for stmt in block.body
            for n in ast.walk(stmt)
            if not type_only_too
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from pkg import sub" imports the submodule when there is one.
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_detects_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_is_acyclic() -> None:
    graph = import_graph()
    assert {"raytrec.api", "raytrec.engine.rank_engine", "actors.coordinator", "jobs.train"} <= set(
        graph
    )
    assert find_cycle(graph) is None


def test_only_the_api_imports_actors() -> None:
    graph = import_graph()
    importers = sorted(
        m
        for m, deps in graph.items()
        if m.startswith("raytrec") and any(d.startswith("actors") for d in deps)
    )
    assert importers == ["raytrec.api"]


def test_no_component_holds_the_coordinator() -> None:
    """The parts of the job see it through narrow ports (actors/ports.py), not the coordinator:
    no module of actors/ imports it, not even for type checking (the fault-space harness, which
    builds one and reads its state, is simulation/)."""
    graph = import_graph(type_only_too=True)
    holders = {
        m
        for m, deps in graph.items()
        if m.startswith("actors.") and m != "actors.coordinator" and "actors.coordinator" in deps
    }
    assert holders == set()
    assert "actors.coordinator" in graph["simulation.fault_space"]


def modules_over(root: pathlib.Path, limit: int, allowed: Iterable[str] = ()) -> dict[str, int]:
    """Module -> its lines, for each module of PACKAGES under ``root`` over ``limit`` lines
    that is not ``allowed``."""
    lines = {
        module_name(p, root): len(p.read_text().splitlines())
        for pkg in PACKAGES
        for p in (root / pkg).rglob("*.py")
    }
    return {m: n for m, n in sorted(lines.items()) if n > limit and m not in set(allowed)}


def test_modules_over_names_a_module_over_the_limit(tmp_path: pathlib.Path) -> None:
    (tmp_path / "raytrec" / "data").mkdir(parents=True)
    (tmp_path / "actors").mkdir()
    (tmp_path / "raytrec" / "data" / "long.py").write_text("x = 1\n" * 11)
    (tmp_path / "raytrec" / "short.py").write_text("x = 1\n" * 10)
    (tmp_path / "actors" / "allowed.py").write_text("x = 1\n" * 12)
    assert modules_over(tmp_path, 10, ["actors.allowed"]) == {"raytrec.data.long": 11}
    assert modules_over(tmp_path, 10) == {"actors.allowed": 12, "raytrec.data.long": 11}
    assert modules_over(tmp_path, 12) == {}


def test_no_module_is_over_the_limit() -> None:
    assert set(LONG_MODULES) <= set(import_graph()), "an allowed module is gone: drop it"
    assert modules_over(ROOT, MAX_MODULE_LINES, LONG_MODULES) == {}
