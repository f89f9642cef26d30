"""What is refused before anything is touched: a second run on a held state folder (its log kept), a resume point
beyond the run's steps, a warm-up that never ends, a run name with a newline, a JSON file that is no tokenizer; and a
failed download that leaves no .part or lock file behind."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from httpfixture import FixtureServer, Route
from pretrain_bench.bench.matrix import BenchSettings, cells
from pretrain_bench.config.schema import ModelSettings
from pretrain_bench.data.download import DownloadError, download
from pretrain_bench.data.tokenizer import adopt_tokenizer, load_tokenizer
from pretrain_bench.train import state_lock
from pretrain_bench.train.checkpoints.files import CheckpointError
from pretrain_bench.train.plan import Plan, RunPaths, cell_settings
from pretrain_bench.train.settings import ConfigError, TrainSettings, check_settings
from support import bare_plan_config, tiny_config

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pretrain_bench.train import state_lock
lock = state_lock.acquire({state!r})
print("locked", flush=True)
time.sleep(120)
"""


def test_second_launch_is_refused_before_any_rank_and_leaves_the_running_log_alone(tmp_path):
    state = tmp_path / "results" / "run" / "state"
    train = TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", warmup_steps=0)
    plan = tmp_path / "plan.json"
    Plan(name="run", role="pretrain", config=bare_plan_config(train), device_request="cpu", train=train,
         model=ModelSettings(preset="tiny"), init_from=None, data_sha256="0" * 64,
         paths=RunPaths(index="", tokenizer="", out_dir="", state_dir=str(state), manifest=None),
         resume=True, save_checkpoints=True, peak_tflops=None, peak=None, measure_comm=True,
         memory_fit={}).to_json(plan)
    # The first run: a real process holding the lock, with its log under the rule's declared name.
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(scripts=str(ROOT / "workflow_scripts"),
                                                                 state=str(state))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        log = tmp_path / "logs" / "run" / "pretrain.log"
        log.parent.mkdir(parents=True)
        log.write_text("step 1/60 loss 8.3\nstep 2/60 loss 8.1\n")
        running = log.stat().st_ino
        started = time.monotonic()
        second = subprocess.run([sys.executable, str(ROOT / "workflow_scripts" / "launch.py"), "--ranks", "1",
                                 "--plan", str(plan), "--log", str(log)], capture_output=True, text=True,
                                timeout=120)
        elapsed = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 2
    # On the terminal (stderr is not redirected), naming the holder and the folder.
    assert f"another training run (pid {holder.pid}, started at " in second.stderr
    assert f"holds {state}: two runs must never write the same checkpoints" in second.stderr
    assert "launch:" not in second.stderr + second.stdout, "no torchrun, no rank started"
    assert elapsed < 60
    # The running run's log keeps every line; the refused attempt has its own file, which the declared name shows.
    attempts = sorted((log.parent / "pretrain.attempts").iterdir())
    assert len(attempts) == 1 and "attempt refused" in attempts[0].read_text()
    assert f"pid {holder.pid}" in log.read_text() and log.stat().st_ino != running
    assert not (state / "checkpoints").exists()


