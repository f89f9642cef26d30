"""The HF export of ZeRO checkpoints, cast tensor by tensor from DeepSpeed's lazily gathered partitions, holds the
same weights as the whole fp32 state dict cast at once."""
import pytest
import torch

from pretrain_bench.checkpointer import load_fp32_state_dict
from pretrain_bench.export import export_checkpoint
from pretrain_bench.plan import Plan
from support import plan_for, run

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_export_of_a_zero_checkpoint_equals_its_fp32_weights_cast(data, tmp_path, stage):
    from safetensors.torch import load_file

    plan = plan_for(data, tmp_path / "run", gpus=2, global_batch_size=None, zero_stage=stage, max_steps=3,
                    checkpoint_every=3)
    assert run(plan, 2, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-3000:]
    checkpoints = tmp_path / "run" / "state" / "checkpoints"
    export_checkpoint(Plan.from_json(plan), 3, tmp_path / "hf", dtype="bf16")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    expected = load_fp32_state_dict(checkpoints, 3)
    assert set(weights) == set(expected) - {"lm_head.weight"} or set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
