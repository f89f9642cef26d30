"""A run plan: everything one training run needs, resolved from the config into one JSON file.

The plan is the pretrain rule's input (so Snakemake reruns training when a setting that matters changes) and the
only thing the launcher and the ranks read: no rank parses config.yaml. A plan is made from a `PlanConfig`, the part
of the config a training run uses, which the plan rules receive as `params:` (PlanConfig.as_dict) — so an edit
anywhere else (an evaluation prompt, the report) never replans or retrains, and an edit here always does.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pretrain_bench.config.schema import (
    BenchSettings,
    ModelSettings,
    keys_with,
)
from pretrain_bench.core.devices import resolve_device_cheaply
from pretrain_bench.core.io import atomic_write_json, key_differences
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.memory.fit import fit_run
from pretrain_bench.train.models.flops import plan_peak
from pretrain_bench.train.models.registry import check_expert_parallel
from pretrain_bench.train.settings import (
    CELL_IRRELEVANT_KEYS,
    TRAINS_FURTHER_KEYS,
    ConfigError,
    PlanConfig,
    TrainSettings,
    check_settings,
)

# plan.json's copy of memory_fit under the name older readers of plan.json use (written, not read back).
PREFLIGHT_KEY = "preflight"
# benchmark.* keys the pre-flight reads (the machine it plans for, and whether to launch runs that do not fit).
PLANNING_KEYS = keys_with(BenchSettings, "plan")


@dataclass(frozen=True)
class RunPaths:
    """Where a run reads its data and writes its outputs and state."""

    index: str  # the shards' index.json
    tokenizer: str  # the tokenizer folder
    out_dir: str  # the rule's declared outputs (summary, metrics copy, ds_config)
    state_dir: str  # resumable state kept outside the declared outputs: checkpoints, metrics.jsonl, tensorboard
    manifest: str | None  # the corpus manifest the model card lists (None for benchmark cells)


@dataclass(frozen=True)
class Plan:
    """One training run, resolved from the config by the plan rule and read by the launcher and every rank.

    Frozen: nothing changes it at run time. What a rank learns when it starts (its device, the hardware) is a
    `RunContext`. `to_json`/`from_json` keep plan.json's keys; a plan file that lacks a field is refused by name."""

    name: str
    role: str  # pretrain | bench
    config: PlanConfig  # the part of the config a training run reads
    device_request: str  # train.device as asked (auto | cpu | cuda)
    train: TrainSettings  # the train block after the memory pre-flight
    model: ModelSettings  # preset, seq_len, overrides, init_from (uri)
    init_from: dict | None  # init_from_record(): the local folder and identity of model.init_from's weights
    data_sha256: str  # digest of the shards' index.json
    paths: RunPaths
    resume: bool  # continue from the newest verified checkpoint (benchmark cells: never)
    save_checkpoints: bool
    peak_tflops: float | None  # report.peak_tflops as configured
    peak: dict | None  # flops.plan_peak(): the peak FLOP/s per rank every MFU divides by, and its source
    measure_comm: bool  # run DeepSpeed's comms logger (it synchronises every collective)
    memory_fit: dict  # the pre-flight's record (memory_fit.fit_run); plan.json holds it as `preflight` too
    cell: str | None = None  # the benchmark cell this plan measures
    data: dict | None = None  # data.products.DataProducts.record(): the data id and the folders of the run's data

    def to_dict(self) -> dict:
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data |= {"config": self.config.as_dict(), "train": self.train.as_dict(), "model": self.model.as_dict(),
                 "paths": dataclasses.asdict(self.paths)}
        data[PREFLIGHT_KEY] = data["memory_fit"]
        if data["cell"] is None:
            del data["cell"]  # a main run's plan.json has no cell key
        return data

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> Plan:
        data = {key: value for key, value in data.items() if key != PREFLIGHT_KEY}
        missing, unknown = key_differences(cls, data)
        path_fields = {field.name for field in dataclasses.fields(RunPaths)}
        missing_paths, _ = key_differences(RunPaths, data.get("paths") or {}, defaults_optional=False)
        missing += [f"paths.{key}" for key in missing_paths]
        if missing or unknown:
            raise ConfigError(f"{source} is not a plan this version writes (missing {missing}, unknown {unknown}): "
                              "rerun its plan rule (snakemake --forcerun plan_pretrain, or plan_bench_cell for a cell)")
        return cls(**{**data, "paths": RunPaths(**{k: data["paths"][k] for k in path_fields}),
                      "config": PlanConfig.from_dict(data["config"]), "train": TrainSettings.from_config(data["train"]),
                      "model": ModelSettings.from_config(data["model"])})

    def to_json(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, path: Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))