def test_state_lock_is_free_again_once_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(scripts=str(ROOT / "workflow_scripts"),
                                                                 state=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(state_lock.StateInUse, match=f"pid {holder.pid}"):
        state_lock.acquire(tmp_path)
    holder.kill()  # kill -9: the kernel releases the flock
    holder.wait()
    lock = state_lock.acquire(tmp_path)
    assert json.loads((tmp_path / state_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.close()


def test_a_resume_point_beyond_the_last_step_is_refused_naming_both(tmp_path):
    from pretrain_bench.train.checkpoints.checkpointer import check_resume_point

    settings = TrainSettings(gpus=3, max_steps=100, warmup_steps=10, micro_batch_size=8)
    check_resume_point(100, settings, 128, tmp_path)  # the end of the same run: nothing left to do, allowed
    with pytest.raises(CheckpointError) as caught:
        check_resume_point(260, settings, 128, tmp_path)
    message = str(caught.value)
    assert f"checkpoint {tmp_path / 'step260'} is at step 260, beyond this run's last step 100" in message
    assert "train.max_steps 100" in message and "Set train.max_steps to at least 260" in message
    assert f"move {tmp_path} away" in message
    tokens = TrainSettings(gpus=3, max_tokens=24 * 128 * 50, warmup_steps=10, micro_batch_size=8)
    with pytest.raises(CheckpointError, match=r"last step 50 \(train.max_tokens 153,600 = 50 steps of 3,072 "
                                              r"tokens\).*train.max_tokens to at least 798,720"):
        check_resume_point(260, tokens, 128, tmp_path)


def test_warmup_must_end_before_the_last_step():
    base = dict(gpus=1, device="cpu", comm_backend="gloo", precision="fp32")
    with pytest.raises(ConfigError, match="train.warmup_steps 100 is not below train.max_steps 100"):
        check_settings(TrainSettings(**base, max_steps=100, warmup_steps=100))
    with pytest.raises(ConfigError, match=r"train.warmup_steps 10 is not below the 5 steps of train.max_tokens"):
        check_settings(TrainSettings(**base, max_tokens=5 * 8 * 128, warmup_steps=10), seq_len=128)
    check_settings(TrainSettings(**base, max_steps=1, warmup_steps=0))  # 0: no warm-up at all
    check_settings(TrainSettings(**base, max_steps=100, warmup_steps=99))
    # The tiny config and every benchmark cell (benchmark.steps 8 < train.warmup_steps 10) still pass: a cell's
    # warm-up is shortened to end before its last step.
    config = tiny_config("tiny-cpu")
    check_settings(TrainSettings.from_config(config["train"]), seq_len=config["model"]["seq_len"])
    bench = BenchSettings.from_config(config)
    for cell in cells(bench):
        if cell.comm_backend == "nccl":
            continue  # left out on CPU for another reason
        settings = cell_settings(TrainSettings.from_config(config["train"]), cell.train_overrides(bench))
        check_settings(settings, seq_len=128)
        assert settings.max_steps == 8 and settings.warmup_steps == 7


def test_run_name_with_a_newline_or_control_character_is_rejected():
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())["properties"]["name"]
    jsonschema.validate("tiny-cpu", schema)
    jsonschema.validate("run_2.b", schema)
    for bad in ("tiny\n", "tiny\r\n", "ti\nny", "tiny\t", "tiny\x00", "-tiny", "tiny/../x", ""):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_json_that_is_not_a_tokenizer_names_the_file_and_what_it_must_hold(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"vocab": {"a": 0}, "merges": []}))
    for load in (adopt_tokenizer, load_tokenizer):
        with pytest.raises(ValueError) as caught:
            load(path if load is adopt_tokenizer else tmp_path)
        message = str(caught.value)
        assert message.startswith(f"{path} is not a tokenizer file (")
        assert '"model" (type, vocab and merges)' in message and "Tokenizer.save" in message


def test_failed_download_leaves_no_part_and_no_lock(tmp_path):
    body = os.urandom(1 << 20)
    # The body drops halfway and no retry is allowed: a .part with half the bytes existed when it failed.
    with FixtureServer({"/data.bin": Route(body, drop_first=True)}) as server:
        with pytest.raises(DownloadError, match="giving up after 1 attempts"):
            download(server.url("/data.bin"), tmp_path / "data.bin", retries=0, backoff_s=0.01,
                     connect_timeout_s=2, read_timeout_s=5)
    assert list(tmp_path.iterdir()) == []
    with FixtureServer({}) as server:  # a 404
        with pytest.raises(DownloadError, match="404"):
            download(server.url("/missing.bin"), tmp_path / "missing.bin", retries=0)
    assert list(tmp_path.iterdir()) == []
    # and the next download into the same cache works, locking a fresh lock file
    with FixtureServer({"/data.bin": Route(body)}) as server:
        download(server.url("/data.bin"), tmp_path / "data.bin", retries=0)
    assert (tmp_path / "data.bin").read_bytes() == body


# --- train.deepspeed: every spelling that changes what trains is refused, naming the key to use ---------------------

