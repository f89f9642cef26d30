"""Expert parallelism under DeepSpeed (train.expert_parallel with train.engine deepspeed): DeepSpeed's AutoEP, and what
the pipeline keeps of the native DeepSeek model around it.

AutoEP (the ds_config `expert_parallel` section, preset deepseek_v3; engines.spec.deepspeed_config) finds each MoE
layer by its path and children (`model.layers.N.mlp` with a `gate` router and fused 3-D `experts`: transformers'
DeepseekV3 layout, which the native model keeps), replaces it with its own layer whose experts are split over the
expert-parallel ranks, and reduces their gradients over ZeRO's expert param groups. Its router makes the native
router's choice (sigmoid, group-limited top-k, the correction bias, the normalised and scaled weights), but keeps no
balance loss, no load counts the model can read and no bias update. So:

- `attach`: a forward hook on each replaced layer's router counts its tokens per expert as MoE.record_load does (the
  same guard against activation checkpointing's recomputation), and the router's bias is the one the model's
  auxiliary-loss-free update moves (NativeDeepseekForCausalLM.moe_stand_ins); the balance loss and force-balanced
  routing are refused at planning (engines.spec DeepSpeedSpec.check_expert_model).
- `consolidate`: AutoEP's checkpoints hold the experts in files of their own, split into w1/w2/w3 and under AutoEP's
  names, which DeepSpeed's zero_to_fp32 cannot read. DeepSpeed's ds_to_universal can (it knows AutoEP's layouts at
  every ZeRO stage); its per-parameter fp32 master weights are renamed and fused back into the native (and
  transformers') layout here: `gate_up_proj` = w1 (gate) then w3 (up) rows, `down_proj` = w2, `router.gate.weight`
  → `gate.weight`, `router.e_score_correction_bias` → `gate.e_score_correction_bias`.
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import torch

EXPERT_FILE = re.compile(r"layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt")


class ReplacedMoE:
    """What the native model's balancing reads of a MoE layer AutoEP replaced: `load`, this rank's tokens per
    expert (all E) in training forward passes, and `gate.e_score_correction_bias`, the replacement router's bias
    (float32)."""

    def __init__(self, layer, count: int):
        router = layer.router
        bias = router.e_score_correction_bias
        if bias.dtype != torch.float32:  # the model's precision reached it: steps of the update rate need float32
            router.e_score_correction_bias = bias.float()
        self.count = count
        self.load = torch.zeros(count, dtype=torch.int64)
        self.gate = types.SimpleNamespace(e_score_correction_bias=router.e_score_correction_bias)
        router.register_forward_hook(self.record_load)

    @torch.compiler.disable
    @torch.no_grad()
    def record_load(self, router, inputs, outputs) -> None:
        """The router's (scores, chosen experts, tokens per expert): add the last to `load` in training, not when
        activation checkpointing recomputes the forward pass inside the backward (a graph task runs then)."""
        if not router.training or torch._C._current_graph_task_id() != -1:
            return
        counts = outputs[2]
        if self.load.device != counts.device:
            self.load = self.load.to(counts.device)
        self.load += counts.to(torch.int64)


def attach(model) -> None:
    """Point the native model's balancing (expert_load, update_router_biases, router_bias_norms) at the layers
    AutoEP put in place of its MoE layers."""
    layers = [block.mlp for block in model.model.layers if hasattr(block.mlp, "router")
              and hasattr(block.mlp.router, "e_score_correction_bias")]
    if not layers:
        raise RuntimeError("DeepSpeed's AutoEP replaced no MoE layer of the model (expert_parallel.preset_model "
                           "deepseek_v3 found none)")
    model.moe_stand_ins = [ReplacedMoE(layer, model.config.n_routed_experts) for layer in layers]


def is_autoep_checkpoint(folder: Path) -> bool:
    """Whether DeepSpeed checkpoint `folder` was written with AutoEP: its ZeRO-1/2 expert files, or (ZeRO-3, whose
    experts sit in the partitions) AutoEP's layer placement in the model states."""
    if any(EXPERT_FILE.fullmatch(path.name) for path in folder.glob("layer_*_expert_*")):
        return True
    states = sorted(folder.glob("*mp_rank_00_model_states.pt"))
    return bool(states) and "ds_autoep_layers" in torch.load(states[0], map_location="cpu", weights_only=False,
                                                              mmap=True)


def to_native(state: dict) -> dict:
    """AutoEP's names and split experts → the native model's (transformers' DeepseekV3) keys and fused experts."""
    out = {}
    for key, value in state.items():
        if key.endswith(".mlp.router.gate.weight"):
            out[key.replace(".router.gate.weight", ".gate.weight")] = value
        elif key.endswith(".mlp.router.e_score_correction_bias"):
            out[key.replace(".router.", ".gate.")] = value
        elif key.endswith(".experts.w1"):  # (E, I, H) gate rows, then w3's up rows: (E, 2I, H)
            out[key[:-len("w1")] + "gate_up_proj"] = torch.cat([value, state[key[:-1] + "3"]], dim=1)
        elif key.endswith(".experts.w2"):  # (E, H, I)
            out[key[:-len("w2")] + "down_proj"] = value
        elif not key.endswith(".experts.w3"):
            out[key] = value
    return out


def consolidate(folder: Path) -> dict:
    """The whole model's fp32 state dict, in the native layout, from AutoEP checkpoint `folder`: DeepSpeed's
    ds_to_universal merges every parameter's fp32 master (the experts whole over the expert-parallel ranks) into a
    temporary folder beside the checkpoint, removed afterwards; the buffers (the routers' biases, not optimizer
    state) come from the model states. ZeRO-3 keeps the non-expert masters flat: they take their shapes from the
    model states' param_shapes."""
    import shutil
    import subprocess
    import sys
    import tempfile

    folder = Path(folder)
    states = torch.load(sorted(folder.glob("*mp_rank_00_model_states.pt"))[0], map_location="cpu",
                        weights_only=False)
    shapes = {name: shape for group in states.get("param_shapes") or [] for name, shape in group.items()}
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}-consolidate-", dir=folder.parent) as tmp:
        out = Path(tmp) / "universal"
        result = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
             "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"],
            capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"merging the expert-parallel checkpoint {folder} (DeepSpeed's ds_to_universal) "
                               f"failed:\n{result.stderr[-2000:]}")
        state = {}
        for path in sorted((out / "zero").glob("*/fp32.pt")):
            name = path.parent.name
            tensor = torch.load(path, map_location="cpu", weights_only=False)
            tensor = tensor["param"] if isinstance(tensor, dict) else tensor
            if name in shapes and ".experts.w" not in name:
                tensor = tensor.view(shapes[name])
            state[name] = tensor.clone()
        shutil.rmtree(out, ignore_errors=True)
    for name in states.get("buffer_names") or []:
        state[name] = states["module"][name]
    return to_native(state)
