"""The typed plan: plan.json written and read back field for field, frozen, and refused by name when a field is
missing or unknown; run-time facts travel beside it (RunContext), never inside it."""
import dataclasses
import json
from pathlib import Path

import pytest

from pretrain_bench.core import devices
from pretrain_bench.train.checkpoints.run_state import plan_digest
from pretrain_bench.train.plan import Plan, RunContext, make_plan
from pretrain_bench.train.settings import ConfigError
from pretrain_bench.workflow.experiment import load_config, plan_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    config = load_config(ROOT / "config.yaml")
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 102400, "splits": {"val": {"shards": [{"tokens": 10**7}]}}}))
    plan = make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "out",
                     state_dir=tmp_path / "state", peak={"peak_flops": 2e12, "peak_source": "measured"})
    path = tmp_path / "plan.json"
    plan.to_json(path)
    return plan, path


def test_a_plan_survives_its_json_file_field_for_field(plan_file):
    plan, path = plan_file
    again = Plan.from_json(path)
    assert again == plan and plan_digest(again) == plan_digest(plan)
    written = json.loads(path.read_text())
    assert written["paths"]["state_dir"] == plan.paths.state_dir and written["train"] == plan.train.as_dict()
    assert "cell" not in written  # a main run's plan has no cell; a benchmark cell's names it
    assert "device" not in written and "hardware" not in written  # run-time facts live in RunContext
    cell = dataclasses.replace(plan, cell="ranks2-zero2-fp32-gloo")
    cell.to_json(path)
    assert Plan.from_json(path).cell == "ranks2-zero2-fp32-gloo"


def test_a_plan_is_frozen(plan_file):
    plan, _ = plan_file
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.resume = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunContext(device="cpu", hardware={}).device = "cuda"


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("resume"), "'resume'"),
    (lambda d: d["paths"].pop("state_dir"), "'paths.state_dir'"),
    (lambda d: d.update(device="cpu"), "unknown ['device']"),
])
def test_a_plan_file_missing_or_adding_a_field_is_refused_by_name(plan_file, change, named):
    _, path = plan_file
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as error:
        Plan.from_json(path)
    assert str(path) in str(error.value) and named in str(error.value)


# --- refused before launch, naming the key and the fix ---

def dry_run(name: str, tmp_path: Path):
    """`snakemake -n` on the tiny config under another name, as a user starts it."""
    import subprocess

    from support import snakemake_command, workflow_dir

    return subprocess.run(snakemake_command("-n", "--config", f"name={name}"), cwd=workflow_dir(tmp_path / "workflow"),
                          capture_output=True, text=True, timeout=300)


def test_a_name_too_long_for_the_file_system_is_refused_by_validation(tmp_path):
    name = "run-" + "0123456789abcdef" * 18 + "x"  # 293 characters: results/<name> would fail with ENAMETOOLONG
    proc = dry_run(name, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"name: '{name[:70]}" in output and "is not allowed" in output
    assert "allowed: a string; at most 128 characters" in output
    assert "1 to 128" in output, "the error says what the name may be"
    with pytest.raises(OSError, match="File name too long"):  # what the run would have met, in its first job
        (tmp_path / "results" / name).mkdir(parents=True)


def test_every_path_built_from_the_longest_name_allowed_can_be_created(tmp_path):
    import re

    name = "run-" + "0123456789abcdef" * 8 + "x" * 124  # 128 characters, not a repetition of one piece
    name = name[:128]
    proc = dry_run(name, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = set(re.findall(rf"(?:results|logs|benchmarks)/{re.escape(name)}/[^\s,]+", proc.stdout + proc.stderr))
    assert any("/bench/" in p and "/rep1/" in p for p in paths) and any("/export/step" in p for p in paths)
    for path in paths:  # each as a file under a real folder: ENAMETOOLONG would raise here
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        # what tools write beside a file or folder: a temporary copy (io.atomic_write_json) and a set-aside copy
        target.with_name(f"{target.name}.{2 ** 22}-{'f' * 8}.tmp").touch()
        target.with_name(f"{target.name}.damaged99").touch()


def val_index(tmp_path: Path, tokens: int) -> Path:
    """A shards index whose val split holds `tokens` tokens, with the file it lists."""
    import numpy as np

    (tmp_path / "val-00000.bin").write_bytes(np.arange(tokens, dtype=np.uint16).tobytes())
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"dtype": "uint16", "eos_id": 0, "pad_id": 1, "vocab_size": 4096, "seq_len": 128,
                                 "splits": {"val": {"shards": [{"file": "val-00000.bin", "tokens": tokens}]}}}))
    return index


