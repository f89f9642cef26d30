"""The HF export of ZeRO checkpoints, cast tensor by tensor from DeepSpeed's lazily gathered partitions, holds the
same weights as the whole fp32 state dict cast at once."""
import pytest
import torch

from pretrain_bench.evaluate.export import export_checkpoint
from pretrain_bench.train.checkpoints.checkpointer import load_fp32_state_dict
from pretrain_bench.train.plan import Plan

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_export_of_a_zero_checkpoint_equals_its_fp32_weights_cast(zero_stage_runs, tmp_path, stage):
    """The 2-rank runs of tests/conftest.py zero_stage_runs (ZeRO-2 with its optimizer offloaded, ZeRO-3), exported
    from their checkpoints at step 3."""
    from safetensors.torch import load_file

    plan = zero_stage_runs / f"z{stage}" / "plan.json"
    checkpoints = zero_stage_runs / f"z{stage}" / "state" / "checkpoints"
    export_checkpoint(Plan.from_json(plan), 3, tmp_path / "hf", dtype="bf16")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    expected = load_fp32_state_dict(checkpoints, 3)
    assert set(weights) == set(expected) - {"lm_head.weight"} or set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
