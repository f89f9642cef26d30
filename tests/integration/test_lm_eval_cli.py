"""The shipped lm-eval tasks run from lm-eval's own command line, exactly as the model card and docs/lm-eval.md
print it: `--include_path` the folder rule lm_eval_data writes, no `--metadata`, offline, on CPU."""
import json
import os
import shlex
import subprocess
import sys

from pretrain_bench.data.tokenizer import train_tokenizer
from pretrain_bench.evaluate.harness import build_task_data
from pretrain_bench.evaluate.model_card import lm_eval_lines
from pretrain_bench.evaluate.task_folder import SHIPPED_TASKS, lm_eval_command, task_folder
from support import stdlib_texts, write_jsonl

SEQ_LEN = 64
LIMIT = 4


def tiny_export(tmp_path, folder):
    """An export as the evaluate rule leaves one, but tiny and untrained: a random 2-layer LlamaForCausalLM and a BPE
    tokenizer, each saved the way export.export_hf saves them."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    val = write_jsonl(tmp_path / "val.jsonl", stdlib_texts(40_000))
    info = train_tokenizer(val, tmp_path / "tokenizer", vocab_size=400, train_bytes=40_000)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=info["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=info["eos_id"], eos_token_id=info["eos_id"],
                         pad_token_id=info["pad_id"])
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tmp_path / "tokenizer", local_files_only=True).save_pretrained(folder)
    return val


def test_lm_evals_own_command_line_runs_a_shipped_task_from_the_folder_rule_lm_eval_data_writes(tmp_path):
    export = "results/tiny/export/step8"  # as the working directory names it, where the command runs
    val = tiny_export(tmp_path, tmp_path / export)
    build_task_data(val, tmp_path / task_folder("tiny"))
    command = lm_eval_command(export, task_folder("tiny"), SEQ_LEN)
    # the model card prints this very command for that export
    card = "\n".join(lm_eval_lines({"lm_eval_folder": task_folder("tiny"), "export": export, "seq_len": SEQ_LEN}))
    assert f"```bash\n{command}\n```" in card
    assert command == (f"lm_eval --model hf --model_args pretrained={export},max_length={SEQ_LEN} --include_path "
                       f"results/tiny/lm_eval/data --tasks {SHIPPED_TASKS[0]}")
    args = [sys.executable, "-m", "lm_eval", *shlex.split(command)[1:], "--limit", str(LIMIT), "--output_path", "out"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    scores = results["results"][SHIPPED_TASKS[0]]
    assert 0.0 <= scores["acc,none"] <= 1.0 and scores["perplexity,none"] > 1.0, scores
    assert results["n-samples"][SHIPPED_TASKS[0]]["effective"] == LIMIT
