# Pretraining: resolve the config into a plan, then launch DeepSpeed on train.gpus ranks on each of train.nodes nodes.
# Resumable state (checkpoints, the live metrics.jsonl) lives in results/{name}/state/, outside the declared
# outputs, because Snakemake deletes a failed job's outputs; a rerun resumes from the newest complete checkpoint.


# A multi-node run under SLURM (profiles/slurm) is one allocation of train.nodes nodes, one task and train.gpus
# GPUs on each (`gres` counts per node, `gpu` the whole job). `mpi` stops the executor from wrapping the job in a
# one-node srun step: the launcher itself starts one torchrun agent per node with srun.
PRETRAIN_MULTI_NODE = {"mpi": "srun", "tasks": TRAIN.nodes, "gres": f"gpu:{TRAIN.gpus}"} if TRAIN.nodes > 1 else {}


rule plan_pretrain:
    input:
        index=DATA.index,
        tokenizer=DATA.tokenizer_json,
        # the machine's peak FLOP/s, measured once per machine and software: every run's MFU divides by it
        peak=PEAK.path,
        manifest=DATA.manifest,  # the export's model card lists the sources
        init_from=INIT_FROM_INPUT,  # model.init_from's local folder (another run's export is read, never built)
    output:
        plan="results/{name}/train/plan.json",
    log:
        "logs/{name}/plan_pretrain.log",
    conda:
        "../envs/pretrain.yaml"
    params:
        # the part of the config a training run reads: editing it replans (and so retrains), nothing else does
        config=main_plan_config(),
        out_dir=subpath(output.plan, parent=True),
        state_dir="results/{name}/state",
        data=DATA.record(),  # the data id the plan, summary and model card name
    script:
        "../workflow_scripts/plan_pretrain.py"


rule pretrain:
    input:
        plan="results/{name}/train/plan.json",
        index=DATA.index,
    output:
        metrics=report("results/{name}/train/metrics.jsonl", category="Training"),
        summary=report("results/{name}/train/summary.json", category="Training"),
    log:
        "logs/{name}/pretrain.log",
    benchmark:
        "benchmarks/{name}/pretrain.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: workflow.cores
    resources:
        # GPUs the job holds on all its nodes: what `--resources gpu=N` counts locally (rank slots, on CPU too) and
        # what the SLURM executor asks for as --gpus (a cluster without GPUs sets it to 0, see README).
        gpu=TRAIN.gpus * TRAIN.nodes,
        nodes=TRAIN.nodes,
        tasks_per_gpu=0,  # SLURM: no --ntasks-per-gpu, which the executor would otherwise derive from `tasks`
        **PRETRAIN_MULTI_NODE,
    params:
        python=PYTHON,
        launcher=LAUNCHER,
        ranks_per_node=TRAIN.gpus,
    # --log, not a shell redirect: the launcher takes the state lock first, so a refused second run never truncates
    # a running one's log, and keeps every attempt's log in logs/{name}/pretrain.attempts/.
    shell:
        "{params.python} {params.launcher} --ranks {params.ranks_per_node} --plan {input.plan} --log {log}"
