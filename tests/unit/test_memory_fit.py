"""train.memory_fit: the ordered ladder of changes that keep model, precision and global batch, and its record."""
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pretrain_bench.core import devices
from pretrain_bench.train.engines.spec import deepspeed_config
from pretrain_bench.train.memory import model as memory_model
from pretrain_bench.train.memory.fit import describe, fit_run, ladder
from pretrain_bench.train.memory.model import GIB, Budget, estimate, run_shape
from pretrain_bench.train.plan import make_plan
from pretrain_bench.train.settings import ConfigError, TrainSettings
from pretrain_bench.workflow.experiment import load_config, plan_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])


def default_config(**benchmark):
    config = load_config(ROOT / "config.yaml")
    config["benchmark"].update(benchmark)
    return config


def settings_of(config, **train):
    return TrainSettings.from_config({**config["train"], **train})


def test_default_experiment_runs_zero2_offload_with_activation_checkpointing_on_the_articles_box(no_gpu):
    config = default_config()  # no GPU here: plans for 3 × 24 GiB, 128 GiB RAM, 1800 GiB disk (config.yaml)
    chosen, record = fit_run(plan_config(config), settings_of(config))
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (2, "cpu", "none")
    assert chosen.activation_checkpointing and chosen.precision == "fp16"
    assert chosen.derived_global_batch == 24 and chosen.micro_batch_size == 8
    assert record["asked"]["offload_optimizer"] == "none" and not record["asked_fits"]
    assert record["changed"] == {"offload_optimizer": ["none", "cpu"], "activation_checkpointing": [False, True]}
    assert record["summary"].startswith("asked ZeRO-2, micro-batch 8 × 1 accumulation; ran ZeRO-2 + CPU optimizer "
                                        "offload + activation checkpointing")
    # why: plain ZeRO-2 does not fit; every figure of the articles' box is assumed (no GPU here)
    assert "needs 55.2 GiB per GPU, has 24.0 GiB (assumed)" in record["summary"]
    assert ("the choice needs 22.6 GiB per GPU, has 24.0 GiB (assumed); host RAM 124.2 GiB for 3 ranks, has 128.0 GiB "
            "(assumed)") in record["summary"]
    tried = {t["label"].split(", micro-batch")[0] + (" mb1" if "micro-batch 1 " in t["label"] else ""): t
             for t in record["tried"]}
    # plain ZeRO-3 partitions 16Ψ over three GPUs: more than 24 GiB each
    assert not tried["ZeRO-3"]["fits"] and "needs 43.6 GiB per GPU" in tried["ZeRO-3"]["text"]
    # ZeRO-2 + CPU offload alone keeps 2Ψ, the activations and the LM head's fp64/fp32 norm copies on the GPU
    assert "needs 27.5 GiB per GPU" in tried["ZeRO-2 + CPU optimizer offload"]["text"]
    # ZeRO-3 + CPU offload: 18Ψ/N host states + fp16's overflow check (3Ψ/N) + 2 GiB per rank process, × 3 ranks
    assert "host RAM 141.2 GiB for 3 ranks, has 128.0 GiB" in tried["ZeRO-3 + CPU optimizer offload"]["text"]
    # ZeRO-Infinity still holds the largest sub-group's fp32 gradients (× N), 4 swap buffers, the flat gradient
    # buffer and the overflow check on the host
    nvme = tried["ZeRO-3 + NVMe parameter offload + NVMe optimizer offload"]
    assert "host RAM 135.7 GiB for 3 ranks, has 128.0 GiB" in nvme["text"] and not nvme["fits"]
    assert [t["fits"] for t in record["tried"]][-1] and not any(t["fits"] for t in record["tried"][:-1])
    assert record["fits"] and record["budget"]["host_bytes"] == 128 * GIB


def test_bf16_fits_zero3_with_cpu_optimizer_offload_on_the_articles_box(no_gpu):
    # no overflow check in bf16: the largest host transient is one gradient partition cast to fp32
    config = default_config()
    chosen, record = fit_run(plan_config(config), settings_of(config, precision="bf16"))
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (3, "cpu", "none")
    assert "host RAM 123.4 GiB for 3 ranks, has 128.0 GiB" in record["text"]


