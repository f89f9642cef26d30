"""train.memory_fit: the ordered ladder of changes that keep model, precision and global batch, and its record."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow_scripts"))

from pretrain_bench import memory_model  # noqa: E402
from pretrain_bench.memory_fit import describe, fit_run, ladder  # noqa: E402
from pretrain_bench.memory_model import GIB, Budget, estimate, run_shape  # noqa: E402
from pretrain_bench.plan import make_plan, plan_config  # noqa: E402
from pretrain_bench.settings import ConfigError, TrainSettings, deepspeed_config  # noqa: E402


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(memory_model, "_nvidia_smi_memory", lambda: [])


def default_config(**benchmark):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["benchmark"].update(benchmark)
    return config


def settings_of(config, **train):
    return TrainSettings.from_config({**config["train"], **train})


def test_default_experiment_runs_zero2_with_cpu_offload_on_the_articles_box(no_gpu):
    config = default_config()  # no GPU here: plans for 3 × 24 GiB, 128 GiB RAM, 1800 GiB disk (config.yaml)
    chosen, record = fit_run(config, settings_of(config))
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (2, "cpu", "none")
    assert chosen.precision == "fp16" and chosen.derived_global_batch == 24 and chosen.micro_batch_size == 8
    assert record["asked"]["offload_optimizer"] == "none" and not record["asked_fits"]
    assert record["changed"] == {"offload_optimizer": ["none", "cpu"]}
    assert record["summary"].startswith("asked ZeRO-2, micro-batch 8 × 1 accumulation; ran ZeRO-2 + CPU optimizer "
                                        "offload")
    assert "needs 52.1 GiB per GPU, has 24.0 GiB" in record["summary"]  # why: plain ZeRO-2 does not fit
    assert record["fits"] and record["budget"]["host_bytes"] == 128 * GIB


def test_strict_stops_with_the_figures(no_gpu):
    config = default_config()
    with pytest.raises(ConfigError, match="pre-flight: the main run is predicted not to fit: needs 52.1 GiB"):
        fit_run(config, settings_of(config, memory_fit="strict"), what="the main run")


def test_less_host_ram_moves_down_the_ladder_to_nvme(no_gpu):
    # 100 GiB of RAM: CPU offload (109 GiB) and ZeRO-3 CPU offload do not fit, ZeRO-Infinity to NVMe does
    config = default_config(host_memory_gib=100)
    chosen, record = fit_run(config, settings_of(config), nvme_path="/fast/nvme")
    assert (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param) == (3, "nvme", "nvme")
    assert [t["fits"] for t in record["tried"]] == [False, False, True]
    assert "host RAM 109.0 GiB for 3 ranks, has 100.0 GiB" in record["tried"][0]["text"]
    assert "NVMe" in record["text"] and record["disk_need_bytes"] > 0
    ds = deepspeed_config(chosen, "cuda", 10)["zero_optimization"]
    assert ds["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/fast/nvme"}
    assert ds["offload_optimizer"]["device"] == "nvme"


def test_nothing_fits_lists_what_was_tried(no_gpu):
    # NVMe needs ~90 GiB of disk for 7B's offloaded states on 3 ranks; 50 GiB free is not enough
    config = default_config(host_memory_gib=100, disk_gib=50)
    with pytest.raises(ConfigError) as error:
        fit_run(config, settings_of(config), nvme_path="/fast/nvme")
    message = str(error.value)
    assert "train.memory_fit: auto tried, in order:" in message
    tried = message.split("auto tried, in order:")[1]
    assert "NVMe optimizer offload" in tried and "has 50.0 GiB free" in tried
    assert "activation checkpointing" in tried and "micro-batch 1 × 8 accumulation" in tried


def test_the_ladder_keeps_precision_and_global_batch():
    asked = TrainSettings(gpus=3, device="cuda", zero_stage=2, precision="fp16", micro_batch_size=8)
    rungs = ladder(asked, "cuda")
    labels = [r.label for r in rungs]
    assert labels[:5] == [
        "ZeRO-2 + CPU optimizer offload, micro-batch 8 × 1 accumulation",
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


def test_a_cpu_run_short_of_ram_recomputes_activations():
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["model"] = {"preset": "llama-125m", "seq_len": 1024, "overrides": {}}
    asked = TrainSettings(gpus=2, device="cpu", comm_backend="gloo", precision="fp32", micro_batch_size=16)

    def need(s):  # both ranks share the host
        return 2 * estimate(run_shape(config, s, "cpu", 32000)).per_rank

    # RAM just above what activation checkpointing needs, below what the asked run needs
    ram = int(need(replace(asked, activation_checkpointing=True)) * 1.01)
    assert ram < need(asked)
    chosen, record = fit_run(config, asked, 32000, budget=Budget("cpu", ram, "test", ram, "test"))
    assert chosen.activation_checkpointing and chosen.micro_batch_size == 16
    assert record["changed"] == {"activation_checkpointing": [False, True]}
    # with less, the next rungs are smaller micro-batches with more accumulation (same global batch)
    ram = int(need(replace(asked, micro_batch_size=1, grad_accum_steps=16)) * 1.01)
    assert ram < need(replace(asked, activation_checkpointing=True))
    chosen, record = fit_run(config, asked, 32000, budget=Budget("cpu", ram, "test", ram, "test"))
    assert not chosen.activation_checkpointing and chosen.micro_batch_size < 16
    assert chosen.derived_global_batch == asked.derived_global_batch
    assert need(chosen) <= ram and [t["fits"] for t in record["tried"]][-1] and record["tried"][0]["fits"] is False


def test_plan_records_asked_and_chosen(tmp_path, no_gpu):
    config = default_config()
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 102400}))
    plan = make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "o",
                     state_dir=tmp_path / "state")
    assert plan["train"]["offload_optimizer"] == "cpu" and plan["memory_fit"]["asked"]["offload_optimizer"] == "none"
    assert plan["train"]["nvme_path"] == str(tmp_path / "state" / "nvme")  # the default: under the run's state
    # the plan records only the config a training run reads
    assert set(plan["config"]) == {"name", "model", "train", "tokenizer", "benchmark", "report"}
    assert "evaluate" not in plan["config"] and "corpus" not in plan["config"]
