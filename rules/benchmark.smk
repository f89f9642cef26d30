# The benchmark matrix: every runnable cell of benchmark.matrix × benchmark.repeats is one training launch on
# resources.gpu = the cell's ranks (rules/common.smk decides at DAG time which cells run; bench/matrix.json lists
# all of them with the reasons the others were left out). Repeat r of every cell runs before repeat r + 1 of any
# (input previous_round), so the repeats of different cells interleave. A timed cell takes every core (threads), so
# no other job shares the machine unless benchmark.allow_concurrent. Runs keep no checkpoints and no HF export; their
# scratch state lives in bench-state/, outside the declared outputs.


# The machine's peak lives under results/data/machine-<id>/ (PEAK, rules/common.smk), the id a digest of the
# machine and software it depends on: every run name on this machine reads the same figure, measured once.
rule measure_peak:
    output:
        peak=report(PEAK.path, category="Benchmark"),
    log:
        f"logs/{PEAK.folder}/measure_peak.log",
    benchmark:
        f"benchmarks/{PEAK.folder}/measure_peak.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: BENCH_THREADS
    resources:
        gpu=1 if BENCH_MATRIX["device"] == "cuda" else 0,  # one GPU slot while it measures, as an evaluation
    params:
        # one peak per machine: no run's precision, nor its train.device as written (pretrain_bench.bench.peak)
        device=PEAK.identity["device"],
        identity=PEAK.identity,  # recorded beside the figure
        lock_dir=GPU_LOCK_DIR,
    script:
        "../workflow_scripts/measure_peak.py"


rule bench_matrix:
    input:
        peak=PEAK.path,
    output:
        matrix=report("results/{name}/bench/matrix.json", category="Benchmark"),
    log:
        "logs/{name}/bench/bench_matrix.log",
    conda:
        "../envs/pretrain.yaml"
    params:
        matrix=BENCH_MATRIX,
        model=MODEL.as_dict(),
        vocab_size=VOCAB_SIZE,
        grad_accum_steps=TRAIN.grad_accum_steps,
    script:
        "../workflow_scripts/write_bench_matrix.py"


rule plan_bench_cell:
    input:
        index=DATA.index,
        tokenizer=DATA.tokenizer_json,
        peak=PEAK.path,
    output:
        plan="results/{name}/bench/{cell}/rep{rep}/plan.json",
    log:
        "logs/{name}/bench/{cell}/rep{rep}/plan.log",
    wildcard_constraints:
        rep=r"\d+",
    conda:
        "../envs/pretrain.yaml"
    params:
        config=lambda wildcards: cell_plan_config(wildcards.cell),
        out_dir=subpath(output.plan, parent=True),
        state_dir="results/{name}/bench-state/{cell}/rep{rep}",
        data=DATA.record(),
    script:
        "../workflow_scripts/plan_bench_cell.py"


rule bench_cell:
    input:
        plan="results/{name}/bench/{cell}/rep{rep}/plan.json",
        previous_round=bench_previous_round,
        index=DATA.index,
    output:
        summary=report(
            "results/{name}/bench/{cell}/rep{rep}/summary.json",
            category="Benchmark",
            subcategory="{cell}",
            labels={"cell": "{cell}", "repeat": "{rep}"},
        ),
        metrics="results/{name}/bench/{cell}/rep{rep}/metrics.jsonl",
    log:
        "logs/{name}/bench/{cell}/rep{rep}/train.log",
    benchmark:
        "benchmarks/{name}/bench/{cell}/rep{rep}.tsv"
    wildcard_constraints:
        rep=r"\d+",
    conda:
        "../envs/pretrain.yaml"
    threads: BENCH_THREADS
    resources:
        gpu=lambda wildcards: bench_cell(wildcards.cell)["gpus"],
    params:
        python=PYTHON,
        launcher=LAUNCHER,
    shell:
        "{params.python} {params.launcher} --ranks {resources.gpu} --plan {input.plan} --log {log}"
