"""The typed plan: plan.json written and read back field for field, frozen, and refused by name when a field is
missing or unknown; run-time facts travel beside it (RunContext), never inside it."""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from pretrain_bench import devices
from pretrain_bench.plan import Plan, RunContext, make_plan, plan_config
from pretrain_bench.run_state import plan_digest
from pretrain_bench.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "nvidia_smi_memory", lambda: [])
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"vocab_size": 102400}))
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
    assert written["paths"]["state_dir"] == plan.paths.state_dir and written["train"] == plan.train
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
