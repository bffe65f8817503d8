"""The project's module import graph is acyclic (imports for the type checker included), only the
launch site imports actors, no module is over MAX_MODULE_LINES lines, and the wheel ships no test
double and nothing that imports one."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable

from setuptools.config.pyprojecttoml import read_configuration

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("raytrec", "actors", "jobs", "simulation")
#: Top-level packages of the checkout that the wheel must not ship nor import.
CHECKOUT_ONLY = ("simulation", "benchmarks", "tests")


#: The most lines a module of the library may have: a longer one holds two ideas.
MAX_MODULE_LINES = 650
#: Modules allowed over the limit for now, each being split elsewhere.
LONG_MODULES: dict[str, str] = {}


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, *, type_only_too: bool = False) -> set[str]:
    """The modules ``path`` imports, absolute names; ``from pkg import x`` gives ``pkg`` and
    ``pkg.x`` (the submodule when there is one). ``type_only_too``: with the imports under
    ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
        if not type_only_too
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return names


def import_graph(root: pathlib.Path = ROOT, *, type_only_too: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports. Imports under ``if TYPE_CHECKING:`` count
    unless ``type_only_too`` is False: they never run, but a type on the wrong side of a
    circle still ties the two modules together (neither can be understood, moved or shipped
    without the other)."""
    files = {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    return {
        mod: {t for t in imports_of(path, type_only_too=type_only_too) if t in files and t != mod}
        for mod, path in files.items()
    }


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


def test_a_circle_through_type_only_imports_is_a_cycle(tmp_path: pathlib.Path) -> None:
    (tmp_path / "raytrec").mkdir()
    (tmp_path / "raytrec" / "a.py").write_text("from raytrec.b import B\n")
    (tmp_path / "raytrec" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from raytrec import a\n"
    )
    assert find_cycle(import_graph(tmp_path)) == ["raytrec.a", "raytrec.b", "raytrec.a"]
    assert find_cycle(import_graph(tmp_path, type_only_too=False)) is None


def test_import_graph_is_acyclic() -> None:
    graph = import_graph()
    assert {"raytrec.api", "raytrec.engine.rank_engine", "actors.coordinator", "jobs.train"} <= set(
        graph
    )
    assert find_cycle(graph) is None


def test_only_the_api_imports_actors() -> None:
    graph = import_graph(type_only_too=False)
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
    graph = import_graph()
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


def shipped_modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Module -> its file, for every module the wheel ships: the packages setuptools finds with
    pyproject.toml's ``[tool.setuptools.packages.find]``, as a build does."""
    config = read_configuration(root / "pyproject.toml", expand=True)
    packages = config["tool"]["setuptools"]["packages"]
    return {
        module_name(p, root): p
        for pkg in packages
        for p in (root / pkg.replace(".", "/")).glob("*.py")
    }


def test_the_wheel_ships_no_test_double() -> None:
    shipped = shipped_modules()
    assert {"raytrec.api", "actors.rank", "jobs.train", "raytrec.testing.ray_cluster"} <= set(
        shipped
    )
    doubles = sorted(
        m
        for m in shipped
        if m.split(".")[0] in CHECKOUT_ONLY
        or any(part.startswith("fake_") or part == "doubles" for part in m.split("."))
    )
    assert doubles == []
    # Nor anything that needs one: no shipped module imports a checkout-only package, not even
    # for type checking.
    needs = {
        m: sorted(t for t in imports_of(p, type_only_too=True) if t.split(".")[0] in CHECKOUT_ONLY)
        for m, p in shipped.items()
    }
    assert {m: n for m, n in needs.items() if n} == {}
    assert "simulation.doubles.fake_group" in import_graph()["simulation.fault_space"]
