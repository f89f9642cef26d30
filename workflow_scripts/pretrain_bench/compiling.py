"""train.compile: torch.compile on each decoder block, and the wall time spent compiling.

Per block rather than the whole model (what torchtitan does, and what measured faster here: README, "Compiling the
model"): every decoder block has the same code and shapes, so the blocks share one compiled graph (torch's
inline_inbuilt_nn_modules, on by default, makes parameters graph inputs rather than constants), the embedding and the
LM head stay eager for the engines' hooks, and `nn.Module.compile` compiles in place, so the state dict keeps its
names (no `_orig_mod.` prefix): checkpoints, the HF export and resume read the same keys with compile on or off.

Compilation is lazy (the first forward, and the first backward for its graph), so its time is what torch's dynamo
reports between the start and the end of each compilation (its compile callbacks, lazy backward compilations
included), summed: the summary reports it apart from the steady-state tokens/s, whose warm-up steps exclude it.
"""
from __future__ import annotations

import time

# What train.compile compiles: each decoder block. The measurement that chose it is in the README.
COMPILE_SCOPE = "decoder blocks"


class CompileClock:
    """Wall seconds spent compiling in this process since it was made (dynamo's start/end callbacks)."""

    def __init__(self):
        import torch._dynamo

        self.seconds, self.compilations = 0.0, 0
        self._started: float | None = None
        self._handler = torch._dynamo.callback_handler
        self._handler.register_start_callback(self._start)
        self._handler.register_end_callback(self._end)

    def _start(self, args=None) -> None:
        self._started = time.perf_counter()

    def _end(self, args=None) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compilations += 1
            self._started = None

    def close(self) -> None:
        self._handler.remove_start_callback(self._start)
        self._handler.remove_end_callback(self._end)

    def summary(self) -> dict:
        """summary.json's `compile`: what was compiled, the seconds spent compiling, how many compilations."""
        return {"scope": COMPILE_SCOPE, "time_s": self.seconds, "compilations": self.compilations}


def compile_blocks(model) -> CompileClock:
    """Compile each decoder block of an HF LLaMA model in place (inductor); returns the clock of its compilations.

    dynamic=False: the training batch keeps one shape, and a held-out evaluation's other batch shape gets a graph of
    its own instead of turning the training graph into a slower shape-generic one."""
    clock = CompileClock()
    for block in model.model.layers:
        block.compile(dynamic=False)
    return clock
