"""The module structure: no import cycle inside a package or across the tree, each package imports
only the packages its layer allows (:data:`LAYERS`), and the coordinator, ftctl and the core import no
torch, not even through another module.

A cycle hidden behind ``if TYPE_CHECKING:`` or a function-local import is still a cycle of the design
(two modules that cannot be understood, tested or changed apart), so every import statement counts,
wherever it sits. The graph is built from the source with :mod:`ast`, never by importing it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "agent", "training", "storage_backends", "checkpoints", "ftctl")
# Cycles that are other changes' to break (issue 8): reported, not yet enforced.
KNOWN_CYCLES: Mapping[str, str] = {}

# Every package of the tree (import name -> folder); "ftd" is the core: the modules of ftd/ itself
# (the client library, rpc, pki, settings, logs...), "ftd.v1" the generated wire format.
FOLDERS: Mapping[str, Path] = {
    "ftd": ROOT / "ftd", "ftd.v1": ROOT / "ftd" / "v1",
    **{f"ftd.{p}": ROOT / p for p in (*PACKAGES, "netlab")},
}
# Which packages each package may import (itself aside). The layers, bottom up: the wire format; the
# core; storage and the checkpoint layout (the data plane's parts); the programs: the coordinator, the
# agent, the training side, ftctl, none of which imports another. Exceptions, with why:
# * ftd.checkpoints -> ftd.v1: checkpoints/catalog.py converts its records to and from the catalog's
#   messages (CheckpointInfo), the one translation the coordinator and its clients share.
# * ftd.storage_backends <-> ftd.checkpoints: the layout checks its files with storage's CRC32C, and the
#   memory tier (storage_backends/memory.py) keeps shards by the layout's prefixes.
LAYERS: Mapping[str, frozenset[str]] = {
    "ftd.v1": frozenset(),
    "ftd": frozenset({"ftd.v1"}),
    "ftd.netlab": frozenset(),
    "ftd.storage_backends": frozenset({"ftd.checkpoints"}),
    "ftd.checkpoints": frozenset({"ftd.v1", "ftd.storage_backends"}),
    "ftd.coordinator": frozenset({"ftd", "ftd.v1", "ftd.checkpoints"}),
    "ftd.agent": frozenset({"ftd", "ftd.v1", "ftd.checkpoints", "ftd.storage_backends"}),
    "ftd.training": frozenset({"ftd", "ftd.v1", "ftd.checkpoints", "ftd.storage_backends"}),
    "ftd.ftctl": frozenset({"ftd", "ftd.v1", "ftd.checkpoints", "ftd.storage_backends", "ftd.netlab"}),
}
# Packages whose modules must not load torch, directly or through any module of the tree they import.
NO_TORCH = ("ftd", "ftd.coordinator", "ftd.ftctl")


def module_names(folder: Path, package: str) -> dict[str, Path]:
    """Dotted name (``ftd.coordinator.control``) -> file, for every module of the package."""
    names = {}
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement may load: the module itself and, for ``from X import y``,
    ``X.y`` (``y`` may be a submodule)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    yield base
    for alias in node.names:
        yield f"{base}.{alias.name}"


def imports_of(path: Path, module: str) -> set[str]:
    """Every dotted name the module's import statements may load, anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(imported(node, module, path.name == "__init__.py"))
    return names


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (anywhere in its source)."""
    modules = module_names(folder, package)
    return {name: {t for t in imports_of(path, name) if t in modules and t != name} for name, path in modules.items()}


def tree_modules() -> dict[str, Path]:
    """Every module of the tree, by its import name."""
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        modules.update((n, p) for n, p in module_names(folder, package).items() if package_of(n) == package)
    return modules


def package_of(module: str) -> str:
    """The package of :data:`FOLDERS` a module belongs to: the longest prefix."""
    return max((p for p in FOLDERS if module == p or module.startswith(p + ".")), key=len)


@functools.cache
def tree_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the modules of the tree it imports, module -> the other top-level names it imports)."""
    modules = tree_modules()
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = imports_of(path, name)
        inside[name] = {t for t in names if t in modules and t != name}
        outside[name] = {t.split(".")[0] for t in names if t.split(".")[0] != "ftd"}
    return inside, outside


