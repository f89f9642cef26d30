# download_corpus: read corpus.sources, clean, de-duplicate, cap and split them into train/val jsonl + manifest.
# Downloads and the datasets cache live in resources/corpus-cache, outside results/, so that a re-run with other
# cleaning settings does not fetch again. See workflow_scripts/pretrain_bench/corpus.py for each cleaning step.


rule download_corpus:
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
        max_bytes=config["corpus"].get("max_bytes", None),
        min_chars=config["corpus"].get("min_chars", 1),
        dedup=config["corpus"].get("dedup", True),
        val_fraction=config["corpus"].get("val_fraction", 0.01),
        encoding_errors=config["corpus"].get("encoding_errors", "replace"),
        seed=config["corpus"].get("seed", 1234),
        cache_dir="resources/corpus-cache",
    script:
        "../workflow_scripts/download_corpus.py"