def _deepspeed_sees(extra: dict) -> dict:
    """What DeepSpeed 0.19.8's own config parser makes of the pipeline's ds_config with `extra` merged in (one rank,
    fp32, ZeRO-2, micro-batch 2 × accumulation 2): precision, ZeRO stage, offload, optimizer, batch, clipping."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from pretrain_bench.train.engines.spec import _merge, deepspeed_config

    settings = TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", zero_stage=2,
                             micro_batch_size=2, grad_accum_steps=2)
    parsed = DeepSpeedConfig(_merge(deepspeed_config(settings, "cpu", 10), extra))
    zero = parsed.zero_config
    return {"bf16": parsed.bfloat16_config.enabled, "fp16": parsed.float16_config.enabled,
            "autocast": parsed.torch_autocast_enabled, "stage": int(parsed.zero_optimization_stage),
            "offload": (zero.offload_optimizer is not None, zero.offload_param is not None),
            "optimizer": (parsed.optimizer_name, parsed.zero_allow_untested_optimizer,
                          parsed.zero_force_ds_cpu_optimizer, parsed.scheduler_name),
            "batch": (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
                      parsed.gradient_accumulation_steps, parsed.managed_gradient_accumulation),
            "grad": (parsed.gradient_clipping, parsed.gradient_allreduce_op, parsed.grad_accum_dtype,
                     parsed.param_dtype)}


# (train.deepspeed, the key the refusal names, the pipeline key it points to). Each changes what DeepSpeed runs (the
# first test proves it with DeepSpeed's own parser), so the summary would describe another run.
CHANGING = [
    ({"bf16": {"enabled": True}}, "bf16", "train.precision"),
    ({"bfloat16": {"enabled": True}}, "bfloat16", "train.precision: bf16"),
    ({"fp16": {"enabled": True}}, "fp16", "train.precision"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast", "train.precision"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types", "train.precision"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "train.zero_stage"),
    ({"zero_optimization": {"cpu_offload": True}}, "zero_optimization.cpu_offload", "train.offload_optimizer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer",
     "train.offload_optimizer"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer", "train.lr"),
    ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer", "train.lr"),
    ({"zero_force_ds_cpu_optimizer": False}, "zero_force_ds_cpu_optimizer", "train.offload_optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler", "train.lr_schedule"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 4}, "train_batch_size", "train.global_batch_size"),
    ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8}, "train_micro_batch_size_per_gpu",
     "train.micro_batch_size"),
    ({"gradient_accumulation_steps": 1, "train_batch_size": 2}, "gradient_accumulation_steps",
     "train.grad_accum_steps"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation", "train.grad_accum_steps"),
    ({"gradient_clipping": 0.0}, "gradient_clipping", "train.grad_clip"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", None),  # None: no key replaces it
]


@pytest.mark.parametrize("extra,key,use", CHANGING, ids=[c[1] for c in CHANGING])
def test_deepspeed_keys_that_change_what_trains_are_refused_naming_the_key_to_use(extra, key, use):
    assert _deepspeed_sees(extra) != _deepspeed_sees({}), f"DeepSpeed reads {key}: it changes what runs"
    settings = TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", deepspeed=extra)
    with pytest.raises(ConfigError) as caught:
        check_settings(settings)
    message = str(caught.value)
    assert message.startswith("train.deepspeed sets what the pipeline owns: ")
    assert (f"train.deepspeed.{key}: set {use}" if use else f"train.deepspeed.{key}: remove it (") in message


def test_zero_optimization_as_a_switch_or_a_number_is_refused_not_run_as_stage_one():
    assert _deepspeed_sees({"zero_optimization": True})["stage"] == 1, "DeepSpeed's old switch: ZeRO-1, not 2"
    for value, spelled in ((True, "true"), (False, "false"), (2, "2"), ("2", '"2"')):
        settings = TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", zero_stage=2,
                                 deepspeed={"zero_optimization": value})
        with pytest.raises(ConfigError, match=rf"train.deepspeed.zero_optimization: {spelled} is not a mapping "
                                              r"\(DeepSpeed reads true as ZeRO stage 1\): set train.zero_stage"):
            check_settings(settings)


def test_the_deprecated_and_parallel_layout_keys_are_refused_too():
    for extra, key, fix in (
            ({"amp": {"enabled": True}}, "amp", "set train.precision"),
            ({"zero_optimization": {"cpu_offload_param": True}}, "zero_optimization.cpu_offload_param",
             "set train.offload_param"),
            ({"zero_optimization": {"cpu_offload_use_pin_memory": True}},
             "zero_optimization.cpu_offload_use_pin_memory", "set train.offload_optimizer"),
            ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow",
             "remove it (ZenFlow skips"),
            ({"sequence_parallel_size": 2}, "sequence_parallel_size", "remove it (the pipeline trains data-parallel"),
            ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel", "remove it (the pipeline trains"),
            ({"expert_parallel": {"enabled": True}}, "expert_parallel", "remove it (the pipeline trains"),
            ({"checkpoint": {"load_universal": True}}, "checkpoint", "set train.allow_reshape"),
            ({"comms_logger": {"enabled": False}}, "comms_logger", "remove it (the pipeline's communication")):
        settings = TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", deepspeed=extra)
        with pytest.raises(ConfigError) as caught:
            check_settings(settings)
        assert f"train.deepspeed.{key}: {fix}" in str(caught.value)


def test_tuning_keys_pass_and_leave_precision_stage_optimizer_and_batch_as_configured():
    tuning = {"zero_optimization": {"reduce_bucket_size": 1000, "allgather_bucket_size": 1000,
                                    "stage3_prefetch_bucket_size": 1000},
              "communication_data_type": "fp32", "flops_profiler": {"enabled": False},
              "csv_monitor": {"enabled": False}, "wall_clock_breakdown": False}
    check_settings(TrainSettings(gpus=1, device="cpu", comm_backend="gloo", precision="fp32", deepspeed=tuning))
    assert _deepspeed_sees(tuning) == _deepspeed_sees({})
    # the schema's description names the spellings refused
    description = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())[
        "properties"]["train"]["properties"]["deepspeed"]["description"]
    for key in ("bfloat16", "torch_autocast", "data_types", "zero_optimization: true"):
        assert key in description


RAN_SCRIPT = """
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed
from pretrain_bench.train.engines.registry import DeepSpeedEngine, EngineRun
from pretrain_bench.train.models.llama import build_model, resolve_shape
from pretrain_bench.train.settings import TrainSettings
deepspeed.init_distributed(dist_backend="gloo")