def layering_violations(graph: Mapping[str, set[str]], layers: Mapping[str, frozenset[str]]) -> dict[
        tuple[str, str], list[str]]:
    """(importing package, imported package) -> "module -> module" for every import the table forbids."""
    found: dict[tuple[str, str], list[str]] = {}
    for module, targets in sorted(graph.items()):
        mine = package_of(module)
        for target in sorted(targets):
            theirs = package_of(target)
            if theirs != mine and theirs not in layers[mine]:
                found.setdefault((mine, theirs), []).append(f"{module} -> {target}")
    return found


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first == last), or ``None`` when the graph is acyclic."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                return [*path[path.index(nxt):], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_type_checking_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("def f():\n    import ftd.pkg.a\n")
    assert set(module_names(pkg, "ftd.pkg")) == {"ftd.pkg", "ftd.pkg.a", "ftd.pkg.b", "ftd.pkg.c"}
    graph = import_graph(pkg, "ftd.pkg")
    assert graph["ftd.pkg.a"] == {"ftd.pkg.b"} and graph["ftd.pkg.b"] == {"ftd.pkg", "ftd.pkg.c"}
    assert find_cycle(graph) == ["ftd.pkg.a", "ftd.pkg.b", "ftd.pkg.c", "ftd.pkg.a"]
    graph["ftd.pkg.c"] = set()
    assert find_cycle(graph) is None


@pytest.mark.parametrize("package", [
    pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN_CYCLES[p], strict=False)) if p in KNOWN_CYCLES else p
    for p in PACKAGES
])
def test_no_import_cycle_within_a_package(package: str) -> None:
    cycle = find_cycle(import_graph(ROOT / package, f"ftd.{package}"))
    assert cycle is None, f"import cycle in {package}/: {' -> '.join(cycle)}"


def test_the_tree_graph_knows_every_package_and_its_own_modules() -> None:
    modules = tree_modules()
    assert package_of("ftd.client") == "ftd" and package_of("ftd.v1.cluster_pb2") == "ftd.v1"
    assert package_of("ftd.agent.daemon") == "ftd.agent" and "ftd.coordinator.buddies" in modules
    assert {package_of(m) for m in modules} == set(FOLDERS) == set(LAYERS)
    graph = {"ftd.agent.a": {"ftd.coordinator.b", "ftd.checkpoints.c"}, "ftd.coordinator.b": set(),
             "ftd.checkpoints.c": set()}
    assert layering_violations(graph, LAYERS) == {("ftd.agent", "ftd.coordinator"): [
        "ftd.agent.a -> ftd.coordinator.b"]}


def test_no_import_cycle_across_the_tree() -> None:
    cycle = find_cycle(tree_graph()[0])
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_package_imports_only_what_its_layer_allows(package: str) -> None:
    found = {pair: where for pair, where in layering_violations(tree_graph()[0], LAYERS).items() if pair[0] == package}
    assert not found, "\n".join(f"{a} may not import {b}: {', '.join(w)}" for (a, b), w in found.items())


@pytest.mark.parametrize("package", NO_TORCH)
def test_the_coordinator_ftctl_and_the_core_do_not_import_torch(package: str) -> None:
    inside, outside = tree_graph()
    start = [m for m in inside if package_of(m) == package]
    reached: dict[str, str] = {m: m for m in start}  # module -> the chain that reached it
    todo = list(start)
    while todo:
        module = todo.pop()
        for nxt in inside[module]:
            if nxt not in reached:
                reached[nxt] = f"{reached[module]} -> {nxt}"
                todo.append(nxt)
    loading = sorted(chain for m, chain in reached.items() if "torch" in outside[m])
    assert not loading, f"{package} loads torch through: {'; '.join(loading)}"


MAX_MODULE_LINES = 600
# Folders of the tree whose .py files count as modules here (generated gRPC code under ftd/v1 does not).
SOURCE_FOLDERS = (*PACKAGES, "ftd", "netlab", "tests", "chaos_tests", "bench", "protos", "examples")


def test_no_module_is_over_600_lines() -> None:
    """A module a reader cannot hold in their head is several modules sharing a file: split it along its
    seams (the issue-17 renovation did: the Checkpointer, preemption, the PKI, health checks)."""
    too_long = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            lines = path.read_text().count("\n")
            if lines > MAX_MODULE_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
