"""The HF export casts a checkpoint tensor by tensor, never holding the fp32 dict beside its cast copy, and the
export and evaluation jobs declare the host memory the memory model gives them (mem_mb)."""
import re
import subprocess
import sys
import weakref

import pytest
import torch

from pretrain_bench.evaluate.export import cast_state_dict, export_hf
from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.memory.model import RUNTIME_BYTES, export_and_evaluation_host_bytes, run_shape
from pretrain_bench.train.models.llama import ModelShape, build_model
from pretrain_bench.train.settings import TrainSettings
from support import ROOT, SNAKEFILE, stdlib_texts, workflow_dir, write_jsonl


class Partitioned:
    """DeepSpeed's GatheredTensor as zero_to_fp32 hands it out in lazy mode: `.contiguous()` gathers a new fp32
    tensor. It checks that every tensor gathered before it has been freed by then (unless the cast is to fp32,
    where the gathered tensor is the exported one)."""

    gathered: list = []
    check_freed = True

    def __init__(self, value: torch.Tensor):
        self.value = value

    def contiguous(self) -> torch.Tensor:
        alive = [ref for ref in self.gathered if ref() is not None]
        assert not (alive and self.check_freed), f"{len(alive)} fp32 tensor(s) gathered earlier are still held"
        tensor = self.value.clone()
        self.gathered.append(weakref.ref(tensor))
        return tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_equals_each_tensor_cast_and_frees_each_fp32_tensor_before_the_next(dtype):
    torch.manual_seed(0)
    originals = {f"layer{i}.weight": torch.randn(64, 32) for i in range(5)}
    Partitioned.gathered, Partitioned.check_freed = [], dtype != torch.float32
    state = {name: Partitioned(tensor) for name, tensor in originals.items()}
    state["position_ids"] = torch.arange(7)  # not floating point: kept as it is
    cast = cast_state_dict(state, dtype)
    assert state == {}, "the source dict is emptied as it goes"
    assert list(cast) == [*originals, "position_ids"]
    for name, original in originals.items():
        assert cast[name].dtype == dtype and torch.equal(cast[name], original.to(dtype))
    assert cast["position_ids"].dtype == torch.int64 and torch.equal(cast["position_ids"], torch.arange(7))
    if dtype != torch.float32:
        assert all(ref() is None for ref in Partitioned.gathered), "no fp32 tensor outlives the cast"


def test_names_sharing_one_tensor_share_the_cast_one():
    embedding = torch.randn(10, 4)
    cast = cast_state_dict({"embed.weight": embedding, "head.weight": embedding, "norm": torch.ones(4)},
                           torch.bfloat16)
    assert cast["embed.weight"] is cast["head.weight"]
    assert torch.equal(cast["head.weight"], embedding.to(torch.bfloat16))


def export_bf16(model, shape, tmp_path) -> dict:
    """`model`'s weights as checkpoint step 4 (a ZeRO-0/1/2 model file), exported in bf16 with a 300-token tokenizer:
    the export's safetensors, as loaded."""
    from safetensors.torch import load_file

    from pretrain_bench.data.tokenizer import train_tokenizer

    folder = tmp_path / "checkpoints" / ckpt.tag_for(4)
    folder.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, folder / "mp_rank_00_model_states.pt")
    ckpt.write_marker(tmp_path / "checkpoints", 4, {"tokens": 1})
    corpus = write_jsonl(tmp_path / "train.jsonl", [t for t in stdlib_texts(60_000) if t.isascii()])
    train_tokenizer(corpus, tmp_path / "tokenizer", vocab_size=300, train_bytes=50_000)
    export_hf(tmp_path / "checkpoints", 4, shape, 16, tmp_path / "tokenizer", tmp_path / "out", dtype="bf16")
    return load_file(tmp_path / "out" / "model.safetensors")


