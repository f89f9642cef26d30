"""pretrain-bench library, one subpackage per pipeline stage; the rule scripts in workflow_scripts/ are thin adapters.

Imports point down only: report → bench → evaluate → train → data → config → core (tests/unit/test_imports.py holds
the order and checks it, deferred imports included).
"""
