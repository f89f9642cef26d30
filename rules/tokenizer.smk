# Tokenizer and token shards: train (or adopt) the tokenizer, encode each split in shards.count parallel slices,
# gather the shards' sidecars into index.json for the trainer and evaluator.


rule train_tokenizer:
    input:
        train="results/{name}/corpus/train.jsonl",
        # an adopted tokenizer (tokenizer.path, or model.init_from's) is an input too: editing it re-runs the stages
        # after it
        adopted=ADOPTED_TOKENIZER or [],
    output:
        tokenizer_json="results/{name}/tokenizer/tokenizer.json",
        tokenizer_config="results/{name}/tokenizer/tokenizer_config.json",
    log:
        "logs/{name}/train_tokenizer.log",
    benchmark:
        "benchmarks/{name}/train_tokenizer.tsv"
    conda:
        "../envs/pretrain.yaml"
    threads: 8
    params:
        vocab_size=TOKENIZER.vocab_size,
        train_bytes=TOKENIZER.train_bytes,
        path=ADOPTED_TOKENIZER,
    script:
        "../workflow_scripts/train_tokenizer.py"


rule shard_tokens:
    input:
        corpus="results/{name}/corpus/{split}.jsonl",
        tokenizer="results/{name}/tokenizer/tokenizer.json",
    output:
        bin="results/{name}/shards/{split}-{shard}.bin",
        meta="results/{name}/shards/{split}-{shard}.json",
    log:
        "logs/{name}/shard_tokens/{split}-{shard}.log",
    benchmark:
        "benchmarks/{name}/shard_tokens/{split}-{shard}.tsv"
    wildcard_constraints:
        split="train|val",
        shard=r"\d{5}",
    conda:
        "../envs/pretrain.yaml"
    threads: 2
    params:
        shard_count=SHARDS.count,
    script:
        "../workflow_scripts/shard_tokens.py"


rule index_shards:
    input:
        bins=expand(
            "results/{{name}}/shards/{split}-{shard:05d}.bin",
            split=["train", "val"],
            shard=range(SHARDS.count),
        ),
        meta=expand(
            "results/{{name}}/shards/{split}-{shard:05d}.json",
            split=["train", "val"],
            shard=range(SHARDS.count),
        ),
    output:
        index=report("results/{name}/shards/index.json", category="Tokens"),
    log:
        "logs/{name}/index_shards.log",
    benchmark:
        "benchmarks/{name}/index_shards.tsv"
    conda:
        "../envs/pretrain.yaml"
    params:
        seq_len=MODEL.seq_len,
    script:
        "../workflow_scripts/index_shards.py"
