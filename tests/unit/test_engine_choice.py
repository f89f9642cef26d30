"""train.engine without training: what each engine refuses, its memory formula, its benchmark cells and its place
in the report's tables."""
import pytest

from pretrain_bench.bench.matrix import BenchSettings, cells, plan_matrix
from pretrain_bench.report.claims import CLAIMS, claim_eight_nodes
from pretrain_bench.report.tables import ENGINE_COLUMNS, cell_table, engine_frame, format_frame
from pretrain_bench.train.memory.fit import fit_run
from pretrain_bench.train.memory.model import GIB, checkpoint_bytes, estimate, run_shape
from pretrain_bench.train.run_summary import RunSummary
from pretrain_bench.train.settings import ConfigError, TrainSettings, check_settings
from pretrain_bench.workflow.experiment import plan_config
from support import ROOT, tiny_config


def settings(**train) -> TrainSettings:
    return TrainSettings.from_config({"device": "cpu", "comm_backend": "gloo", "precision": "fp32", **train})


@pytest.mark.parametrize("train, message", [
    ({"engine": "ddp", "zero_stage": 2}, r"train.zero_stage 2 means nothing under train.engine ddp: DDP replicates "
                                         r".*Leave train.zero_stage out \(or null: the engine's 0\)"),
    ({"engine": "fsdp", "zero_stage": 2}, r"train.zero_stage 2 means nothing under train.engine fsdp: FSDP shards "
                                          r".*Leave train.zero_stage out \(or null: the engine's 3\)"),
    ({"engine": "ddp", "zero_stage": 0, "offload_optimizer": "cpu"},
     r"train.offload_optimizer cpu means nothing under train.engine ddp"),
    ({"engine": "fsdp", "zero_stage": 3, "offload_param": "cpu"},
     r"train.offload_param cpu means nothing under train.engine fsdp"),
    ({"engine": "ddp", "zero_stage": 0, "deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000}}},
     r"train.deepspeed \['zero_optimization'\] means nothing under train.engine ddp"),
    ({"engine": "megatron"}, r"train.engine 'megatron' is not one of"),
])
def test_keys_an_engine_cannot_honour_are_refused_with_the_reason(train, message):
    with pytest.raises(ConfigError, match=message):
        check_settings(settings(**train), "cpu")


def test_each_engine_accepts_its_own_layout():
    for train in ({"engine": "ddp", "zero_stage": 0}, {"engine": "fsdp", "zero_stage": 3}, {"zero_stage": 1}):
        check_settings(settings(**train), "cpu")  # no error


def test_an_unset_zero_stage_follows_the_engine():
    assert settings(engine="ddp").zero_stage == 0 and settings(engine="fsdp").zero_stage == 3
    assert settings().zero_stage == 2 and settings(zero_stage=None).zero_stage == 2  # DeepSpeed: the articles' ZeRO-2
    assert settings(engine="deepspeed", zero_stage=3).zero_stage == 3  # a stage set is kept
    for engine in ("ddp", "fsdp"):
        check_settings(settings(engine=engine), "cpu")  # no error


def test_the_validated_config_says_the_stage_the_engine_implies():
    from pretrain_bench.workflow.experiment import Config, load_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    for engine, stage in (("ddp", 0), ("fsdp", 3), ("deepspeed", 2)):
        raw = {**config, "train": {**config["train"], "engine": engine, "zero_stage": None}}
        typed = Config.from_config(raw)
        assert typed.train.zero_stage == raw["train"]["zero_stage"] == stage, engine
        # the matrix's zero_stage axis, left out, is the main run's resolved stage
        bench_config = {**raw, "benchmark": {**raw["benchmark"], "matrix": {**raw["benchmark"]["matrix"]}}}
        del bench_config["benchmark"]["matrix"]["zero_stage"]
        assert BenchSettings.from_config(bench_config).matrix["zero_stage"] == [stage]


def test_a_deepspeed_run_without_zero_stage_plans_and_fingerprints_as_zero_2_did():
    """What the resume fingerprint (the typed train block) and the plan digest (the plan config) are made of is the
    same whether a DeepSpeed config sets zero_stage: 2 or leaves it to the default."""
    from pretrain_bench.workflow.experiment import Config, load_config, plan_config

    config = load_config(ROOT / "config.yaml", ROOT / "config" / "tiny-cpu.yaml")
    explicit = {**config, "train": {**config["train"], "zero_stage": 2}}
    unset = {**config, "train": {**config["train"], "zero_stage": None}}
    typed = {name: Config.from_config(c) for name, c in (("explicit", explicit), ("unset", unset))}
    assert typed["explicit"].train.as_dict() == typed["unset"].train.as_dict()
    assert plan_config(explicit) == plan_config(unset)
    assert plan_config(unset).as_dict()["train"]["zero_stage"] == 2


def shape_of(engine: str, stage: int, ranks: int = 4, precision: str = "bf16"):
    config = tiny_config("x")
    config["model"] = {"preset": "llama-125m", "seq_len": 128, "overrides": {}}
    train = settings(engine=engine, zero_stage=stage, gpus=ranks, precision=precision)
    return run_shape(plan_config(config), train, "cuda", 32000)


def test_memory_model_ddp_replicates_sixteen_psi_and_fsdp_shards_it():
    for ranks in (1, 4):
        ddp = shape_of("ddp", 0, ranks)
        est = estimate(ddp)
        # fp32 params + fp32 grads + AdamW moments on every rank, whatever the compute precision
        assert est.model_states == 16 * ddp.parameters
        assert "replicated" in est.state_formula
        assert est.buffers == 2 * ddp.parameters  # bf16 autocast copies of the weights, kept for the backward
        fsdp = shape_of("fsdp", 3, ranks)
        assert estimate(fsdp).model_states == 16 * (fsdp.parameters // ranks)
    assert estimate(shape_of("ddp", 0, precision="fp32")).buffers == 0  # no autocast in fp32
    # FSDP's gathered layers: the more ranks, the smaller the states, never below the gathered buffers
    fsdp1, fsdp4 = estimate(shape_of("fsdp", 3, 1)), estimate(shape_of("fsdp", 3, 4))
    assert fsdp4.model_states * 4 == fsdp1.model_states and fsdp4.buffers == fsdp1.buffers > 0
    # checkpoints hold fp32 parameters and the two moments: 12Ψ for both PyTorch engines
    assert checkpoint_bytes(1000, "bf16", 0, "ddp") == checkpoint_bytes(1000, "bf16", 3, "fsdp") == 12000


def test_memory_fit_never_offloads_a_pytorch_engine():
    config = tiny_config("x")
    config["model"] = {**config["model"], "preset": "llama-1b", "seq_len": 2048, "overrides": {}}
    config["train"] = {**config["train"], "engine": "ddp", "zero_stage": 0, "device": "cuda", "comm_backend": "nccl",
                       "precision": "bf16", "gpus": 3}
    config["benchmark"] = {**config["benchmark"], "device_memory_gib": 24}
    fitted, record = fit_run(plan_config(config), TrainSettings.from_config(config["train"]))
    assert fitted.offload_optimizer == "none" and fitted.zero_stage == 0 and fitted.engine == "ddp"
    assert record["tried"] and all("offload" not in t["label"] and t["label"].startswith("DDP")
                                   for t in record["tried"])
    assert record["changed"] and set(record["changed"]) <= {"activation_checkpointing", "micro_batch_size",
                                                            "grad_accum_steps"}


def test_engine_axis_collapses_the_zero_and_offload_axes_for_ddp_and_fsdp():
    config = tiny_config("x")
    config["benchmark"]["matrix"] = {"gpus": [1, 3], "zero_stage": [1, 2], "precision": ["fp32"],
                                     "comm_backend": ["gloo"], "offload_optimizer": ["none", "cpu"],
                                     "engine": ["deepspeed", "ddp", "fsdp"]}
    bench = BenchSettings.from_config(config)
    names = [c.name(TrainSettings.from_config(config["train"])) for c in cells(bench)]
    assert len(names) == len(set(names)) == 2 * 2 * 2 + 2 + 2
    assert {"ddp-ranks1-fp32-gloo", "ddp-ranks3-fp32-gloo", "fsdp-ranks3-fp32-gloo"} <= set(names)
    matrix = plan_matrix(plan_config(config), bench, available_ranks=3)
    by_name = {e["cell"]: e for e in matrix["cells"]}
    assert by_name["ddp-ranks3-fp32-gloo"]["zero_stage"] == 0 and by_name["fsdp-ranks3-fp32-gloo"]["zero_stage"] == 3
    assert by_name["ddp-ranks3-fp32-gloo"]["status"] == "run", by_name["ddp-ranks3-fp32-gloo"]["reason"]
    assert by_name["fsdp-ranks3-fp32-gloo"]["estimate"]["state_formula"].startswith("16Ψ/N")


def summary(engine: str, tps: float, comm: float | None = None) -> RunSummary:
    """A benchmark repeat's summary: the figures the engines table reads (the others None)."""
    unread = {name: None for name in RunSummary.__dataclass_fields__ if name != "version"}
    return RunSummary(**{**unread, "tokens_per_s": tps, "step_time_s": {"median": 1.0}, "peak_mem_bytes": [GIB],
                         "comm_fraction": comm, "global_batch_size": 8, "tokens_per_step": 1024, "engine": engine,
                         "oversubscribed": False, "provenance": {}})


def engine_rows(matrix: dict, runs: dict) -> list[dict]:
    """The report's engines table, as the template prints it."""
    return format_frame(engine_frame(matrix, cell_table(matrix, runs)), ENGINE_COLUMNS)


def test_engine_rows_compare_equal_work_fastest_first_with_speedup_over_its_own_one_rank_cell():
    estimate_ = {"per_rank": GIB, "host_states": 0, "runtime": 0, "model_states": GIB // 2, "activations": 0,
                 "state_formula": "f"}

    def entry(engine, gpus, stage):
        name = f"{engine}-ranks{gpus}" if engine != "deepspeed" else f"ranks{gpus}-zero{stage}"
        return {"cell": name, "engine": engine, "gpus": gpus, "zero_stage": stage, "precision": "fp32",
                "comm_backend": "gloo", "micro_batch_size": 8, "offload_optimizer": "none", "estimate": estimate_}

    matrix = {"device": "cpu", "cells": [entry("deepspeed", 1, 2), entry("deepspeed", 3, 2), entry("ddp", 1, 0),
                                         entry("ddp", 3, 0), entry("fsdp", 3, 3)]}
    runs = {"ranks1-zero2": [summary("deepspeed", 100)], "ranks3-zero2": [summary("deepspeed", 240, 0.2)],
            "ddp-ranks1": [summary("ddp", 110)], "ddp-ranks3": [summary("ddp", 300, 0.1)],
            "fsdp-ranks3": [summary("fsdp", 150)]}
    rows = engine_rows(matrix, runs)
    three = [r for r in rows if r["ranks"] == "3"]
    assert [r["engine"] for r in three] == ["DDP", "DeepSpeed ZeRO-2", "FSDP2"]
    assert [r["vs_fastest"] for r in three] == ["1.00×", "0.80×", "0.50×"]
    assert three[0]["speedup"] == "2.73×" and three[1]["speedup"] == "2.40×" and three[2]["speedup"] == "—"
    assert three[0]["comm_pct"] == "10.0" and three[2]["comm_pct"] == "not measured"
    assert [r["engine"] for r in rows if r["ranks"] == "1"] == ["DDP", "DeepSpeed ZeRO-2"]
    # one engine only: nothing to compare
    assert engine_rows({"device": "cpu", "cells": matrix["cells"][:2]}, runs) == []


def test_the_claims_ddp_row_uses_the_ddp_formula():
    eight = CLAIMS["eight_nodes"]
    row = claim_eight_nodes([])
    assert eight["engine"] in row["claim"]
    per_gpu = 16 * eight["parameters"] / GIB  # fp32 params + fp32 grads + AdamW moments, on every card
    assert f"{per_gpu:,.0f} GiB per GPU" in row["physics"] and "impossible as described" in row["verdict"]


ALONE_SCRIPT = """
import json, os, sys, tempfile
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import torch, torch.nn.functional as F, deepspeed
from pretrain_bench.train.engines.registry import DeepSpeedEngine, EngineRun
from pretrain_bench.train.engines import deepspeed_engine
from pretrain_bench.train.models.llama import build_model, resolve_shape
from pretrain_bench.train.settings import TrainSettings
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
TORCH_ADAM_STEP = torch.optim.Adam.step  # torch's own, before an engine here replaces it


def train(stage, mode):
    if mode == "real muon":  # DeepSpeed's own modules, in place of the stand-ins an earlier engine here installed
        for name in deepspeed_engine.MUON_MODULES:
            sys.modules.pop(name, None)
        deepspeed_engine.skip_muon_import = lambda: None
    if mode == "torch's wrappers":  # torch's optimizer step as torch ships it, dynamo's graph breaks included
        torch.optim.Adam.step = TORCH_ADAM_STEP
        deepspeed_engine.optimizers_without_dynamo = lambda: []
    settings = TrainSettings.from_config({"zero_stage": stage, "micro_batch_size": 2, "gpus": 1, "device": "cpu",
                                          "comm_backend": "gloo", "precision": "fp32", "max_steps": 4,
                                          "warmup_steps": 1})
    engine = DeepSpeedEngine(build_model(resolve_shape("tiny", {}, 512), 32, 1234, implementation="native"), settings,
                             EngineRun(device="cpu", total_steps=4, measure_comm=True, pin_memory=True, reshape=False))
    skipped = not engine.engine.enable_backward_allreduce
    if mode == "reduce":
        engine.engine.enable_backward_allreduce = True
    batches = torch.randint(0, 512, (4, 2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for batch in batches:
        loss = F.cross_entropy(engine(input_ids=batch[:, :-1]).logits.reshape(-1, 512), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if mode == "as built":  # a checkpoint saved and loaded back: the optimizer's state_dict and load_state_dict
        with tempfile.TemporaryDirectory() as folder:
            engine.engine.save_checkpoint(folder, tag="step4")
            engine.engine.load_checkpoint(folder, tag="step4")
    adamw = engine.engine.basic_optimizer  # the torch optimizer under DeepSpeed's wrapper
    return {"skipped": skipped, "losses": losses, "compile_fx": "torch._inductor.compile_fx" in sys.modules,
            "dynamo": "torch._dynamo" in sys.modules, "skipped_wrappers": deepspeed_engine.optimizers_without_dynamo(),
            "optimizer": [type(adamw).__name__, adamw.defaults["fused"], adamw.defaults["foreach"]]}


# in this order: the real Muon modules (which load inductor's compiler and dynamo) and torch's wrappers come last
runs = [(0, "as built"), (0, "reduce"), (2, "as built"), (2, "real muon"), (2, "torch's wrappers")]
print(json.dumps({f"{stage} {mode}": train(stage, mode) for stage, mode in runs}))
"""


@pytest.fixture(scope="module")
def alone():
    """4 steps of the tiny model (the native class: transformers' imports dynamo) on one rank, DeepSpeed ZeRO-0 as
    built and with its backward all-reduce forced on, then ZeRO-2 as built, with DeepSpeed's real Muon modules and
    with torch's own optimizer step (which optimizers_without_dynamo replaces), one engine after the other in one
    fresh interpreter (ALONE_SCRIPT), each one as built then saving a checkpoint and loading it back: each one's
    losses and what the interpreter had loaded by its end, by "<stage> <mode>"."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "workflow_scripts")}
    proc = subprocess.run([sys.executable, "-c", ALONE_SCRIPT, "29711"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_zero0_alone_skips_deepspeeds_self_all_reduce_and_trains_the_same(alone):
    """At world size 1 the all-reduce of ZeRO-0's backward is off (bench/bench_trainer.py measures the gain), and the
    losses are those of the same steps with it on, bit for bit."""
    runs = {mode: alone[f"0 {mode}"] for mode in ("as built", "reduce")}
    assert runs["as built"]["skipped"] is True
    assert runs["as built"]["optimizer"] == ["AdamW", True, None]  # torch's fused kernel (TORCH_ADAMW_KWARGS)
    assert runs["as built"]["losses"] == runs["reduce"]["losses"] and len(set(runs["reduce"]["losses"])) == 4


def test_zero2_runs_without_deepspeeds_muon_modules_and_trains_the_same(alone):
    """DeepSpeed's ZeRO-1/2 reduction imports its Muon modules, whose torch.compile loads inductor's compiler (about
    0.9 s per rank); an AdamW run gets stand-ins (engines.deepspeed_engine.skip_muon_import), and its losses are
    those with the real modules, bit for bit. Inductor's compiler is not loaded until the real modules are (the
    ZeRO-0 engines before them in the interpreter load it neither)."""
    runs = {mode: alone[f"2 {mode}"] for mode in ("as built", "real muon")}
    assert runs["as built"]["compile_fx"] is False and runs["real muon"]["compile_fx"] is True
    assert runs["as built"]["optimizer"] == ["AdamW", True, None]  # fused, on ZeRO-2's flat fp32 partition too
    assert runs["as built"]["losses"] == runs["real muon"]["losses"] and len(set(runs["as built"]["losses"])) == 4


def test_eager_deepspeed_ranks_never_import_dynamo_and_train_the_same(alone):
    """With train.compile off, a DeepSpeed engine's optimizer skips torch's dynamo wrappers
    (deepspeed_engine.optimizers_without_dynamo): ZeRO-0 and ZeRO-2 engines built, stepped, saved and loaded back
    import no torch._dynamo. The steps give the losses of torch's own optimizer step, bit for bit; the real Muon
    modules are what imports dynamo first here (so the check can fail)."""
    assert [alone[f"{stage} {mode}"]["dynamo"] for stage, mode in
            ((0, "as built"), (0, "reduce"), (2, "as built"), (2, "real muon"))] == [False, False, False, True]
    assert alone["2 torch's wrappers"]["losses"] == alone["2 as built"]["losses"]
    assert alone["2 torch's wrappers"]["optimizer"] == ["AdamW", True, None]
    # every wrapper of the pinned torch is recognised: a torch that reshapes them loses the start-up, not the bits
    assert alone["2 as built"]["skipped_wrappers"] == ["Optimizer.add_param_group", "Optimizer.zero_grad",
                                                       "Optimizer.state_dict", "Optimizer.load_state_dict", "Adam.step"]


DDP_ALONE_SCRIPT = """
import json, os, sys
from datetime import timedelta
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from pretrain_bench.train.engines.registry import EngineRun
from pretrain_bench.train.engines.ddp import DDPEngine
from pretrain_bench.train.models.llama import build_model, resolve_shape
from pretrain_bench.train.settings import TrainSettings
torch.set_num_threads(1)
DDPEngine.init_distributed("gloo", timedelta(minutes=5))


class Wrapped(DDPEngine):  # DistributedDataParallel at one rank too, as DDPEngine wraps more ranks
    alone = staticmethod(lambda: False)


def train(engine_class):
    settings = TrainSettings.from_config({"engine": "ddp", "zero_stage": 0, "micro_batch_size": 2,
                                          "grad_accum_steps": 2, "gpus": 1, "device": "cpu", "comm_backend": "gloo",
                                          "precision": "fp32", "max_steps": 3, "warmup_steps": 1})
    engine = engine_class(build_model(resolve_shape("tiny", {}, 512), 32, 1234, implementation="native"), settings,
                          EngineRun(device="cpu", total_steps=3, measure_comm=True, pin_memory=False, reshape=False))
    batches = torch.randint(0, 512, (6, 2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for batch in batches:  # 3 steps of 2 micro-steps
        loss = F.cross_entropy(engine(input_ids=batch[:, :-1]).logits.reshape(-1, 512), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"wrapped": isinstance(engine.model, DistributedDataParallel), "losses": losses,
            "keys": sorted(engine.module.state_dict()) == sorted(engine.model.state_dict()),
            "comm_ms": engine.comm_ms()}


print(json.dumps({"alone": train(DDPEngine), "wrapped": train(Wrapped)}))
"""


def test_ddp_alone_trains_the_model_unwrapped_to_the_wrappers_losses():
    """At world size 1 DDPEngine trains the model itself, not a DistributedDataParallel around it (README, "The
    trainer against a hand-written loop"): 3 steps of 2 accumulated micro-steps give the wrapper's losses bit for bit,
    and nothing was all-reduced."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow_scripts")}
    proc = subprocess.run([sys.executable, "-c", DDP_ALONE_SCRIPT, "29713"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["alone"]["wrapped"] is False and runs["wrapped"]["wrapped"] is True
    assert runs["alone"]["keys"] is True  # the model's own names: what a checkpoint of either holds
    assert runs["alone"]["comm_ms"] == 0 and runs["wrapped"]["comm_ms"] > 0
    assert runs["alone"]["losses"] == runs["wrapped"]["losses"] and len(set(runs["alone"]["losses"])) == 6