def gpu_box(monkeypatch, host_gib=128):
    """This machine is the GPU machine: 3 × 24 GiB detected, its RAM and disk measured."""
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [24 * GIB] * 3)
    monkeypatch.setattr(memory_model, "host_memory_bytes", lambda: host_gib * GIB)
    monkeypatch.setattr(memory_model, "free_disk_bytes", lambda path: 1800 * GIB)


def nvme_ready(monkeypatch, libaio: bool, cuda_home: str | None):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from torch.utils import cpp_extension

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: libaio)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)


def test_nvme_rung_is_taken_when_its_prerequisites_are_here(monkeypatch):
    gpu_box(monkeypatch, host_gib=138)  # room for ZeRO-Infinity's host side, not for ZeRO-3's CPU offload
    nvme_ready(monkeypatch, libaio=True, cuda_home="/usr/local/cuda")
    config = default_config()
    chosen, record = fit_run(plan_config(config), settings_of(config), nvme_path="/fast/nvme")
    assert (chosen.offload_optimizer, chosen.offload_param) == ("nvme", "nvme")
    assert "not checked" not in record["summary"] and "skipped" not in json.dumps(record["tried"])


@pytest.mark.parametrize("libaio,cuda_home,reason", [
    (False, "/usr/local/cuda", "libaio, which DeepSpeed's async_io op needs"),
    (True, None, "a CUDA toolkit to build that op (set CUDA_HOME"),
])
def test_nvme_rung_is_skipped_without_libaio_or_toolkit(monkeypatch, libaio, cuda_home, reason):
    gpu_box(monkeypatch, host_gib=138)
    nvme_ready(monkeypatch, libaio=libaio, cuda_home=cuda_home)
    config = default_config()
    chosen, record = fit_run(plan_config(config), settings_of(config), nvme_path="/fast/nvme")
    # the NVMe rung is listed among those tried, with the reason, and the ladder goes on to the next rung
    nvme = next(t for t in record["tried"] if "NVMe" in t["label"])
    assert nvme["text"].startswith("skipped: NVMe offload needs ") and reason in nvme["text"]
    assert not nvme["fits"] and "nvme" not in (chosen.offload_optimizer, chosen.offload_param)
    assert chosen.activation_checkpointing or chosen.micro_batch_size < 8


def test_refusal_names_the_missing_nvme_prerequisite(monkeypatch):
    gpu_box(monkeypatch, host_gib=32)  # too little RAM for any rung that keeps states on the host
    nvme_ready(monkeypatch, libaio=False, cuda_home=None)
    config = default_config()
    with pytest.raises(ConfigError) as error:
        fit_run(plan_config(config), settings_of(config), nvme_path="/fast/nvme")
    tried = str(error.value).split("auto tried, in order:")[1]
    line = next(line for line in tried.splitlines() if "NVMe parameter offload + NVMe optimizer offload, micro-batch 8"
                in line)
    assert "skipped: NVMe offload needs libaio" in line and "and a CUDA toolkit" in line
    assert not line.endswith("[does not fit]")


def test_strict_stops_with_the_figures(no_gpu):
    config = default_config()
    with pytest.raises(ConfigError, match="pre-flight: the main run is predicted not to fit: needs 55.2 GiB"):
        fit_run(plan_config(config), settings_of(config, memory_fit="strict"), what="the main run")


def test_host_ram_between_nvme_and_cpu_offload_takes_nvme(no_gpu):
    # 138 GiB of RAM: ZeRO-3's CPU offloads (141 GiB and more for 3 ranks) do not fit, ZeRO-Infinity (136) does
    config = default_config(host_memory_gib=138)
    chosen, record = fit_run(plan_config(config), settings_of(config), nvme_path="/fast/nvme")
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (3, "nvme", "nvme")
    assert [t["fits"] for t in record["tried"]] == [False, False, False, False, True]
    assert "host RAM 141.2 GiB for 3 ranks, has 138.0 GiB" in record["tried"][2]["text"]
    assert "NVMe" in record["text"] and record["disk_need_bytes"] > 0
    ds = deepspeed_config(chosen, "cuda", 10)["zero_optimization"]
    assert ds["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/fast/nvme"}
    assert ds["offload_optimizer"]["device"] == "nvme"


