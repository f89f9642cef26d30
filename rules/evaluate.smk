# Checkpoint evaluation. Each kept checkpoint of the main run is exported as an HF model folder (safetensors +
# tokenizer), and that export is evaluated on the held-out val split: loss, perplexity, bits per byte, eval
# tokens/s, greedy and sampled continuations of evaluate.prompts. When evaluate.lm_eval.tasks names any task,
# lm-evaluation-harness runs them on the export, offline. One job per checkpoint does all three, in one process:
# Python, torch, transformers and the exported model are loaded once rather than three times, and checkpoints are
# still evaluated in parallel (one device slot each on GPU). Each output stays its own file, so an edit to any
# evaluate key reruns this job for every checkpoint (export included), and never training. Checkpoints are only
# read; they live in results/{name}/state/, outside the declared outputs: train/summary.json orders this job after
# training, and params.checkpoint (the digest of the checkpoint's commit marker) reruns it when that checkpoint is
# written anew. When this config only trains the run further (a raised train.max_steps), plan and summary are
# ancient for evaluations that still match their checkpoint and settings (rules/common.smk, training_input): the
# kept checkpoints are not evaluated or exported again.


rule evaluate:
    input:
        plan=training_input("results/{name}/train/plan.json"),
        summary=training_input("results/{name}/train/summary.json"),
        index=DATA.index,
        **({"lm_eval_data": "results/{name}/lm_eval/data"} if LM_EVAL_TASKS else {}),
    output:
        export=directory("results/{name}/export/step{step}"),
        eval=report("results/{name}/eval/step{step}.json", category="Evaluation"),
        **(
            {"lm_eval": report("results/{name}/lm_eval/step{step}.json", category="Evaluation")}
            if LM_EVAL_TASKS
            else {}
        ),
    log:
        "logs/{name}/evaluate/step{step}.log",
    benchmark:
        "benchmarks/{name}/evaluate/step{step}.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: 1
    resources:
        gpu=EVAL_GPUS,
        mem_mb=EVALUATE_MEM_MB,
    params:
        step=lambda wildcards: int(wildcards.step),
        # what decides the result (pretrain_bench/evaluate/inputs.py): the checkpoint's bytes and the evaluate settings
        checkpoint=checkpoint_digest,
        settings=EVALUATE_SETTINGS,
        lock_dir=GPU_LOCK_DIR,
    script:
        "../workflow_scripts/evaluate_checkpoint.py"


# The main run's final weights as train/hf (fp32, exact), exported here rather than inside the training job, so no
# rank waits in a barrier while rank 0 gathers and writes a large model.
rule export_final:
    input:
        plan="results/{name}/train/plan.json",
        summary="results/{name}/train/summary.json",
    output:
        directory("results/{name}/train/hf"),
    log:
        "logs/{name}/export_final.log",
    benchmark:
        "benchmarks/{name}/export_final.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: 1
    resources:
        mem_mb=EXPORT_FINAL_MEM_MB,
    params:
        step=TRAIN.total_steps(MODEL.seq_len),
        dtype=FINAL_EXPORT_DTYPE,
    script:
        "../workflow_scripts/export_final.py"


# The shipped lm-eval tasks' folder: their data from the val split, beside a copy of the task files, so that it is
# lm-eval's --include_path for the pipeline and for lm-eval's own command line (docs/lm-eval.md).
from pretrain_bench.evaluate.task_folder import TASK_FILES as LM_EVAL_TASK_FILES


rule lm_eval_data:
    input:
        val=f"results/{DATA.corpus}/val.jsonl",
        tasks=[str(path) for path in LM_EVAL_TASK_FILES],  # an edit of a task file rebuilds the folder
    output:
        directory("results/{name}/lm_eval/data"),
    log:
        "logs/{name}/lm_eval_data.log",
    benchmark:
        "benchmarks/{name}/lm_eval_data.tsv"
    conda:
        "../envs/pretrain.yaml"
    script:
        "../workflow_scripts/lm_eval_data.py"
