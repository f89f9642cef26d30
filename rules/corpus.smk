# The corpus: read corpus.sources, clean, de-duplicate, cap and split them into train/val jsonl + manifest.
# It lives under results/data/corpus-<id>/, the id a digest of the corpus settings (DATA, rules/common.smk): every run
# with the same corpus settings shares it. With CORPUS_PARTS > 1 (corpus.jobs; null: this machine's CPUs, or one job where a cap stops it sooner) the
# cleaning runs as that many clean_corpus_part jobs over contiguous slices of the sources' files, each writing its
# documents' lines per split with a small record per document, and download_corpus merges them into the corpus one
# job writes, deciding from the records and copying byte ranges (pretrain_bench/data/corpus_parts.py); the parts are
# temporary. Downloads and the datasets cache live in resources/corpus-cache, outside results/, so that a re-run with
# other cleaning settings does not fetch again. See workflow_scripts/pretrain_bench/data/corpus.py for each cleaning step.
from pretrain_bench.data.corpus_parts import corpus_parts, machine_cpus

CORPUS_PARTS = corpus_parts(list(CORPUS.sources), CORPUS.jobs, machine_cpus(), CORPUS.max_bytes)


rule clean_corpus_part:
    input:
        files=CORPUS_FILES,
    output:
        train=temp(f"results/{DATA.corpus}/parts/part-{{part}}.train.jsonl"),
        val=temp(f"results/{DATA.corpus}/parts/part-{{part}}.val.jsonl"),
        records=temp(f"results/{DATA.corpus}/parts/part-{{part}}.records"),
        stats=temp(f"results/{DATA.corpus}/parts/part-{{part}}.json"),
    log:
        f"logs/{DATA.corpus}/clean_corpus_part/part-{{part}}.log",
    benchmark:
        f"benchmarks/{DATA.corpus}/clean_corpus_part/part-{{part}}.tsv"
    wildcard_constraints:
        part=r"\d{5}",
    conda:
        "../envs/pretrain.yaml"
    params:
        corpus=CORPUS.as_dict(),
        cache_dir="resources/corpus-cache",
        parts=CORPUS_PARTS,
    script:
        "../workflow_scripts/clean_corpus_part.py"


rule download_corpus:
    input:
        # the local files of file:// sources (globs expanded when the DAG is built): editing one rebuilds the corpus
        files=CORPUS_FILES,
        # every file of every part: Snakemake deletes a temporary file once no job left needs it
        parts=expand(
            "results/{corpus}/parts/part-{part:05d}.{ext}",
            corpus=DATA.corpus,
            part=range(CORPUS_PARTS) if CORPUS_PARTS > 1 else [],
            ext=["json", "train.jsonl", "val.jsonl", "records"],
        ),
    output:
        train=f"results/{DATA.corpus}/train.jsonl",
        val=f"results/{DATA.corpus}/val.jsonl",
        manifest=report(DATA.manifest, category="Corpus"),
    log:
        f"logs/{DATA.corpus}/download_corpus.log",
    benchmark:
        f"benchmarks/{DATA.corpus}/download_corpus.tsv"
    conda:
        "../envs/pretrain.yaml"
    params:
        corpus=CORPUS.as_dict(),
        cache_dir="resources/corpus-cache",
        parts=CORPUS_PARTS,
    script:
        "../workflow_scripts/download_corpus.py"
