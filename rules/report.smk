# The report: built only from summary.json, metrics.jsonl and eval/*.json of this run.


rule report:
    input:
        summary="results/{name}/train/summary.json",
        metrics="results/{name}/train/metrics.jsonl",
        evals=lambda wildcards: eval_outputs(wildcards.name),
    output:
        md=report("results/{name}/report/report.md", category="Report"),
        html=report("results/{name}/report/report.html", category="Report"),
        plots=directory("results/{name}/report/plots"),
    log:
        "logs/{name}/report.log",
    conda:
        "../envs/report.yaml"
    params:
        target_corpus_tokens=config["report"]["target_corpus_tokens"],
    script:
        "../workflow_scripts/build_report.py"
