"""The pretrain_bench package has no import cycles, and every module of it imports on its own.

The graph is read from the source with ast: an edge for every import of a package module (`from . import x`,
`from .x import y`, `from pretrain_bench.x import y`, `import pretrain_bench.x`) that runs when the module is imported:
at module level, in class bodies and under module-level if/try/with, not inside functions (a deferred import runs
when the function is first called, after every module has finished importing)."""
import ast
import subprocess
import sys
from pathlib import Path

import pretrain_bench

PACKAGE_DIR = Path(pretrain_bench.__file__).parent
PACKAGE = "pretrain_bench"


def import_time_nodes(node: ast.AST):
    """The nodes of `node` that run when the module is imported: everything but function bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield child
        yield from import_time_nodes(child)


def package_imports(source: str, modules: set[str]) -> set[str]:
    """The package modules one module's source imports at import time."""
    found = set()
    for node in import_time_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import x, y
                found |= {alias.name for alias in node.names if alias.name in modules}
            elif node.level == 1:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
                parts = node.module.split(".")
                if len(parts) > 1:  # from pretrain_bench.x import y
                    found.add(parts[1])
                else:  # from pretrain_bench import x
                    found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names
                      if alias.name.startswith(PACKAGE + ".")}
    return found & modules


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module name → the package modules it imports, for every .py file of the package (not __init__)."""
    files = {path.stem: path for path in package_dir.glob("*.py") if path.stem != "__init__"}
    modules = set(files)
    return {name: package_imports(path.read_text(), modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, …, a], or None: a depth-first search that meets a module still on its path."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every import below it is checked
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert {"checkpoint", "checkpointer", "engines", "rank", "trainer"} <= set(graph), "the package was read"
    assert "engines" in graph["checkpointer"] and "checkpoint" in graph["engines"], "imports were read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_a_constructed_cycle_is_found(tmp_path):
    """The check fails where there is a cycle (each spelling of a package import); a deferred import is no edge."""
    (tmp_path / "low.py").write_text("try:\n    from .top import g\nexcept ImportError:\n    g = None\n")
    (tmp_path / "middle.py").write_text("from . import low\n")
    (tmp_path / "top.py").write_text("from pretrain_bench.middle import low\n\nclass G:\n"
                                     "    import pretrain_bench.alone\n")
    (tmp_path / "alone.py").write_text("import os\n\ndef f():\n    from .top import G\n    return G\n")
    graph = import_graph(tmp_path)
    assert graph == {"low": {"top"}, "middle": {"low"}, "top": {"middle", "alone"}, "alone": set()}
    assert find_cycle(graph) == ["low", "top", "middle", "low"]
    (tmp_path / "low.py").write_text("def f():\n    from .top import g\n    return g\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_every_module_imports_in_a_fresh_interpreter():
    """Every module of the package, imported one after the other in a new interpreter (no test's imports before)."""
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module('pretrain_bench.' + name)\n"
    proc = subprocess.run([sys.executable, "-c", script, *sorted(import_graph(PACKAGE_DIR))], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