def tiny_plan(tmp_path: Path, index: Path, **train):
    from support import tiny_config

    config = tiny_config("plan-test")
    config["train"] = {**config["train"], **train}
    return make_plan(plan_config(config), index=index, tokenizer=tmp_path, out_dir=tmp_path / "out",
                     state_dir=tmp_path / "state")


def test_a_val_split_too_small_for_eval_every_is_refused_at_plan_time(tmp_path, monkeypatch):
    from pretrain_bench.train.heldout import HeldOutSlice

    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    index = val_index(tmp_path, 2 * 128 + 1)  # 2 samples for 3 ranks
    with pytest.raises(ConfigError) as error:
        tiny_plan(tmp_path, index)  # the tiny config: eval_every 20, eval_tokens 6144 (48 samples), 3 ranks
    assert str(error.value) == (
        f"train.eval_every: the val split of {index} holds 257 tokens, 2 sample(s) of 128+1 tokens (model.seq_len "
        "128); an evaluation needs 48 sample(s) (6,145 tokens: train.eval_tokens 6,144 over 3 rank(s), at least "
        "one sample per rank). Raise corpus.val_fraction (or the corpus size), lower train.gpus (one val sample per "
        "rank is the least an evaluation takes), or set train.eval_every: null")
    assert tiny_plan(tmp_path, index, eval_every=None).train.eval_every is None

    index = val_index(tmp_path, 10 * 128 + 1)  # 10 samples: 9 for 3 ranks, not the 48 asked for
    with pytest.raises(ConfigError, match=r"holds 1,281 tokens, 10 sample\(s\) .* lower train.eval_tokens to at "
                                          r"most 1,152, or set train.eval_every: null"):
        tiny_plan(tmp_path, index)
    assert tiny_plan(tmp_path, index, eval_tokens=1152).train.eval_tokens == 1152
    # the ranks count with the same function: what the plan accepts, they take; what it refuses, they would too
    assert HeldOutSlice(index, 128, rank=0, world_size=3, eval_tokens=1152).samples == 9
    with pytest.raises(ConfigError, match="lower train.eval_tokens to at most 1,152"):
        HeldOutSlice(index, 128, rank=0, world_size=3, eval_tokens=6144)


def test_only_a_raised_step_count_counts_as_training_further(tmp_path):
    from pretrain_bench.train.plan import only_trains_further
    from support import tiny_config

    config = plan_config(tiny_config("further"))
    path = tmp_path / "plan.json"
    assert not only_trains_further(path, config), "no plan yet"
    path.write_text(json.dumps({"config": config.as_dict()}))  # as rule plan_pretrain wrote it

    def edited(**train):
        return dataclasses.replace(config, train=dataclasses.replace(config.train, **train))

    assert only_trains_further(path, config)
    assert only_trains_further(path, edited(max_steps=200))
    assert only_trains_further(path, edited(max_tokens=10**9))
    assert not only_trains_further(path, edited(max_steps=30)), "fewer steps"
    assert not only_trains_further(path, edited(max_steps=200, lr=1e-3)), "a fresh run"
    assert not only_trains_further(path, edited(max_steps=200, checkpoint_every=10)), "any other edit"
    shorter = dataclasses.replace(config, model=dataclasses.replace(config.model, seq_len=64))
    assert not only_trains_further(path, shorter)
    path.write_text("{")
    assert not only_trains_further(path, config)
