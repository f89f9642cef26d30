# Pretraining: resolve the config into a plan, then launch DeepSpeed on resources.gpu ranks.
# Resumable state (checkpoints, the live metrics.jsonl) lives in results/{name}/state/, outside the declared
# outputs, because Snakemake deletes a failed job's outputs; a rerun resumes from the newest complete checkpoint.


rule plan_pretrain:
    input:
        index="results/{name}/shards/index.json",
        tokenizer="results/{name}/tokenizer/tokenizer.json",
    output:
        plan="results/{name}/train/plan.json",
    log:
        "logs/{name}/plan_pretrain.log",
    conda:
        "../envs/pretrain.yaml"
    params:
        out_dir=subpath(output.plan, parent=True),
        state_dir="results/{name}/state",
    script:
        "../workflow_scripts/plan_run.py"


rule pretrain:
    input:
        plan="results/{name}/train/plan.json",
        index="results/{name}/shards/index.json",
    output:
        metrics=report("results/{name}/train/metrics.jsonl", category="Training"),
        summary=report("results/{name}/train/summary.json", category="Training"),
        hf=directory("results/{name}/train/hf"),
    log:
        "logs/{name}/pretrain.log",
    benchmark:
        "benchmarks/{name}/pretrain.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: workflow.cores
    resources:
        gpu=TRAIN.gpus,
    params:
        launcher=LAUNCHER,
    shell:
        "python {params.launcher} --ranks {resources.gpu} --plan {input.plan} > {log} 2>&1"
