"""The training engines behind one interface, `Engine`: DeepSpeed, PyTorch DDP and PyTorch FSDP2.

The Trainer knows only `Engine`: it takes the class of train.engine (`engine_class`) and asks it, never which engine
it holds. Each engine wraps the same model, data and schedule.

Optimizer maths is the same everywhere: AdamW (train.lr, adam_betas, adam_eps, weight_decay on every parameter),
gradients averaged over ranks and accumulation micro-steps, the global norm clipped to train.grad_clip, and a LambdaLR
over `settings.learning_rate` stepped once per optimizer step that was not skipped (an fp16 overflow skips both, as
DeepSpeed does). That is why DDP and DeepSpeed ZeRO-0 in fp32 train to the same losses.

Checkpoints: DeepSpeed writes its own layout (mp_rank_00_model_states.pt, ZeRO partitions). DDP's states are the
same on every rank, so rank 0 writes model.pt (the module's state dict) and optimizer.pt. FSDP writes a
torch.distributed.checkpoint folder (`dcp/`, one file per rank plus .metadata), which any world size loads. Every
rank also writes engine_rank<r>.pt (scheduler, loss scaler, skipped steps) — except DeepSpeed, which keeps those in
its own files. Each engine class reads its own layout back (`holds_checkpoint`, `read_model_state`) for the HF
export (`checkpointer.load_fp32_state_dict`).

What the planning knows of each engine is its spec (spec.py: layout, checks, DeepSpeed's config, memory terms, fit
rungs, labels), read without importing torch; the engine classes themselves are registered by name in registry.py.
"""
