"""The workflow's planning, out of the rule files: what rules/common.smk builds once when Snakemake reads the
Snakefile (every block's settings, built once from the validated config: experiment; the data products, the
benchmark matrix, the GPU count from `--resources gpu`: pipeline), the rules' input and param functions as plain
methods cached by cell, the pre-flight a dry run prints (preflight), and the lines a failed or interrupted job leaves
on the terminal (failures). The top layer: it may import every stage, and no stage imports it."""