def test_nothing_fits_lists_what_was_tried(no_gpu):
    # NVMe needs ~90 GiB of disk for 7B's offloaded states on 3 ranks; 50 GiB free is not enough
    config = default_config(host_memory_gib=100, disk_gib=50)
    with pytest.raises(ConfigError) as error:
        fit_run(plan_config(config), settings_of(config), nvme_path="/fast/nvme")
    message = str(error.value)
    assert "train.memory_fit: auto tried, in order:" in message
    tried = message.split("auto tried, in order:")[1]
    assert "NVMe optimizer offload" in tried and "has 50.0 GiB free" in tried
    assert "activation checkpointing" in tried and "micro-batch 1 × 8 accumulation" in tried


def test_the_ladder_keeps_precision_and_global_batch():
    asked = TrainSettings(gpus=3, device="cuda", zero_stage=2, precision="fp16", micro_batch_size=8)
    rungs = ladder(asked, "cuda")
    labels = [r.label for r in rungs]
    assert labels[:7] == [
        "ZeRO-3, micro-batch 8 × 1 accumulation",
        "ZeRO-2 + CPU optimizer offload, micro-batch 8 × 1 accumulation",
        "ZeRO-3 + CPU optimizer offload, micro-batch 8 × 1 accumulation",
        "ZeRO-3 + CPU parameter offload + CPU optimizer offload, micro-batch 8 × 1 accumulation",
        "ZeRO-3 + NVMe parameter offload + NVMe optimizer offload, micro-batch 8 × 1 accumulation",
        "ZeRO-2 + activation checkpointing, micro-batch 8 × 1 accumulation",
        "ZeRO-2, micro-batch 4 × 2 accumulation",
    ]
    assert all(r.settings.precision == "fp16" and r.settings.derived_global_batch == 24 for r in rungs)
    assert len(labels) == len(set(labels)) and describe(asked) not in labels
    # on CPU there is nothing to offload to: only recomputation and smaller micro-batches
    cpu = [r.label for r in ladder(replace(asked, device="cpu", precision="fp32"), "cpu")]
    assert not any("offload" in label for label in cpu) and "ZeRO-2, micro-batch 1 × 8 accumulation" in cpu


@pytest.mark.parametrize("device, engine, stage, offload_optimizer, offload_param, global_batch", [
    ("cuda", "deepspeed", 0, "none", "none", None), ("cuda", "deepspeed", 1, "cpu", "none", None),
    ("cuda", "deepspeed", 2, "none", "none", 48), ("cuda", "deepspeed", 3, "cpu", "cpu", None),
    ("cuda", "deepspeed", 3, "nvme", "none", None), ("cuda", "ddp", 0, "none", "none", 48),
    ("cuda", "fsdp", 3, "none", "none", None), ("cpu", "deepspeed", 2, "none", "none", None),
    ("cpu", "fsdp", 3, "none", "none", 48),
])
def test_every_rung_is_settings_that_pass_the_checks(device, engine, stage, offload_optimizer, offload_param,
                                                     global_batch):
    """What train.memory_fit chooses is checked no further (plan.make_plan): every rung passes check_settings."""
    from pretrain_bench.train.settings import check_settings

    asked = TrainSettings(gpus=3, device=device, engine=engine, zero_stage=stage, micro_batch_size=8,
                          grad_accum_steps=2, global_batch_size=global_batch, offload_optimizer=offload_optimizer,
                          offload_param=offload_param, precision="bf16",
                          comm_backend="nccl" if device == "cuda" else "gloo")
    check_settings(asked, device, seq_len=128)
    rungs = ladder(asked, device)
    assert rungs
    for rung in rungs:
        check_settings(rung.settings, device, seq_len=128)


