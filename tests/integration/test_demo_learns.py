"""The demo's model visibly learns: trained as config/tiny-cpu.yaml trains it (3 gloo ranks, its steps, batch and
learning rate), the greedy continuations of its Python prompts hold Python words, not only whitespace and
punctuation, and the held-out loss falls."""
import json
import keyword
import re

import pytest

from pretrain_bench.plan import Plan
from support import plan_for, run, tiny_config

pytestmark = pytest.mark.engine

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]+")


def python_words(text: str) -> list[str]:
    """The keywords and identifiers of two characters or more in `text` that hold a letter (`__` is punctuation)."""
    return [word for word in WORD.findall(text)
            if (keyword.iskeyword(word) or word.isidentifier()) and any(c.isalpha() for c in word)]


def test_python_words_are_what_the_test_counts():
    assert python_words("\n        self.\n") == ["self"] and python_words(" if x:") == ["if"]
    assert python_words("\n       \n ,,,, ____ # #") == []  # whitespace, punctuation and underscores are not words


def test_the_demo_model_continues_python_with_python_words(data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pretrain_bench.evaluation import GenerationSettings, generate_continuations
    from pretrain_bench.export import export_checkpoint

    demo = tiny_config("demo")["train"]  # the demo's own schedule, checkpointing only at its end
    settings = {key: demo[key] for key in ("micro_batch_size", "max_steps", "lr", "min_lr", "warmup_steps",
                                           "warmup_timing_steps", "eval_every", "eval_tokens")}
    plan = plan_for(data, tmp_path / "run", **settings, checkpoint_every=demo["max_steps"])
    assert run(plan, 3, tmp_path / "run.log") == 0, (tmp_path / "run.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "out" / "summary.json").read_text())
    held_out = [r["val_loss"] for r in map(json.loads, (tmp_path / "run" / "out" / "metrics.jsonl").open())
                if "val_loss" in r]
    assert len(held_out) == demo["max_steps"] // demo["eval_every"] and held_out[-1] < held_out[0], held_out
    export_checkpoint(Plan.from_json(plan), summary["steps"], tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompts = tiny_config("demo")["evaluate"]["prompts"]
    greedy = [g["text"] for g in generate_continuations(model, tokenizer, prompts, GenerationSettings(), seq_len=128)
              if g["mode"] == "greedy"]
    assert any(python_words(text) for text in greedy), greedy
