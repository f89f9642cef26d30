"""A run's checkpoints and state: the checkpoint files with their commit marker, verification, discovery, pruning and
conversion (files), the `Checkpointer` the ranks save, verify, fall back and prune through (checkpointer), and which
run the state folder holds and what a rerun does with it (run_state)."""
