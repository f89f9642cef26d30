"""DeepSeek-V3's auxiliary-loss-free balancing in training: with a fixed seed, the MaxVio of a tiny native DeepSeek
model trained with a bias update rate above 0 is below the MaxVio of the same run at rate 0, layer by layer, and at
rate 0 the router bias never leaves zero. The bias update runs through the trainer's own `balance_experts` after
each optimizer step, so the test holds the model's API and the trainer's use of it together."""
import pytest
import torch

from pretrain_bench.train.models.deepseek import resolve_shape
from pretrain_bench.train.models.native_deepseek import max_violation
from pretrain_bench.train.trainer import Trainer

VOCAB, T, B, STEPS, LAST = 97, 32, 8, 40, 10
# tiny-moe (sigmoid router, group-limited top-2 of 8 experts in 4 groups, MLA) cut to 1 dense + 2 MoE layers and a
# narrow width, without the sequence-wise balance loss: only the bias update balances the load.
SMALL = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
         "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "aux_loss_alpha": 0.0}
# γ = 0.01: at initialisation the sigmoid scores of the experts differ by a few hundredths (router weights
# normal(0, 0.02) over 64 normalised dims), and training widens the gaps. The bias moves by at most γ per step, so
# within the test's 40 steps it must be able to reach ~0.05–0.1: γ = 0.001 (DeepSeek-V3's, over ~10^5 steps) moves
# it 0.04 at most here, and γ = 0.05 overshoots and the load oscillates (measured on this model: MaxVio of the last
# 10 steps 0.27–0.32 at 0.01 against 0.68–1.07 at 0 for seeds 0–2; 0.66–0.98 at 0.05).
RATE = 0.01


def bigram_batches(seed: int):
    """Fixed-seed (B, T) batches from a random bigram chain (every token has two possible successors): text a model
    can learn, so its hidden states — and the router's choices — differ from token to token. (On uniform random
    tokens the model learns to ignore its input, every token routes alike and no bias can balance one step.)"""
    successors = torch.randint(0, VOCAB, (VOCAB, 2), generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = [torch.randint(0, VOCAB, (B,), generator=generator)]
        for _ in range(T - 1):
            tokens.append(successors[tokens[-1], torch.randint(0, 2, (B,), generator=generator)])
        yield torch.stack(tokens, dim=1)  # (B, T)


def train(rate: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(MaxVio per step and MoE layer (STEPS, layers), the router biases after training (layers, experts)) of a
    fixed-seed AdamW run at bias_update_rate `rate`, balanced after each optimizer step by the trainer's own
    balance_experts (expert_load → update_router_biases(load) → reset_expert_load, at world size 1)."""
    from pretrain_bench.train.models.deepseek import build_model

    model = build_model(resolve_shape("tiny-moe", {**SMALL, "bias_update_rate": rate}, VOCAB), T, seed=seed,
                        implementation="native")
    model.train()
    trainer = Trainer.__new__(Trainer)  # balance_experts reads only these three fields
    trainer.__dict__.update(model=model, run_device="cpu", world=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    violations = []
    for _, batch in zip(range(STEPS), bigram_batches(seed)):
        optimizer.zero_grad(set_to_none=True)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        record = trainer.balance_experts()
        assert model.expert_load().sum() == 0, "the counts restart after every update"
        violations.append(record["max_violation"])
    biases = torch.stack([layer.gate.e_score_correction_bias for layer in model.moe_layers()])
    return torch.tensor(violations), biases


def test_the_bias_update_lowers_max_violation_in_every_moe_layer():
    still, still_biases = train(0.0)
    moved, moved_biases = train(RATE)
    assert still.shape == (STEPS, 2)
    assert torch.equal(still_biases, torch.zeros_like(still_biases)), "rate 0: the bias stays exactly zero"
    assert moved_biases.dtype == torch.float32 and moved_biases.abs().max() > 0
    late_still, late_moved = still[-LAST:].mean(dim=0), moved[-LAST:].mean(dim=0)  # (layers,)
    assert (late_moved < 0.6 * late_still).all(), (late_moved.tolist(), late_still.tolist())


def test_balance_experts_hands_the_update_the_load_it_records():
    """The load the trainer records is the one the bias moved by: overloaded experts' biases go down by γ, the
    underloaded ones' up, and MaxVio is that load's."""
    from pretrain_bench.train.models.deepseek import build_model

    model = build_model(resolve_shape("tiny-moe", {**SMALL, "bias_update_rate": 0.25}, VOCAB), T, seed=0,
                        implementation="native")
    model.train()
    model(next(bigram_batches(0)))
    load = model.expert_load()
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(model=model, run_device="cpu", world=1)
    record = trainer.balance_experts()
    assert record["expert_load"] == load.tolist()
    assert record["max_violation"] == pytest.approx(max_violation(load).tolist())
    for layer, counts in zip(model.moe_layers(), load.float()):
        expected = 0.25 * torch.sign(counts.mean() - counts)
        assert torch.equal(layer.gate.e_score_correction_bias, expected)
