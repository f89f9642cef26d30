"""Training: the run plan (plan), the train settings and their checks (settings), the launch of ranks (launcher,
forked_ranks, run_context, state_lock), the loop (trainer, rank, step, compiling, heldout), and what a run records
(metrics, trackers, run_summary). Engines, model families, the memory model and the checkpoints are subpackages of
their own."""
