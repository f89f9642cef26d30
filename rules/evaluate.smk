# Held-out evaluation of every kept checkpoint of the main run.


rule evaluate:
    input:
        plan="results/{name}/train/plan.json",
        summary="results/{name}/train/summary.json",
    output:
        "results/{name}/eval/step{step}.json",
    log:
        "logs/{name}/evaluate/step{step}.log",
    benchmark:
        "benchmarks/{name}/evaluate/step{step}.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: 1
    params:
        max_tokens=config["evaluate"]["max_tokens"],
        batch_size=config["evaluate"]["batch_size"],
    script:
        "../workflow_scripts/evaluate_checkpoint.py"