def ran(extra):
    # what the refusals stop at plan time (train.deepspeed), forced past them here by building the settings
    # directly: the engine merges it into its ds_config and reports what DeepSpeed parsed
    settings = TrainSettings.from_config({"zero_stage": 2, "micro_batch_size": 2, "grad_accum_steps": 3, "gpus": 1,
                                          "device": "cpu", "comm_backend": "gloo", "precision": "fp32",
                                          "max_steps": 4, "warmup_steps": 1, "deepspeed": extra})
    engine = DeepSpeedEngine(build_model(resolve_shape("tiny", {}, 512), 32, 1234), settings,
                             EngineRun(device="cpu", total_steps=4, measure_comm=True, pin_memory=True,
                                       reshape=False))
    return engine.ran()


print(json.dumps([ran(extra) for extra in json.loads(sys.argv[2])]))
"""


def test_the_summary_fields_are_read_back_from_the_engine_that_ran():
    """summary.json's precision, zero_stage and batch come from DeepSpeed's parsed config (DeepSpeedEngine.ran),
    so a key that got past the refusals shows as it ran, not as train.* says. Both engines are built one after the
    other in one fresh interpreter (RAN_SCRIPT)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "workflow_scripts")}
    extras = [{}, {"bfloat16": {"enabled": True}, "zero_optimization": True}]
    proc = subprocess.run([sys.executable, "-c", RAN_SCRIPT, "29721", json.dumps(extras)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    as_asked, forced = json.loads(proc.stdout.strip().splitlines()[-1])
    assert as_asked == {"precision": "fp32", "zero_stage": 2, "micro_batch_size": 2, "grad_accum_steps": 3,
                        "global_batch_size": 6}
    assert forced["precision"] == "bf16" and forced["zero_stage"] == 1


def _expert_parallel_config(model: dict | None = None, **train) -> dict:
    """The tiny config with tiny-moe (8 routed experts) native under DDP on 2 ranks, train.expert_parallel 2, and
    `model` / `train` changes."""
    config = tiny_config("ep")
    config["model"].update({"preset": "tiny-moe", "implementation": "native", **(model or {})})
    config["train"].update({"engine": "ddp", "zero_stage": 0, "gpus": 2, "expert_parallel": 2, **train})
    return config


@pytest.mark.parametrize("model, train, refusal", [
    ({"preset": "tiny"}, {}, r"train.expert_parallel 2 needs a model with routed experts, and model.preset tiny "
                             r"\(LLaMA\) has none"),
    ({"implementation": "transformers"}, {}, "train.expert_parallel 2 needs model.implementation native"),
    ({"overrides": {"n_routed_experts": 6, "n_group": 1, "topk_group": 1}}, {"expert_parallel": 4, "gpus": 4},
     r"train.expert_parallel 4 does not divide the 6 routed experts per layer of model.preset tiny-moe \(model."
     "overrides n_routed_experts"),
    ({}, {"gpus": 3}, r"train.expert_parallel 2 does not divide the 3 ranks \(train.gpus 3 × train.nodes 1\)"),
    ({}, {"precision": "fp16", "device": "cuda", "comm_backend": "nccl"},
     "train.expert_parallel 2 does not run with train.precision fp16"),
    ({}, {"engine": "deepspeed", "zero_stage": 2},
     r"train.expert_parallel 2 under train.engine deepspeed trains without the sequence-wise balance loss "
     r"\(DeepSpeed's AutoEP layer has none\), and model.preset tiny-moe has model.overrides aux_loss_alpha 0.0001: "
     "set it to 0"),
    ({"overrides": {"aux_loss_alpha": 0, "force_balanced": True}}, {"engine": "deepspeed", "zero_stage": 2},
     "train.expert_parallel 2 under train.engine deepspeed cannot force balanced routing"),
    ({"overrides": {"aux_loss_alpha": 0, "bias_update_rate": 0, "scoring_func": "softmax", "topk_method": "greedy",
                    "hf_model_type": None}},
     {"engine": "deepspeed", "zero_stage": 2},
     "train.expert_parallel 2 under train.engine deepspeed takes DeepSeek-V3's sigmoid router"),
    ({"overrides": {"aux_loss_alpha": 0}}, {"engine": "deepspeed", "zero_stage": 0},
     r"train.expert_parallel 2 under train.engine deepspeed needs train.zero_stage 1, 2 or 3"),
    ({"overrides": {"aux_loss_alpha": 0}}, {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu",
                                            "device": "cuda", "comm_backend": "nccl"},
     "train.expert_parallel 2 under train.engine deepspeed does not run with train.offload_optimizer"),
])
def test_expert_parallelism_is_refused_at_planning_naming_the_keys(model, train, refusal):
    from pretrain_bench.workflow.experiment import Config

    with pytest.raises(ConfigError, match=refusal):
        Config.from_config(_expert_parallel_config(model, **train))


def test_expert_parallel_one_plans_every_model_and_engine_and_two_plans_every_engine():
    from pretrain_bench.workflow.experiment import Config

    assert Config.from_config(_expert_parallel_config()).train.expert_parallel == 2
    assert Config.from_config(_expert_parallel_config(engine="fsdp", zero_stage=3)).train.expert_parallel == 2
    assert Config.from_config(_expert_parallel_config({"overrides": {"aux_loss_alpha": 0}}, engine="deepspeed",
                                                      zero_stage=3)).train.expert_parallel == 2
    for engine, stage in (("ddp", 0), ("fsdp", 3), ("deepspeed", 2)):
        Config.from_config(_expert_parallel_config({"preset": "tiny"}, expert_parallel=1, engine=engine,
                                                   zero_stage=stage))
