# pretrain-bench: corpus → tokenizer → token shards → DeepSpeed pretraining → evaluation → report.
# Usage: snakemake --cores 32 --resources gpu=3          (config.yaml: the 3-GPU experiment)
#        snakemake -n --cores 32 --resources gpu=3       (dry-run: show the DAG)
#        snakemake --cores 2 --resources gpu=3 --configfile config/tiny-cpu.yaml   (tiny CPU run)
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/corpus.smk"
include: "rules/tokenizer.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/benchmark.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
