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
        sources=config["corpus"]["sources"],
        # every key has its default in the schema, filled in when the config was validated
        max_bytes=config["corpus"]["max_bytes"],
        min_chars=config["corpus"]["min_chars"],
        dedup=config["corpus"]["dedup"],
        val_fraction=config["corpus"]["val_fraction"],
        encoding_errors=config["corpus"]["encoding_errors"],
        seed=config["corpus"]["seed"],
        cache_dir="resources/corpus-cache",
    script:
        "../workflow_scripts/download_corpus.py"