def test_a_cpu_run_short_of_ram_recomputes_activations():
    config = load_config(ROOT / "config.yaml")
    config["model"] = {"preset": "llama-125m", "seq_len": 1024, "overrides": {}}
    asked = TrainSettings(gpus=2, device="cpu", comm_backend="gloo", precision="fp32", micro_batch_size=16)

    def need(s):  # both ranks share the host
        return 2 * estimate(run_shape(plan_config(config), s, "cpu", 32000)).per_rank

    # RAM just above what activation checkpointing needs, below what the asked run needs
    ram = int(need(replace(asked, activation_checkpointing=True)) * 1.01)
    assert ram < need(asked)
    chosen, record = fit_run(plan_config(config), asked, 32000, budget=Budget("cpu", ram, "test", ram, "test"))
    assert chosen.activation_checkpointing and chosen.micro_batch_size == 16
    assert record["changed"] == {"activation_checkpointing": [False, True]}
    # with less, the next rungs are smaller micro-batches with more accumulation (same global batch)
    ram = int(need(replace(asked, micro_batch_size=1, grad_accum_steps=16)) * 1.01)
    assert ram < need(replace(asked, activation_checkpointing=True))
    chosen, record = fit_run(plan_config(config), asked, 32000, budget=Budget("cpu", ram, "test", ram, "test"))
    assert not chosen.activation_checkpointing and chosen.micro_batch_size < 16
    assert chosen.derived_global_batch == asked.derived_global_batch
    assert need(chosen) <= ram and [t["fits"] for t in record["tried"]][-1] and record["tried"][0]["fits"] is False


def test_plan_records_asked_and_chosen(tmp_path, no_gpu):
    config = default_config()
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 102400, "splits": {"val": {"shards": [{"tokens": 10**7}]}}}))
    plan = make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "o",
                     state_dir=tmp_path / "state")
    assert plan.train.offload_optimizer == "cpu" and plan.memory_fit["asked"]["offload_optimizer"] == "none"
    assert plan.train.activation_checkpointing and not plan.memory_fit["asked"]["activation_checkpointing"]
    # a production CUDA run never pays for the comms logger's per-collective synchronisation
    assert plan.measure_comm is False
    assert plan.train.nvme_path == str(tmp_path / "state" / "nvme")  # the default: under the run's state
    # the plan records only the config a training run reads
    assert set(plan.config.as_dict()) == {"name", "model", "train", "tokenizer", "benchmark", "report"}
    assert "evaluate" not in plan.config.as_dict() and "corpus" not in plan.config.as_dict()


def word_level_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json with exactly `size` ids, EOS and pad among them (what a 32k LLaMA-style file holds)."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(size - 2)} | {"</s>": size - 2, "<pad>": size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return path.parent


def vocab_of(config: dict) -> int:
    plan = plan_config(config)
    return memory_model.config_vocab_size(plan.tokenizer, plan.model)


def test_an_adopted_tokenizer_sets_the_vocabulary_the_plan_uses(tmp_path, no_gpu):
    config = default_config()  # tokenizer.vocab_size 102400 (DeepSeek's), larger than llama-125m's 32000
    config["model"]["preset"] = "llama-125m"
    config["tokenizer"]["path"] = str(word_level_tokenizer(tmp_path / "tokenizer.json", 32000))
    assert vocab_of(config) == 32000
    settings = settings_of(config)
    shape = run_shape(plan_config(config), settings, "cuda")
    assert shape.vocab_size == 32000  # planned with the adopted tokenizer, not tokenizer.vocab_size
    # a smaller tokenizer: the preset's own 32000 rows still win
    (tmp_path / "small").mkdir()
    config["tokenizer"]["path"] = str(word_level_tokenizer(tmp_path / "small" / "tokenizer.json", 500))
    assert vocab_of(config) == 500
    assert run_shape(plan_config(config), settings, "cuda").vocab_size == 32000
    # and the preset that takes the tokenizer's size follows it
    config["model"]["preset"] = "tiny"
    assert run_shape(plan_config(config), settings, "cuda").vocab_size == 500
    config["tokenizer"]["path"] = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="tokenizer.path .*missing.json"):
        vocab_of(config)


