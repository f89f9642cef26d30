# download_corpus: read corpus.sources, clean, de-duplicate, cap and split them into train/val jsonl + manifest.
# The corpus lives under results/data/corpus-<id>/, the id a digest of the corpus settings (DATA, rules/common.smk):
# every run with the same corpus settings shares it. Downloads and the datasets cache live in resources/corpus-cache,
# outside results/, so that a re-run with other cleaning settings does not fetch again. See
# workflow_scripts/pretrain_bench/corpus.py for each cleaning step.


rule download_corpus:
    input:
        # the local files of file:// sources (globs expanded when the DAG is built): editing one rebuilds the corpus
        files=CORPUS_FILES,
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
    script:
        "../workflow_scripts/download_corpus.py"
