# Tokenizer and token shards: train (or adopt) the tokenizer, encode each split in shards.count parallel slices,
# gather the shards' sidecars into index.json for the trainer and evaluator. Both live inside the corpus folder they
# are made from, under ids of their own settings (DATA, rules/common.smk): results/data/corpus-<c>/tokenizer-<t>/ and
# .../tokenizer-<t>/shards-<s>/, shared by every run with the same data settings.


# An adopted tokenizer (tokenizer.path, or model.init_from's) with the content of a tokenizer product of this corpus
# (a sibling's export of its own tokenizer) is that product, read as it is: no job writes it again, and its shards are
# reused (pretrain_bench/data/products.py).
if not DATA.reused_tokenizer:

    rule train_tokenizer:
        input:
            train=f"results/{DATA.corpus}/train.jsonl",
            # an adopted tokenizer (tokenizer.path, or model.init_from's) is an input too: editing it makes a new
            # tokenizer id (its content's), and so new shards beside the old
            adopted=ADOPTED_TOKENIZER or [],
        output:
            tokenizer_json=DATA.tokenizer_json,
            tokenizer_config=f"results/{DATA.tokenizer}/tokenizer_config.json",
        log:
            f"logs/{DATA.tokenizer}/train_tokenizer.log",
        benchmark:
            f"benchmarks/{DATA.tokenizer}/train_tokenizer.tsv"
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
        corpus=f"results/{DATA.corpus}/{{split}}.jsonl",
        tokenizer=DATA.tokenizer_json,
    output:
        bin=f"results/{DATA.shards}/{{split}}-{{shard}}.bin",
        meta=f"results/{DATA.shards}/{{split}}-{{shard}}.json",
    log:
        f"logs/{DATA.shards}/shard_tokens/{{split}}-{{shard}}.log",
    benchmark:
        f"benchmarks/{DATA.shards}/shard_tokens/{{split}}-{{shard}}.tsv"
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
            "results/{shards}/{split}-{shard:05d}.bin",
            shards=DATA.shards,
            split=["train", "val"],
            shard=range(SHARDS.count),
        ),
        meta=expand(
            "results/{shards}/{split}-{shard:05d}.json",
            shards=DATA.shards,
            split=["train", "val"],
            shard=range(SHARDS.count),
        ),
    output:
        index=report(DATA.index, category="Tokens"),
    log:
        f"logs/{DATA.shards}/index_shards.log",
    benchmark:
        f"benchmarks/{DATA.shards}/index_shards.tsv"
    conda:
        "../envs/pretrain.yaml"
    script:
        "../workflow_scripts/index_shards.py"
