"""Training: the run plan (plan), the launch of ranks (launcher, forked_ranks, run_context, state_lock), the loop
(trainer, rank, step, compiling, heldout), checkpoints and run state (checkpoint, checkpointer, run_state), and what
a run records (metrics, trackers, run_summary). The engines, the model families and the memory model are
subpackages of their own."""
