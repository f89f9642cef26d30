# download_corpus: read corpus.sources, clean, de-duplicate, cap and split them into train/val jsonl + manifest.
# Downloads and the datasets cache live in resources/corpus-cache, outside results/, so that a re-run with other
# cleaning settings does not fetch again. See workflow_scripts/pretrain_bench/corpus.py for each cleaning step.


rule download_corpus:
    input:
        # the local files of file:// sources (globs expanded when the DAG is built): editing one rebuilds the corpus
        files=CORPUS_FILES,
    output:
        train="results/{name}/corpus/train.jsonl",
        val="results/{name}/corpus/val.jsonl",
        manifest=report("results/{name}/corpus/manifest.json", category="Corpus"),
    log:
        "logs/{name}/download_corpus.log",
    benchmark:
        "benchmarks/{name}/download_corpus.tsv"
    conda:
        "../envs/pretrain.yaml"
    params:
        corpus=CORPUS.as_dict(),
        cache_dir="resources/corpus-cache",
    script:
        "../workflow_scripts/download_corpus.py"
