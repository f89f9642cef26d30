"""The pretrain_bench package is layered by pipeline stage, with no import cycles and no import that runs upward,
and every module of it imports on its own.

The graph is read from the source with ast: an edge for every import of a package module (`from . import x`,
`from .x import y`, `from pretrain_bench.x import y`, `import pretrain_bench.x`), wherever it stands: at module level,
in class bodies, under if/try/with, and inside functions (a deferred import is still a dependency: it only runs
later)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pretrain_bench

PACKAGE_DIR = Path(pretrain_bench.__file__).parent
PACKAGE = "pretrain_bench"
# The layers, lowest first: a module may import from its own layer and the layers below it, never from one above.
# This is the one place the order is written down (docs/contributing.md points here).
LAYERS = ("core", "config", "data", "train", "evaluate", "bench", "report", "workflow")
# A folder of the package holds at most this many modules: past it, a reader can no longer hold it in their head.
MAX_MODULES_PER_FOLDER = 16


def package_imports(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules (dotted names below the package, e.g. "train.engines.base") that module `module`'s
    source imports anywhere in it, deferred imports included. `is_package`: the source is the module's __init__.py."""
    here = module.split(".") if is_package else module.split(".")[:-1]  # the package a relative import starts from

    def resolve(parts: list[str], names: list[str]) -> set[str]:
        """An imported name is a module where one exists (from x import submodule), else the module it is taken
        from: the longest existing prefix of `parts`."""
        found = {".".join(parts + [name]) for name in names if ".".join(parts + [name]) in modules}
        if len(found) < len(names):
            for end in range(len(parts), 0, -1):
                if ".".join(parts[:end]) in modules:
                    found.add(".".join(parts[:end]))
                    break
        return found

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                found |= resolve(base + (node.module.split(".") if node.module else []), names)
            elif node.module and node.module.split(".")[0] == PACKAGE:
                found |= resolve(node.module.split(".")[1:], names)
        elif isinstance(node, ast.Import):
            found |= {".".join(alias.name.split(".")[1:]) for alias in node.names
                      if alias.name.startswith(PACKAGE + ".")}
    return found & modules


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module name (dotted, below the package; a subpackage by its __init__) → the package modules it imports."""
    files = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:  # the package's own __init__ is not a module of the graph
            files[".".join(parts)] = path
    modules = set(files)
    return {name: package_imports(path.read_text(), name, path.name == "__init__.py", modules) - {name}
            for name, path in files.items()}


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


def layer_of(module: str, layers=LAYERS) -> int:
    """The index in `layers` of the stage subpackage `module` belongs to."""
    return layers.index(module.split(".")[0])


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'a → b' for every import from a module to one in a higher layer."""
    return sorted(f"{module} → {imported}" for module, imports in graph.items() for imported in imports
                  if layer_of(imported, layers) > layer_of(module, layers))


def test_every_module_lives_in_a_stage_subpackage():
    stray = sorted(module for module in import_graph(PACKAGE_DIR) if module.split(".")[0] not in LAYERS)
    assert stray == [], f"modules outside the stage subpackages {LAYERS}: {stray}"


def test_the_package_has_no_import_cycle_deferred_imports_included():
    graph = import_graph(PACKAGE_DIR)
    assert {"train.checkpoints.files", "train.checkpoints.checkpointer", "train.engines.base"} <= set(graph)
    assert "train.engines.registry" in graph["train.checkpoints.checkpointer"], "imports were read"
    assert "train.checkpoints.files" in graph["train.engines.base"]
    assert "train.engines.torch_engine" in graph["train.engines.ddp"]
    assert "train.models.flops" in graph["bench.matrix"], "a deferred import is an edge"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_every_import_points_down_the_layers():
    """workflow → report → bench → evaluate → train → data → config → core, deferred imports included."""
    assert upward_imports(import_graph(PACKAGE_DIR)) == []


def test_each_folder_is_small_and_says_what_it_owns():
    for folder in [PACKAGE_DIR, *(path.parent for path in PACKAGE_DIR.rglob("__init__.py"))]:
        modules = [path for path in folder.glob("*.py") if path.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder} holds {len(modules)} modules"
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert docstring and len(docstring.split()) >= 8, f"{folder}/__init__.py says nothing of what it owns"