BUILD_RSS = """
import json, sys, threading
from pretrain_bench.train.models.llama import build_model, llama_config, resolve_shape

def anon():  # anonymous resident memory only: library code paged in on first use is file-backed and not counted
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

shape = resolve_shape("llama-125m", {}, 32000)
# a first, tiny build loads everything transformers imports lazily, so the baseline holds it all
build_model(resolve_shape("tiny", {}, 256), 16, seed=0, precision="bf16", device="cpu")
llama_config(shape, 128)
import gc; gc.collect()
before = anon()
peak, done = [before], threading.Event()

def sample():  # the peak of anonymous memory while the model is built (ru_maxrss would count file pages too)
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        done.wait(0.001)

sampler = threading.Thread(target=sample)
sampler.start()
model = build_model(shape, 128, seed=1, precision="bf16", device="cpu")
done.set()
sampler.join()
print(json.dumps({"grown": max(peak[0], anon()) - before}))
"""


def test_building_a_bf16_model_takes_one_bf16_copy_as_the_memory_model_says():
    import subprocess

    out = subprocess.run([sys.executable, "-c", BUILD_RSS, str(ROOT / "workflow_scripts")], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    grown = json.loads(out)["grown"]
    config = default_config()
    config["model"] = {"preset": "llama-125m", "seq_len": 128, "overrides": {}}
    settings = TrainSettings(device="cpu", precision="bf16", comm_backend="gloo")
    run = run_shape(plan_config(config), settings, "cpu", 32000)
    predicted = estimate(run).init  # 2Ψ: one bf16 copy, no fp32 model first (that was 4Ψ + 2Ψ)
    assert predicted == 2 * run.parameters
    assert abs(grown - predicted) <= 0.15 * predicted, (grown, predicted)


def test_the_kept_checkpoints_must_fit_on_disk(tmp_path, no_gpu):
    config = default_config()
    # 1000 steps, a checkpoint every 500, all kept: 2 × 97 GB (2Ψ module + 12Ψ optimizer partitions) of 7B
    _, record = fit_run(plan_config(config), settings_of(config), state_dir=str(tmp_path))
    disk = record["checkpoint_disk"]
    assert disk["checkpoints"] == 2 and disk["need_bytes"] == 2 * 14 * 6_910_365_696 and disk["fits"]
    assert "benchmark.disk_gib" in disk["text"]  # planned for the articles' 2 TB disk, no GPU here
    config["benchmark"]["disk_gib"] = 150
    with pytest.raises(ConfigError, match=r"checkpoints do not fit on disk: 2 checkpoint\(s\) × 90.1 GiB"):
        fit_run(plan_config(config), settings_of(config), state_dir=str(tmp_path))
    # keeping one (and the one being written) needs the same two; a checkpoint every 100 steps keeping 3 needs 4
    assert fit_run(plan_config(default_config()), settings_of(config, checkpoint_every=100, keep_checkpoints=3),
                   state_dir=str(tmp_path))[1]["checkpoint_disk"]["checkpoints"] == 4


def test_small_checkpoints_are_shown_in_mib(tmp_path, no_gpu):
    from pretrain_bench.train.memory.fit import checkpoint_disk

    config = default_config()
    config["model"] = {"preset": "tiny", "seq_len": 128, "overrides": {}}
    settings = settings_of(config, max_steps=60, checkpoint_every=20, keep_checkpoints=1, device="cpu",
                           precision="fp32", comm_backend="gloo")
    disk = checkpoint_disk(plan_config(config), settings, 3_000_000, str(tmp_path), gpu_here=False)
    # 3M parameters, fp32 ZeRO-2: 4 + 12 bytes each = 45.8 MiB; the kept one and the one being written
    assert disk["checkpoints"] == 2 and disk["text"].startswith("2 checkpoint(s) × 45.8 MiB = 91.6 MiB on disk, ")
    assert not re.search(r"(?<![\d.])0\.0 GiB", disk["text"])  # a size rounded to nothing (not "60.0 GiB free")


def test_eight_gpus_partition_everything_rather_than_offload(no_gpu):
    # 16Ψ/8 fits 24 GiB per GPU: plain ZeRO-3 comes before every offload (no host Adam, no PCIe copies), where
    # ZeRO-3 + CPU offload would need 151 GiB of host RAM for 8 ranks
    config = default_config()
    chosen, record = fit_run(plan_config(config), settings_of(config, gpus=8))
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (3, "none", "none")
    assert record["changed"] == {"zero_stage": [2, 3]} and "host RAM" not in record["text"]
