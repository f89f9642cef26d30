"""The pipeline as Snakemake reads it: built once from the config when the Snakefile is parsed, then asked by the
rules for their inputs, outputs and params.

`Pipeline` validates the config (short errors naming the key), resolves train.gpus against `--resources gpu`, turns
the config into typed settings, and decides what the rules need at DAG time: the data products, the local corpus
files, the benchmark matrix (which cells this machine runs and why the others are left out), the memory each export
and evaluation job asks for. Its methods are the rules' input and param functions; what a benchmark cell asks for is
worked out once per cell (and once per repeat round), however many rules and jobs ask. Nothing here imports
Snakemake: rules/common.smk hands in what it knows of the run (the workflow's folder, its resources and cores) and
turns `PlanError` into Snakemake's WorkflowError.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pretrain_bench.bench.matrix import Cell, plan_matrix
from pretrain_bench.bench.peak import MachinePeak
from pretrain_bench.config.checks import check_torch_version
from pretrain_bench.config.schema import AXES, ConfigError, coerce_command_line_types, load_schema
from pretrain_bench.config.validation import validate_config
from pretrain_bench.core.devices import resolve_device_cheaply
from pretrain_bench.data.init_from import local_path
from pretrain_bench.data.products import DataProducts, missing_tokenizer_problem
from pretrain_bench.data.sources import CorpusError, local_source_files
from pretrain_bench.data.tokenizer import adopted_tokenizer_path
from pretrain_bench.evaluate.inputs import evaluation_is_current, marker_digest
from pretrain_bench.train.memory.model import config_vocab_size, export_and_evaluation_host_bytes, run_shape
from pretrain_bench.train.plan import PlanConfig, cell_settings, only_trains_further
from pretrain_bench.workflow.experiment import Config

FINAL_EXPORT_DTYPE = "fp32"  # train/hf holds the master weights exactly


class PlanError(Exception):
    """A config or a machine this workflow cannot plan for; the message names the key and what to do."""


def resource_number(value) -> int | None:
    """A Snakemake global resource (`workflow.global_resources.get("gpu")`, a plain number or a Resource object) as
    an int, None when the command line did not give it."""
    value = getattr(value, "value", value)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_other_run_input(key: str, path: str | None, name: str, marker: str | None) -> None:
    """`key` (model.init_from, tokenizer.path) naming a path under results/<other name>/ names another run's output,
    read as it is: this config never builds it (see wildcard_constraints). Missing (`marker` inside it missing, or
    the path itself when marker is None), the error says how that run builds it, before any job runs."""
    if not path or path.startswith("hf://"):
        return
    folder = local_path(path)  # `..` resolved lexically: results/<new>/../<other> while results/<new> is not there
    try:
        parts = folder.resolve().relative_to(Path("results").resolve()).parts
    except ValueError:
        return  # a path outside results/: nothing of a run's
    if not parts:
        return
    if parts[0] == name:
        raise PlanError(f"{key} {path} is inside this run's own results/{name}/, which this run writes: a run "
                        "cannot start from itself; give the continued run a new name (name: ...)")
    needed = folder / marker if marker else folder
    if not needed.exists():
        target = Path("results", *parts).as_posix()
        raise PlanError(
            f"{key} {path}: run {parts[0]!r} has not written it yet (no {needed}), and this run ({name!r}) never "
            f"builds another run's results. Build it first with the config files of run {parts[0]!r}:\n  snakemake "
            f"--cores all --resources gpu=<N> --configfile <its config files> --config name={parts[0]} -- {target}\n"
            "then run this again.")


class Pipeline:
    """Everything the rules read, decided once from the config (in place: validated, defaults filled in, train.gpus
    resolved, as the rules' params hand it on).

    basedir: the workflow's folder (schemas/ and workflow_scripts/ are in it); gpu_resource: `--resources gpu=N`
    when given; cores: Snakemake's --cores; validate: False when this workflow is a module told to skip validation.
    """

    def __init__(self, config: dict, basedir: Path | str, gpu_resource: int | None = None, cores: int = 1,
                 validate: bool = True):
        basedir = Path(basedir)
        # 1) the schema parsed once, for the command-line types and for validation
        schema = load_schema(basedir / "schemas" / "config.schema.yaml")
        coerce_command_line_types(config, schema)
        try:
            if validate:
                validate_config(config, schema)
            # 2) the validated config as typed, frozen settings, built (and its combinations checked) once
            self.settings = Config.from_config(config, gpu_resource)
        except ConfigError as error:
            raise PlanError(f"invalid configuration: {error}") from None
        try:
            check_torch_version()  # before anything plans with it: an older torch is refused in one line
        except ConfigError as error:
            raise PlanError(str(error)) from None
        self.config, self.gpu_resource = config, gpu_resource
        s = self.settings
        self.name = s.name
        # 3) what this run reads from elsewhere: another run's export, an adopted tokenizer, local corpus files
        check_other_run_input("model.init_from", s.model.init_from, self.name, "config.json")
        problem = missing_tokenizer_problem(s.tokenizer.path,
                                            DataProducts.from_settings(s.corpus, s.tokenizer, s.shards, None))
        if problem:
            raise PlanError(problem)
        check_other_run_input("tokenizer.path", s.tokenizer.path, self.name, None)
        try:
            self.corpus_files = local_source_files(s.corpus.sources)
        except CorpusError as error:
            raise PlanError(f"corpus.sources: {error}") from None
        # a local model.init_from folder is an input of planning: a newer export there replans (and continues again)
        init_from = s.model.init_from or "hf://"
        self.init_from_input = [] if init_from.startswith("hf://") else [str(local_path(init_from))]
        # 4) evaluation's device: where evaluate.device says (null: train.device); a job on a GPU holds one slot
        self.eval_device = s.evaluate.device or s.train.device
        self.eval_gpus = 1 if resolve_device_cheaply(self.eval_device) == "cuda" else 0
        self.lm_eval_tasks = s.evaluate.lm_eval["tasks"]
        # 5) the benchmark matrix and the data products, decided here at DAG time
        try:
            self.vocab_size = config_vocab_size(s.tokenizer, s.model)
            self.matrix = plan_matrix(s.plan_config(), s.benchmark, available_ranks=gpu_resource,
                                      vocab_size=self.vocab_size)
            # tokenizer.path, or model.init_from's own tokenizer: the tokenizer stage adopts it instead of training
            self.adopted_tokenizer = adopted_tokenizer_path(s.tokenizer.path, s.model.init_from)
        except ConfigError as error:
            raise PlanError(f"invalid configuration: {error}") from None
        self.data = DataProducts.from_settings(s.corpus, s.tokenizer, s.shards, self.adopted_tokenizer)
        # the machine's peak FLOP/s, measured once per machine and software, shared by every run name (bench/peak.py)
        self.peak = MachinePeak.here(self.matrix["device"])
        self.bench_cells = {entry["cell"]: entry for entry in self.matrix["cells"] if entry["status"] == "run"}
        self.bench_enabled = bool(self.matrix["cells"])
        # a timed cell takes every core, so nothing else (no other cell, no training, no evaluation) shares them
        self.bench_threads = 1 if s.benchmark.allow_concurrent else cores
        # 6) what an evaluation reruns for (pretrain_bench/evaluate/inputs.py)
        self.main_plan_config = s.plan_config()
        self.trains_further = only_trains_further(Path(f"results/{self.name}/train/plan.json"),
                                                  self.main_plan_config)
        e = s.evaluate
        self.evaluate_settings = {
            "dtype": e.export_dtype, "max_tokens": e.max_tokens, "batch_size": e.batch_size,
            "device": self.eval_device, "precision": e.precision, "prompts": list(e.prompts),
            "generation": e.generation, "lm_eval": e.lm_eval if self.lm_eval_tasks else None,
        }
        self.checkpoint_steps = s.train.checkpoint_steps(s.model.seq_len)
        self._cell_plans: dict[str, PlanConfig] = {}  # cell → its plan config (cell_plan_config)
        self._rounds: dict[tuple[str, int], list] = {}  # (name, repeat) → the round before it (previous_round)

    # --- the pre-flight's memory: host RAM of one export or evaluation job, in mem_mb (10^6 bytes, as Snakemake
    # counts it): with `--resources mem_mb=N` Snakemake runs only as many at once as fit; SLURM gets it as --mem
    def memory_mb(self, main_train) -> tuple[int, int]:
        """(export_final's, evaluate's) mem_mb, from the main run's settings after train.memory_fit (`main_train`)."""
        shape = run_shape(self.main_plan_config, main_train, "cpu", self.vocab_size)  # the parameters, any device
        export = export_and_evaluation_host_bytes(shape, FINAL_EXPORT_DTYPE)
        evaluate = export_and_evaluation_host_bytes(shape, self.evaluate_settings["dtype"],
                                                    self.evaluate_settings["precision"])
        return -(-export // 10**6), -(-evaluate // 10**6)

    # --- outputs
    def eval_outputs(self, name: str) -> list[str]:
        return [f"results/{name}/eval/step{step}.json" for step in self.checkpoint_steps]

    def lm_eval_outputs(self, name: str) -> list[str]:
        """lm_eval/step<N>.json per kept checkpoint when evaluate.lm_eval.tasks names any task, else none."""
        if not self.lm_eval_tasks:
            return []
        return [f"results/{name}/lm_eval/step{step}.json" for step in self.checkpoint_steps]

    def evaluation_outputs(self, name: str) -> list[str]:
        """Per kept checkpoint: the HF export, eval/step<N>.json and, when evaluate.lm_eval.tasks names any,
        lm-eval's."""
        return ([f"results/{name}/export/step{step}" for step in self.checkpoint_steps] + self.eval_outputs(name)
                + self.lm_eval_outputs(name))

    def step_evaluation_outputs(self, name: str, step: int) -> list[str]:
        """Rule evaluate's outputs for checkpoint `step`."""
        return [f"results/{name}/export/step{step}", f"results/{name}/eval/step{step}.json",
                *([f"results/{name}/lm_eval/step{step}.json"] if self.lm_eval_tasks else [])]

    def bench_matrix_outputs(self, name: str) -> list[str]:
        """bench/matrix.json when the benchmark matrix has any cell (benchmark.enabled and non-empty axes)."""
        return [f"results/{name}/bench/matrix.json"] if self.bench_enabled else []

    def bench_summaries(self, name: str) -> list[str]:
        """summary.json of every runnable cell × repeat."""
        return [f"results/{name}/bench/{cell}/rep{rep}/summary.json" for cell in sorted(self.bench_cells)
                for rep in range(1, self.settings.benchmark.repeats + 1)]

    def final_outputs(self) -> list[str]:
        name = self.name
        return [f"results/{name}/report/report.md", f"results/{name}/report/report.html", f"results/{name}/train/hf",
                *self.bench_matrix_outputs(name), *self.evaluation_outputs(name)]

    # --- inputs and params
    def training_input(self, path: str, name: str, step: int, ancient: Callable):
        """`path` (the run's plan or summary) as an input of rule evaluate: `ancient(path)` when this config only
        trains further and the checkpoint's evaluation outputs all exist, made from that checkpoint as it is and
        with these settings. Not merely when they exist: Snakemake 9 skips the checks of every job downstream of
        one it will rerun (here, training) and schedules none linked to it by ancient inputs alone, so their own
        missing outputs or changed params would go unnoticed."""
        concrete = path.format(name=name)
        if not self.trains_further:
            return concrete
        current = (all(Path(output).exists() for output in self.step_evaluation_outputs(name, step))
                   and evaluation_is_current(f"results/{name}/eval/step{step}.json", f"results/{name}/state", step,
                                             self.evaluate_settings))
        return ancient(concrete) if current else concrete

    @staticmethod
    def checkpoint_digest(name: str, step: str):
        """The digest of checkpoint step<N>'s commit marker, None before training wrote it. Snakemake computes params
        again just before a job runs: an evaluation records the marker it read, and one written anew reruns it."""
        return marker_digest(f"results/{name}/state", step)

    def bench_cell(self, cell: str) -> dict:
        """The matrix entry of a runnable cell; asking for a left-out cell says why it is left out."""
        if cell not in self.bench_cells:
            entry = next((e for e in self.matrix["cells"] if e["cell"] == cell), None)
            reason = entry["reason"] if entry else "not in benchmark.matrix"
            raise PlanError(f"benchmark cell {cell} does not run: {reason}")
        return self.bench_cells[cell]

    def cell_plan_config(self, cell: str) -> PlanConfig:
        """What plan_bench_cell hands its script for one cell: the main run's with the cell's train block. Worked out
        once per cell, however many repeats ask."""
        if cell not in self._cell_plans:
            entry = self.bench_cell(cell)
            overrides = Cell(**{axis: entry[axis] for axis in AXES}).train_overrides(self.settings.benchmark)
            self._cell_plans[cell] = self.settings.plan_config(cell_settings(self.settings.train, overrides))
        return self._cell_plans[cell]

    def previous_round(self, name: str, rep: int, ancient: Callable) -> list:
        """Repeat `rep` of a cell waits for repeat rep - 1 of every cell, so that the repeats of different cells
        interleave (round 1 of every cell, then round 2 ...) and a slow spell of the machine spreads over cells
        instead of landing on one. Ancient: an order only, never a reason to rerun a repeat that exists. Once per
        round: every cell of it waits for the same files."""
        if rep == 1:
            return []
        if (name, rep) not in self._rounds:
            self._rounds[name, rep] = [ancient(f"results/{name}/bench/{cell}/rep{rep - 1}/summary.json")
                                       for cell in sorted(self.bench_cells)]
        return list(self._rounds[name, rep])