@dataclass(frozen=True)
class RunContext:
    """Run-time facts a rank learns when it starts, kept apart from the plan it was given."""

    device: str  # cpu | cuda: what the launcher resolved device_request to
    hardware: dict  # devices.hardware_description(device)


def shards_verify_mode(plan: Plan) -> str:
    """shards.verify of a plan: how its launcher checks the shards before the first step."""
    return plan.config.shards.verify


def only_trains_further(plan_path: Path, config: PlanConfig) -> bool:
    """Whether a plan made from `config` (a plan config) only trains on the run whose plan is `plan_path`: the same
    plan config but for a raised train.max_steps or train.max_tokens (TRAINS_FURTHER_KEYS). That run resumes, and every
    checkpoint it has kept stays as it is. False when there is no such plan (or it cannot be read), and after any
    other edit of what a plan reads, even one a resume allows: only then may the checkpoints be written anew."""
    try:
        written = json.loads(Path(plan_path).read_text())["config"]
        old_train = written["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    asked = json.loads(json.dumps(config.as_dict(), default=str))  # as plan.json holds it (lists, not tuples)
    new_train = asked["train"]
    # max_tokens null (no token limit) counts as 0
    if any((new_train[key] or 0) < (old_train[key] or 0) for key in TRAINS_FURTHER_KEYS):
        return False  # fewer steps: not a continuation

    def without_steps(record: dict) -> dict:
        return {**record, "train": {k: v for k, v in record["train"].items() if k not in TRAINS_FURTHER_KEYS}}

    return without_steps(written) == without_steps(asked)


def cell_settings(main: TrainSettings, overrides: dict) -> TrainSettings:
    """A benchmark cell's train settings: the main run's, with the cell's values and the benchmark's step counts.

    The cell measures exactly its own settings, so train.memory_fit never changes them (cells predicted not to fit
    are left out of the matrix instead), and its global batch is derived from its own ranks. The keys a timing never
    reads (CELL_IRRELEVANT_KEYS: evaluation, checkpoints, trackers) keep their defaults, and its plan config leaves
    them out (PlanConfig.cell), so editing them never reruns a cell.
    """
    train = {**main.as_dict(), **overrides, "global_batch_size": None, "memory_fit": "strict"}
    return TrainSettings.from_config({key: value for key, value in train.items() if key not in CELL_IRRELEVANT_KEYS})


def make_plan(config: PlanConfig, *, index: Path, tokenizer: Path, out_dir: Path, state_dir: Path,
              role: str = "pretrain", resume: bool = True, save_checkpoints: bool = True,
              peak: dict | None = None, manifest: Path | None = None, cell: str | None = None,
              data: dict | None = None) -> Plan:
    """Resolve a plan config into a Plan; raises ConfigError.

    peak: rule measure_peak's bench/peak.json, the machine's peak that every run's MFU divides by.
    manifest: the corpus manifest, whose sources the export's model card lists.
    data: the data products' record (DataProducts.record()), which the summary and model card name."""
    settings, model = config.train, config.model
    if settings.nvme_path is None:
        settings = dataclasses.replace(settings, nvme_path=str(Path(state_dir) / "nvme"))
    check_settings(settings, seq_len=model.seq_len)  # first: it names an unknown train.engine
    check_expert_parallel(model, settings.expert_parallel, engine_spec(settings.engine).check_expert_model)
    # Pre-flight: stop (or, under train.memory_fit auto, change the settings) before anything is allocated when
    # the run is predicted not to fit; benchmark.force launches anyway. What it chooses needs no second check: its
    # rungs (memory_fit.ladder) change only the layout keys, each into a combination that check_settings accepts.
    index_data = json.loads(Path(index).read_text())
    settings, memory_fit = fit_run(config, settings, index_data.get("vocab_size"), what=f"the {role} run",
                                   state_dir=str(state_dir) if save_checkpoints else None)
    if settings.eval_every:
        check_val_split(index_data, Path(index), model.seq_len, settings)
    device = resolve_device_cheaply(settings.device)  # nvidia-smi at most once
    return Plan(
        name=config.name,
        role=role,
        config=config,
        device_request=settings.device,
        train=settings,
        model=model,
        # model.init_from fetched (hf://: into the HF cache) once here, so the ranks only read a local folder
        init_from=init_from_record(model, index_data.get("vocab_size")) if model.init_from else None,
        data_sha256=hashlib.sha256(Path(index).read_bytes()).hexdigest(),
        paths=RunPaths(index=str(index), tokenizer=str(tokenizer), out_dir=str(out_dir), state_dir=str(state_dir),
                       manifest=str(manifest) if manifest else None),
        resume=resume,
        save_checkpoints=save_checkpoints,
        peak_tflops=config.report.peak_tflops,
        peak=plan_peak(peak, config.report.peak_tflops, device, settings.world_size),
        # the comms logger synchronises every collective: measured where that costs nothing (CPU) or is the point
        # (benchmark cells), never in a production CUDA run
        measure_comm=role == "bench" or device == "cpu",
        memory_fit=memory_fit,
        cell=cell,
        data=data,
    )


def check_val_split(index_data: dict, index: Path, seq_len: int, settings: TrainSettings) -> None:
    """train.eval_every: the val split holds the samples every evaluation takes (heldout.heldout_samples, which the
    ranks use too), refused here, before launch, rather than inside the ranks."""
    from pretrain_bench.train.heldout import heldout_samples

    val_tokens = sum(shard["tokens"] for shard in index_data["splits"]["val"]["shards"])
    heldout_samples(val_tokens, seq_len, settings.world_size, settings.eval_tokens, index)


def init_from_record(model: ModelSettings, tokenizer_vocab: int | None) -> dict:
    """Where model.init_from's weights are (a local folder) and what identifies them: the hf:// commit, and a digest
    of config.json and the weight files' names and sizes (a changed model starts a fresh run, never a resume).

    The weights are checked here, before launch: they exist, and each tensor's shape (from the safetensors headers)
    is the one the model of `model` (its config.json, with the vocabulary of the tokenizer) has."""
    from pretrain_bench.data.init_from import init_from_folder
    from pretrain_bench.train.models.llama import check_init_from_weights
    from pretrain_bench.train.models.registry import model_shape

    uri = model.init_from
    folder = init_from_folder(uri, weights=True)
    shape = model_shape(model, tokenizer_vocab, init_folder=folder)
    weights = check_init_from_weights(folder, shape, model.seq_len)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in weights:
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return {"uri": uri, "path": str(folder), "revision": folder.name if uri.startswith("hf://") else None,
            "weight_files": [file.name for file in weights], "weights_bytes": sum(f.stat().st_size for f in weights),
            "identity": digest.hexdigest()}


def plan_shape(plan: Plan, tokenizer_vocab: int | None):
    """The model shape of a plan: its preset, or its init_from folder's config.json."""
    from pretrain_bench.train.models.registry import model_shape

    folder = Path(plan.init_from["path"]) if plan.init_from else None
    return model_shape(plan.model, tokenizer_vocab, init_folder=folder)


__all__ = ["ConfigError", "Plan", "PlanConfig", "RunContext", "RunPaths", "cell_settings", "check_val_split",
           "init_from_record", "make_plan", "only_trains_further", "plan_shape", "shards_verify_mode"]