# Where the validated config's mapping is read by key: the config package (validation, defaults) and the workflow
# package (the one place it becomes typed settings, and the pipeline's DAG-time decisions). Everything below takes
# typed settings (Config, PlanConfig, TrainSettings ...), so a key is read once, where it is typed.
RAW_CONFIG_READERS = ("config", "workflow")


def raw_config_reads(source: str) -> list[int]:
    """Lines that subscript a name or attribute called `config` with a string (`config["train"]`,
    `plan.config["model"]`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            continue
        target = node.value
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
        if name == "config":
            lines.append(node.lineno)
    return lines


def test_the_raw_config_is_read_by_key_only_where_it_becomes_typed():
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR).parts
        if parts[0] in RAW_CONFIG_READERS:
            continue
        found += [f"{path.relative_to(PACKAGE_DIR)}:{line}" for line in raw_config_reads(path.read_text())]
    assert not found, f"config[...] read below the workflow (take typed settings instead): {found}"
    assert raw_config_reads('x = plan.config["model"]\ny = config["train"]["gpus"]\nz = ds_config["fp16"]') == [1, 2]


def test_a_constructed_cycle_is_found(tmp_path):
    """The check fails where there is a cycle (each spelling of a package import), a deferred import included."""
    (tmp_path / "low.py").write_text("try:\n    from .top import g\nexcept ImportError:\n    g = None\n")
    (tmp_path / "middle.py").write_text("from . import low\n")
    (tmp_path / "top.py").write_text("from pretrain_bench.middle import low\n\nclass G:\n"
                                     "    import pretrain_bench.alone\n")
    (tmp_path / "alone.py").write_text("import os\n\ndef f():\n    from .top import G\n    return G\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (tmp_path / "sub" / "leaf.py").write_text("from ..alone import os\nfrom pretrain_bench import sub\nx = 1\n")
    graph = import_graph(tmp_path)
    assert graph == {"low": {"top"}, "middle": {"low"}, "top": {"middle", "alone"}, "alone": {"top"},
                     "sub": {"sub.leaf"}, "sub.leaf": {"alone", "sub"}}
    assert find_cycle(graph) == ["alone", "top", "alone"], "the deferred import in alone.f closes a cycle"
    (tmp_path / "alone.py").write_text("import os\n")
    (tmp_path / "low.py").write_text("g = None\n")
    assert find_cycle(import_graph(tmp_path)) == ["sub", "sub.leaf", "sub"], "a subpackage's cycle is found too"
    (tmp_path / "sub" / "leaf.py").write_text("from ..alone import os\nx = 1\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_a_constructed_upward_import_is_found(tmp_path):
    for layer in ("low", "high"):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text('"""A layer."""\n')
    (tmp_path / "high" / "user.py").write_text("from pretrain_bench.low.base import x\n")
    (tmp_path / "low" / "base.py").write_text("x = 1\n\ndef f():\n    from ..high.user import x\n    return x\n")
    graph = import_graph(tmp_path)
    assert upward_imports(graph, ("low", "high")) == ["low.base → high.user"]
    with pytest.raises(ValueError):
        layer_of("elsewhere.module", ("low", "high"))


def test_every_module_imports_in_a_fresh_interpreter():
    """Every module of the package, imported one after the other in a new interpreter (no test's imports before)."""
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module('pretrain_bench.' + name)\n"
    proc = subprocess.run([sys.executable, "-c", script, *sorted(import_graph(PACKAGE_DIR))], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# What starting a process costs: most of it is importing torch, DeepSpeed and transformers (seconds each on 2 cores),
# so a process imports them only where it uses them.
HEAVY = ("torch", "deepspeed", "transformers", "lm_eval", "mlflow", "wandb")
SCRIPTS_DIR = PACKAGE_DIR.parent
# The rule scripts of the data, plan, matrix and report jobs and the launcher: no model, so none of HEAVY.
LIGHT_SCRIPTS = ("download_corpus", "clean_corpus_part", "train_tokenizer", "shard_tokens", "index_shards",
                 "lm_eval_data", "plan_pretrain", "plan_bench_cell", "write_bench_matrix", "build_report", "launch")
# Library modules that such processes (and every process, for logging and files) import: none of HEAVY at import.
LIGHT_MODULES = ("core.logs", "core.io", "core.progress", "core.devices", "workflow.experiment", "config.schema",
                 "train.settings", "config.checks", "data.products", "data.corpus", "data.corpus_parts",
                 "data.shards", "data.tokenizer", "data.init_from", "train.plan", "train.launcher", "train.run_context",
                 "train.state_lock", "train.metrics", "train.trackers", "train.models.llama", "train.models.flops",
                 "train.memory.fit", "train.memory.model", "evaluate.export", "evaluate.harness",
                 "evaluate.inputs", "evaluate.model_card", "bench.matrix", "report.render")


def script_imports(path: Path) -> set[str]:
    """The package modules (dotted, from `pretrain_bench.`) a rule script imports anywhere: at module level and in
    its functions (what its work imports when it runs)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE}
    return found


def heavy_after(code: str) -> list[str]:
    """The HEAVY libraries loaded after a fresh interpreter runs `code` (None in sys.modules counts as not loaded)."""
    script = code + f"\nimport sys\nprint(' '.join(n for n in {HEAVY!r} if sys.modules.get(n) is not None))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_light_scripts_and_modules_import_no_model_library():
    """A data, plan, matrix or report job, and the launcher, imports no torch, DeepSpeed, transformers or lm-eval:
    neither at the top of its script nor in what its work imports, nor does any light library module at import."""
    lines = ["import importlib.util"]
    for name in LIGHT_SCRIPTS:
        path = SCRIPTS_DIR / f"{name}.py"
        lines.append(f"spec = importlib.util.spec_from_file_location({name!r}, {str(path)!r})")
        lines.append("spec.loader.exec_module(importlib.util.module_from_spec(spec))")
        lines += [f"import {module}" for module in sorted(script_imports(path))]
    lines += [f"import pretrain_bench.{module}" for module in LIGHT_MODULES]
    assert heavy_after("\n".join(lines)) == []
    assert {"pretrain_bench.train.plan", "pretrain_bench.report.render"} <= set().union(
        *(script_imports(SCRIPTS_DIR / f"{name}.py") for name in LIGHT_SCRIPTS)), "the scripts' imports were read"


def test_a_heavy_import_is_seen():
    """The check above fails where a module does import one of them."""
    assert heavy_after("import pretrain_bench.data.loader") == ["torch"]


def test_a_rank_imports_no_unchosen_tracker():
    """DeepSpeed's import tries mlflow (its autotuner); a rank whose train.loggers leave it out never loads it (nor
    wandb), and one that chooses it keeps it importable."""
    skip = "from pretrain_bench.train.launcher import skip_unchosen_trackers\nskip_unchosen_trackers({!r})\n"
    assert heavy_after(skip.format(("tensorboard",)) + "import deepspeed") == ["torch", "deepspeed"]
    assert heavy_after(skip.format(("mlflow",)) + "import mlflow") == ["mlflow"]


def test_a_startup_record_is_logged_once_and_read_back(caplog):
    """log_startup: one record per `what` and process, launched before reached, its parents' launches before its
    own; read_startups finds it in a job log's formatted line."""
    import logging

    import psutil

    from pretrain_bench.core.logs import FORMAT, HEAVY_LIBRARIES, log_startup, read_startups

    with caplog.at_level(logging.INFO, logger="pretrain_bench.core.logs"):
        record = log_startup("a test's first work", parents=1, rank=2)
        assert log_startup("a test's first work") is None, "a second call of the same mark logs nothing"
    assert record["rank"] == 2 and record["pid"] == os.getpid()
    assert record["launched"] == psutil.Process().create_time() <= record["reached"]
    assert record["startup_s"] == round(record["reached"] - record["launched"], 3)
    assert record["parents_launched"] == [psutil.Process().parent().create_time()] <= [record["launched"]]
    assert record["imported"] == [name for name in HEAVY_LIBRARIES if sys.modules.get(name) is not None]
    lines = [logging.Formatter(FORMAT).format(entry) for entry in caplog.records]
    assert len(lines) == 1 and read_startups("other line\n" + "\n".join(lines) + "\n") == [record]
