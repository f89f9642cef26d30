"""What the Snakemake workflow needs from the library, above every stage: the experiment's settings built once from
the validated config (experiment), and the planning the rules ask for."""
