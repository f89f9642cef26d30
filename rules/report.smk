# The report: built only from this run's JSON files — the main run's summary.json, metrics.jsonl, eval/*.json and lm_eval/*.json,
# the machine's peak.json, and the benchmark's matrix.json and bench/<cell>/rep<r>/summary.json.


rule report:
    input:
        summary="results/{name}/train/summary.json",
        metrics="results/{name}/train/metrics.jsonl",
        evals=lambda wildcards: eval_outputs(wildcards.name),
        lm_eval=lambda wildcards: lm_eval_outputs(wildcards.name),
        matrix=lambda wildcards: bench_matrix_outputs(wildcards.name),
        bench=lambda wildcards: bench_summaries(wildcards.name),
        peak=PEAK.path,
    output:
        md=report("results/{name}/report/report.md", category="Report"),
        html=report("results/{name}/report/report.html", category="Report"),
        plots=report(directory("results/{name}/report/plots"), patterns=["{plot}.png"], category="Report"),
    log:
        "logs/{name}/report.log",
    conda:
        "../envs/report.yaml"
    params:
        target_corpus_tokens=REPORT.target_corpus_tokens,
        gpu_hour_price=REPORT.gpu_hour_price,
        # the --configfile arguments of this invocation: the report's command to measure the benchmark again names them
        configfiles=[str(path) for path in workflow.overwrite_configfiles],
    script:
        "../workflow_scripts/build_report.py"