def test_a_bf16_export_holds_every_weight_of_the_checkpoint_cast(tmp_path):
    shape = ModelShape(2, 32, 2, 2, 64, 300, tie_word_embeddings=False)
    model = build_model(shape, 16, seed=3)
    weights = export_bf16(model, shape, tmp_path)
    expected = {name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()}
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16, name
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_a_bf16_export_of_a_deepseek_model_keeps_its_routers_fp32_and_loads_in_transformers(tmp_path):
    """The router's weight and aux-loss-free bias stay float32 (bit for bit the checkpoint's), every other weight is
    bf16, and AutoModelForCausalLM loads the folder back with the router still float32."""
    from transformers import AutoModelForCausalLM

    from pretrain_bench.train.models.deepseek import build_model as build_deepseek
    from pretrain_bench.train.models.deepseek import resolve_shape

    shape = resolve_shape("tiny-moe", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                                       "intermediate_size": 64, "moe_intermediate_size": 16}, 300)
    model = build_deepseek(shape, 16, seed=3, implementation="native")
    with torch.no_grad():  # a bias that moved in training, at a step bf16 cannot hold
        model.model.layers[1].mlp.gate.e_score_correction_bias += torch.linspace(-1e-3, 1e-3, 8) + 1e-5
    weights = export_bf16(model, shape, tmp_path)
    router = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    original = model.state_dict()
    assert router <= set(weights)
    for name, tensor in weights.items():
        if name in router:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name
        else:  # the fused experts are saved one per expert (the released layout): their dtype is checked
            assert tensor.dtype == torch.bfloat16, name
            if name in original:
                assert torch.equal(tensor, original[name].to(torch.bfloat16)), name
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # the dense FFN's gate is not one
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    bias = loaded.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, original["model.layers.1.mlp.gate.e_score_correction_bias"])


@pytest.fixture(scope="module")
def default_run():
    """The default config (validated, defaults filled) and the shape of its model."""
    from pretrain_bench.train.memory.model import config_vocab_size
    from pretrain_bench.workflow.experiment import load_config, plan_config

    config = load_config(ROOT / "config.yaml")
    settings = TrainSettings.from_config(config["train"])
    plan = plan_config(config)
    return config, run_shape(plan, settings, "cpu", config_vocab_size(plan.tokenizer, plan.model))


def test_host_bytes_of_export_and_evaluation_count_the_cast_copy_the_largest_tensor_and_the_loaded_model(
        default_run):
    _, run = default_run
    psi, largest, runtime = run.parameters, run.largest_parameter, RUNTIME_BYTES["cpu"]
    assert psi > 6.5e9 and largest == run.vocab_size * run.hidden_size
    assert export_and_evaluation_host_bytes(run, "fp32") == 4 * psi + 4 * largest + runtime
    assert export_and_evaluation_host_bytes(run, "bf16", "bf16") == 2 * psi + 4 * largest + runtime
    # an fp32 evaluation of a bf16 export: loading it in fp32 is the larger of the two
    assert export_and_evaluation_host_bytes(run, "bf16", "fp32") == 4 * psi + runtime


def dry_run_mem_mb(folder) -> dict[str, int]:
    """mem_mb of rule evaluate and rule export_final in `snakemake -n` on the default config."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "-n", "--cores", "2",
                           "--resources", "gpu=3", "--config", "name=itest-mem-mb"], cwd=workflow_dir(folder),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(re.findall(r"^rule (evaluate|export_final):\n(?:    .*\n)*?    resources: .*?mem_mb=(\d+)",
                            proc.stdout, flags=re.M))
    assert set(found) == {"evaluate", "export_final"}, proc.stdout[-3000:]
    return {rule: int(value) for rule, value in found.items()}


def test_the_default_config_declares_mem_mb_from_the_memory_model_for_evaluate_and_export_final(default_run,
                                                                                                   tmp_path):
    config, run = default_run
    evaluate = config["evaluate"]
    mem_mb = dry_run_mem_mb(tmp_path / "workflow")
    assert mem_mb["export_final"] == -(-export_and_evaluation_host_bytes(run, "fp32") // 10**6)
    assert mem_mb["evaluate"] == -(-export_and_evaluation_host_bytes(run, evaluate["export_dtype"],
                                                                     evaluate["precision"]) // 10**6)
    assert mem_mb["export_final"] * 10**6 > 4 * run.parameters, "the fp32 weights of the whole model"
