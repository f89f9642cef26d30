"""Model families: the interface the pipeline asks its questions through (family: parameter count, FLOPs per token,
HF config and class, building a model) and the families by name (registry); the LLaMA family's shapes, presets and HF
classes (llama), its native torch twin (native_llama), and the FLOPs formula and device peaks for MFU (flops)."""
