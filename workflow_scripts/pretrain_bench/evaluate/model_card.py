"""The model card (README.md) every HF export carries: what the model is, what it was trained on, how good it is.

The facts come from the run's plan, the checkpoint's marker, the corpus manifest, the shards' index and, when
train.eval_every evaluated that step, metrics.jsonl; anything unknown is said to be unknown, never guessed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from pretrain_bench.core.io import read_jsonl
from pretrain_bench.core.provenance import git_commit
from pretrain_bench.evaluate.task_folder import SHIPPED_TASKS, lm_eval_command, task_folder
from pretrain_bench.train.engines.spec import engine_spec
from pretrain_bench.train.models.registry import model_family

REPOSITORY = Path(__file__).resolve().parents[3]


def heldout_at(metrics_path: Path, step: int, index: dict) -> dict | None:
    """Held-out loss, perplexity and bits per byte of `step` from metrics.jsonl (train.eval_every), or None.

    Bits per byte = loss / ln 2 × val tokens / val text bytes: the split's average bytes per token, which is what a
    tokenizer-independent comparison needs (the slice evaluated is evenly spread over that split).
    """
    record = next((r for r in read_jsonl(metrics_path) if r["step"] == step and "val_loss" in r), None)
    if record is None:
        return None
    val = index["splits"]["val"]
    bits_per_byte = record["val_loss"] / math.log(2) * val["tokens"] / val["text_bytes"] if val["text_bytes"] else None
    return {"loss": record["val_loss"], "perplexity": record["val_perplexity"], "bits_per_byte": bits_per_byte}


def card_facts(plan, step: int, tokens: int | None, export: str | None = None) -> dict:
    """What the card of checkpoint `step` of the run `plan` describes; `export`: the folder the card goes into, as
    the working directory names it (for the lm-eval command)."""
    index_path = Path(plan.paths.index)
    index = json.loads(index_path.read_text())
    manifest_path = plan.paths.manifest  # the plan rule's input (None for benchmark cells)
    manifest = json.loads(Path(manifest_path).read_text()) if manifest_path and Path(manifest_path).is_file() else None
    return {
        "name": plan.name, "step": step, "tokens": tokens, "seq_len": plan.model.seq_len,
        "preset": plan.model.preset, "init_from": plan.init_from,
        "heldout": heldout_at(Path(plan.paths.state_dir) / "metrics.jsonl", step, index),
        "sources": manifest["sources"] if manifest else None,
        "splits": {split: manifest[split] for split in ("train", "val")} if manifest else None,
        "git_commit": git_commit(REPOSITORY),
        "data_id": plan.data["data_id"] if plan.data else None,
        "export": export, "lm_eval_folder": task_folder(plan.name),
        # the checkpoint holds ZeRO partitions that the export consolidates as zero_to_fp32.py does
        "zero_partitioned": engine_spec(plan.train.engine).zero_partitioned and plan.train.zero_stage >= 1,
    }


def render_card(shape, facts: dict, dtype: str) -> str:
    """README.md text of an export folder."""
    family = model_family(shape)
    params = family.count_parameters(shape)
    init = facts["init_from"]
    origin = (f"continued from `{init['uri']}`" + (f" (revision `{init['revision']}`)" if init.get("revision") else "")
              if init else f"trained from a random initialisation (preset `{facts['preset']}`)")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        f"tags: [{family.name}, pretrain-bench]", "---",
        "", f"# {facts['name']} — step {facts['step']}", "",
        f"A {family.title}-architecture causal language model pretrained with pretrain-bench, {origin}.", "",
        "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(\"<this folder>\")",
        "tokenizer = AutoTokenizer.from_pretrained(\"<this folder>\")", "```", "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| parameters | {params['total']:,} ({params['non_embedding']:,} without the embedding) |",
        f"| layers × hidden size | {shape.num_hidden_layers} × {shape.hidden_size} |",
        *(f"| {label} | {value} |" for label, value in family.card_rows(shape)),
        f"| vocabulary | {shape.vocab_size:,} |",
        f"| trained sequence length | {facts['seq_len']} tokens |",
        f"| tied embeddings | {'yes' if shape.tie_word_embeddings else 'no'} |",
        f"| weights dtype | {dtype} |", "",
        *weights_lines(shape, dtype, facts["zero_partitioned"]),
        "## Training", "",
        f"- optimizer steps: {facts['step']:,}; tokens trained: "
        + (f"{facts['tokens']:,}" if facts["tokens"] is not None else "unknown")
        + (" (in this run, on top of the starting model's own)" if init else ""),
        f"- pretrain-bench commit: `{facts['git_commit'] or 'unknown (not a git checkout)'}`", "",
        "## Data", "",
        f"- data id: `{facts['data_id']}` (its corpus, tokenizer and shards live in `results/data/<data id>`)"
        if facts["data_id"] else "- data id: unknown (the plan names none)",
    ]
    if facts["sources"]:
        lines += ["| source | documents kept | bytes kept | sha256 of the fetched file |", "|---|---|---|---|"]
        lines += [f"| `{s['uri']}` | {s['documents_out']:,} | {s['bytes_out']:,} | "
                  f"{('`' + s['sha256'] + '`') if s.get('sha256') else 'n/a (not a single file)'} |"
                  for s in facts["sources"]]
        lines += [""] + [f"- {split} split `{entry['file']}`: {entry['documents']:,} documents, sha256 "
                         f"`{entry['sha256']}`" for split, entry in facts["splits"].items()]
    else:
        lines.append("- the corpus manifest was not found, so the sources are unknown")
    lines += ["", "## Held-out evaluation", ""]
    held = facts["heldout"]
    if held:
        bpb = f"{held['bits_per_byte']:.4f}" if held["bits_per_byte"] is not None else "unknown"
        lines += [f"On the run's val split at step {facts['step']} (train.eval_every): loss {held['loss']:.4f} "
                  f"nats/token, perplexity {held['perplexity']:,.2f}, bits per byte {bpb}."]
    else:
        lines += ["Not evaluated at this step while training (train.eval_every); `results/<name>/eval/step<N>.json` "
                  "holds the evaluation of each kept checkpoint once the evaluate rule ran."]
    lines += ["", *lm_eval_lines(facts)]
    return "\n".join(lines) + "\n"


def weights_lines(shape, dtype: str, zero_partitioned: bool) -> list[str]:
    """What the weights file is (docs/export.md): for a DeepSpeed ZeRO 1-3 run (`zero_partitioned`), the consolidated
    fp32 state DeepSpeed's zero_to_fp32.py writes; else the weights the engine saved."""
    cast = "" if dtype == "fp32" else f", cast to {dtype}"
    if zero_partitioned:
        text = (f"`model.safetensors` holds the checkpoint's fp32 master weights{cast}: the consolidated state "
                "DeepSpeed's `zero_to_fp32.py` writes, gathered from every rank's optimizer partitions by the same "
                "DeepSpeed function, so there is no need to run that script on the checkpoint.")
    else:
        text = f"`model.safetensors` holds the model weights the engine saved in the checkpoint{cast}."
    if shape.tie_word_embeddings:
        text += (" The input embedding and the output head are one tied tensor, stored once (`lm_head.weight` follows "
                 "`model.embed_tokens.weight` on loading)" + ("; `zero_to_fp32.py --safe_serialization` fails on "
                                                              "exactly that sharing, since safetensors refuses two "
                                                              "names for one tensor." if zero_partitioned else "."))
    return [text, "", "See docs/export.md in pretrain-bench.", ""]


def lm_eval_lines(facts: dict) -> list[str]:
    """How to score this export with lm-eval's own command line on the run's shipped tasks (docs/lm-eval.md)."""
    folder = facts["lm_eval_folder"]
    export = facts["export"] or "<this folder>"
    return ["## Evaluate with lm-eval", "",
            "From the pipeline's working directory (where `results/` is), offline, with lm-evaluation-harness "
            "installed:", "", "```bash", lm_eval_command(export, folder, facts["seq_len"]), "```", "",
            f"`{folder}` holds the run's shipped tasks ({', '.join(f'`{task}`' for task in SHIPPED_TASKS)}) and "
            "their data, built from its val split by rule lm_eval_data: it exists when evaluate.lm_eval names "
            f"tasks, or after `snakemake ... -- {folder}`. `max_length` is the trained sequence length. See "
            "docs/lm-eval.md in pretrain-bench."]
