"""pretrain-bench library: one module per concern; the rule scripts in workflow_scripts/ are thin adapters."""
