"""The demo's model visibly learns: trained as config/tiny-cpu.yaml trains it (3 gloo ranks, its steps, batch and
learning rate), the greedy continuations of its Python prompts hold Python words, not only whitespace and
punctuation, and the held-out loss falls. The run is the main run of the shared pipeline run (tests/conftest.py
`pipeline`), whose overlay leaves the tiny config's model and train blocks as they are; the continuations are its
evaluation's of the final checkpoint."""
import json
import keyword
import re

import pytest

from support import tiny_config

pytestmark = pytest.mark.pipeline

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]+")


def python_words(text: str) -> list[str]:
    """The keywords and identifiers of two characters or more in `text` that hold a letter (`__` is punctuation)."""
    return [word for word in WORD.findall(text)
            if (keyword.iskeyword(word) or word.isidentifier()) and any(c.isalpha() for c in word)]


def test_python_words_are_what_the_test_counts():
    assert python_words("\n        self.\n") == ["self"] and python_words(" if x:") == ["if"]
    assert python_words("\n       \n ,,,, ____ # #") == []  # whitespace, punctuation and underscores are not words


def test_the_demo_model_continues_python_with_python_words(pipeline):
    demo = tiny_config("demo")
    run = pipeline.results / "train"
    plan = json.loads((run / "plan.json").read_text())
    # the demo's own schedule, batch, model and ranks: only the name-dependent nvme path differs, and
    # expert_parallel, which a plan leaves out at 1 (plans and resume fingerprints of runs before the key unchanged)
    assert demo["train"]["expert_parallel"] == 1 and "expert_parallel" not in plan["train"]
    assert {k: v for k, v in plan["train"].items() if k != "nvme_path"} == {
        k: v for k, v in demo["train"].items() if k not in ("nvme_path", "expert_parallel")}
    assert plan["model"] == demo["model"]
    last = demo["train"]["max_steps"]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (3, last)
    held_out = [r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").open()) if "val_loss" in r]
    assert len(held_out) == last // demo["train"]["eval_every"] and held_out[-1] < held_out[0], held_out
    # the evaluation of the final checkpoint's export (test_evaluate: its continuations reproduce from the export)
    final = json.loads((pipeline.results / "eval" / f"step{last}.json").read_text())
    greedy = [g for g in final["generations"] if g["mode"] == "greedy"]
    assert [g["prompt"] for g in greedy] == demo["evaluate"]["prompts"]
    assert any(python_words(g["text"]) for g in greedy), [g["text"] for g in greedy]
