"""The pre-flight memory model (model), what a run does when it predicts a run does not fit (fit), and the time that
offloaded optimizer states cost per step (offload)."""
