"""Dependencies point one way: no import circle among specbatch's modules, and no package imports a package
above it in LAYERS. Imports are read from the source with `ast` (function-level ones included: a lazy import
is a dependency too), so nothing is imported and torch is not needed."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "specbatch"
# Top to bottom: a package may import the packages below it, never one above it or beside it on its row.
# `data` holds the demo pair's build scripts; the root `specbatch` module is only the version.
LAYERS = (("cli",), ("console",), ("serve",), ("bench",), ("calibrate", "data"), ("runtime",), ("perfmodel",))
SKIPPED = {"tests", "benchmarks", "docs", ".venv", "build", "dist"}  # not part of the installed package


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's name maps to its __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SKIPPED or any(part.startswith(".") or part.endswith(".egg-info") for part in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((PACKAGE, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (relative imports resolved; `from X import Y`
    counts X.Y when that is a module, else X)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name and target.split(".")[0] == PACKAGE:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            following = next(stack[-1], None)
            if following is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(following) == 1:
                return path[path.index(following):] + [following]
            elif not state.get(following):
                state[following] = 1
                path.append(following)
                stack.append(iter(sorted(graph.get(following, ()))))
    return None


def stage(module: str) -> str:
    """The package a module belongs to: `specbatch.bench.plan` -> `bench`; the root module is ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package above the importer or beside it on its row in LAYERS (the root module, the
    version only, may be imported by any package but perfmodel)."""
    rank = {name: row for row, names in enumerate(LAYERS) for name in names}
    wrong = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            high, low = stage(importer), stage(target)
            if high == low or (low == "" and high != "perfmodel"):
                continue
            if high not in rank or low not in rank or rank[low] <= rank[high]:
                wrong.append(f"{importer} imports {target}")
    return wrong


def test_the_graph_reader_finds_circles_and_upward_imports():
    circle = {"specbatch.bench.a": {"specbatch.bench.b"}, "specbatch.bench.b": {"specbatch.bench.c"},
              "specbatch.bench.c": {"specbatch.bench.a"}, "specbatch.bench.d": {"specbatch.bench.a"}}
    assert find_cycle(circle) == ["specbatch.bench.a", "specbatch.bench.b", "specbatch.bench.c", "specbatch.bench.a"]
    assert find_cycle({"specbatch.bench.a": {"specbatch.bench.b"}, "specbatch.bench.b": set()}) is None
    upward = {"specbatch.bench.vllm.compare": {"specbatch.console.options", "specbatch.runtime.model"},
              "specbatch.perfmodel.table": {"specbatch"}, "specbatch.runtime.model": {"specbatch.perfmodel.table"}}
    assert layer_violations(upward) == ["specbatch.bench.vllm.compare imports specbatch.console.options",
                                        "specbatch.perfmodel.table imports specbatch"]


def test_the_reader_resolves_relative_and_lazy_imports(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "harness.py").write_text("from . import plan\nfrom .plan import balanced_order\n")
    (tmp_path / "bench" / "plan.py").write_text("def f():\n    from .harness import run_bench\n"
                                                "    import specbatch.runtime.model\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "model.py").write_text("from ..bench.plan import f\n")
    graph = import_graph(tmp_path)
    assert graph["specbatch.bench.harness"] == {"specbatch.bench.plan"}
    assert graph["specbatch.bench.plan"] == {"specbatch.bench.harness", "specbatch.runtime.model"}
    assert find_cycle(graph) is not None
    assert layer_violations(graph) == ["specbatch.runtime.model imports specbatch.bench.plan"]


def test_the_package_is_read_whole():
    graph = import_graph()
    assert {"specbatch.cli", "specbatch.bench.harness", "specbatch.perfmodel.table", "specbatch.runtime.generator",
            "specbatch.console.bench"} <= set(graph)
    assert {stage(name) for name in graph} - {""} <= {name for names in LAYERS for name in names}
    assert "specbatch.bench.plan" in graph["specbatch.bench.harness"]  # imports are really read


def test_no_import_circle_among_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_package_imports_a_package_above_it():
    assert layer_violations(import_graph()) == []


def test_perfmodel_imports_only_perfmodel():
    graph = import_graph()
    outside = sorted(f"{name} imports {target}" for name, targets in graph.items() if stage(name) == "perfmodel"
                     for target in targets if stage(target) != "perfmodel")
    assert outside == []
