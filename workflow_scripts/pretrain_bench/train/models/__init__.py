"""Model families: the LLaMA family's shapes, presets, parameter count and HF classes (llama), its native torch twin
(native_llama), and FLOPs per token and device peaks for MFU (flops)."""
