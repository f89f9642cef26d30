"""train.compile: torch.compile on each decoder block or on the whole model, and the wall time spent compiling.

What is compiled (`compile_scope`) was chosen by measurement per model class (README, "Compiling the model"):
- transformers' LlamaForCausalLM: each decoder block (what torchtitan does). Its whole model compiled measured slower
  (1.25× the blocks' step time) and took about three times as long to compile. The blocks have the same code and
  shapes, so they share one compiled graph (torch's inline_inbuilt_nn_modules, on by default, makes parameters graph
  inputs rather than constants).
- the native class (model.implementation native): the whole model, one graph from the embedding to the logits, as
  nanoGPT's --compile does (its step measured 0.92–0.97× the blocks', bench/bench_compile.py --implementation native),
  except under FSDP, whose per-layer sharding hooks stay outside the compiled graphs (per block there).
Either way the model is compiled in place, so the state dict keeps its names (no `_orig_mod.` prefix): checkpoints,
the HF export and resume read the same keys with compile on or off, and the engines wrap the model as they do in eager
mode. The whole model is compiled as its `forward` method, not as `nn.Module.compile` does (the module's call with its
hooks): DeepSpeed puts forward hooks on the model it wraps (its forward prologue and epilogue, timers, config queries),
which dynamo would otherwise trace as 18 small frames of DeepSpeed's own code, each counted as a compilation (19
compilations of a ZeRO-2 rank instead of 2-3: a forward, a backward and the held-out evaluation's no-grad forward).
Their cost measured too small to tell apart (2 ranks, ZeRO-2, cold cache: 89 and 99 against 97 and 89 CPU-s a run;
ZeRO-0 steps in one process, alternating: 1.005×), so this is about what the compile figures count and what dynamo
traces, not speed.

Compilation is lazy (the first forward, and the first backward for its graph), so its time is what torch's dynamo
reports between the start and the end of each compilation (its compile callbacks, lazy backward compilations
included), summed: the summary reports it apart from the steady-state tokens/s, whose warm-up steps exclude it.
"""
from __future__ import annotations

import time

from pretrain_bench.train.engines.spec import engine_spec

# summary.json's compile.scope for each scope
COMPILE_SCOPES = {"blocks": "decoder blocks", "model": "whole model"}


def compile_scope(implementation: str, engine: str) -> str:
    """What train.compile compiles for model.implementation and train.engine (the measured choice above)."""
    return "model" if implementation == "native" and engine_spec(engine).compiles_whole_model else "blocks"


class CompileClock:
    """Wall seconds spent compiling in this process since it was made (dynamo's start/end callbacks)."""

    def __init__(self, scope: str = "blocks"):
        import torch._dynamo

        self.scope = scope
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
        return {"scope": COMPILE_SCOPES[self.scope], "time_s": self.seconds, "compilations": self.compilations}


def compile_model(model, scope: str) -> CompileClock:
    """Compile an LLaMA causal LM (either class) in place with inductor: each decoder block (`blocks`) or the whole
    model (`model`); returns the clock of its compilations.

    dynamic=False: the training batch keeps one shape, and a held-out evaluation's other batch shape gets a graph of
    its own instead of turning the training graph into a slower shape-generic one."""
    clock = CompileClock(scope)
    if scope == "model":
        import torch

        model.forward = torch.compile(model.forward, dynamic=False)
    else:
        for block in model.model.layers:
            block.compile(dynamic=False)
    return clock
