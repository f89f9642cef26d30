"""The Checkpointer on a real engine at world size 1: a save is committed with every file of the folder in its marker,
FSDP's torch.distributed.checkpoint files included (hashed at commit, as the marker records them); a damaged one
fails verification, the resume falls back to the checkpoint before it, and the restore puts back the saved weights
bit for bit."""
import hashlib
from pathlib import Path

import pytest
import torch

from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.checkpoints.checkpointer import Checkpointer, ResumePoint
from pretrain_bench.train.engines.registry import DCP_FOLDER, EngineRun, FSDPEngine, engine_state_file
from pretrain_bench.train.models.llama import ModelShape, build_model
from pretrain_bench.train.settings import TrainSettings
from pretrain_bench.train.step import PhaseTimer, train_step
from support import RandomBatches

SHAPE = ModelShape(1, 32, 2, 2, 64, 97)
B, T, STEPS = 2, 8, 4


def fsdp_engine(settings) -> FSDPEngine:
    run = EngineRun(device="cpu", total_steps=STEPS, measure_comm=False, pin_memory=True, reshape=False)
    return FSDPEngine(build_model(SHAPE, T, seed=0), settings, run)


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.full_tensor().clone() for name, tensor in engine.model.state_dict().items()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fsdp_checkpoints_are_committed_verified_set_aside_and_restored(process_group, tmp_path):
    settings = TrainSettings(engine="fsdp", device="cpu", precision="fp32", zero_stage=3, micro_batch_size=B,
                             grad_accum_steps=1, comm_backend="gloo", max_steps=STEPS, warmup_steps=1,
                             checkpoint_every=2, keep_checkpoints=None, verify_checkpoints="full")
    notices = []
    checkpointer = Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1, run_device="cpu",
                                fingerprint={"run": "a"}, saves=True, log=notices.append)
    engine, batches, saved = fsdp_engine(settings), RandomBatches(SHAPE.vocab_size, B, T), {}
    for step in range(1, STEPS + 1):
        train_step(engine, batches, micro_steps=1, vocab=SHAPE.vocab_size, run_device="cpu", timer=PhaseTimer("cpu"))
        if checkpointer.due(step):
            checkpointer.save(step, engine, {"position": step}, tokens=step * B * T)
            saved[step] = weights(engine)
    assert sorted(saved) == [2, 4] and checkpointer.committed() == [2, 4] and checkpointer.last_saved == 4

    # every file of the folder is in the marker, the DCP files with the sha256 of their bytes
    marker = ckpt.read_marker(tmp_path, 4)
    folder = tmp_path / "step4"
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {ckpt.MARKER}
    assert set(marker["files"]) == on_disk
    dcp_files = sorted(name for name in on_disk if name.startswith(DCP_FOLDER + "/"))
    assert f"{DCP_FOLDER}/.metadata" in dcp_files and len(dcp_files) >= 2, dcp_files
    assert {engine_state_file(0), "rng_rank0.pt"} <= on_disk
    for name in dcp_files:
        assert marker["files"][name]["sha256"] == sha256(folder / name)
    assert marker["loader"] == {"position": 4} and marker["tokens"] == 4 * B * T

    # one flipped byte in a DCP data file: step 4 fails verification, is set aside, and the resume falls back to 2
    data_file = folder / next(name for name in dcp_files if name.endswith(".distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match=f"{data_file} does not match the sha256 recorded"):
        ckpt.verify(tmp_path, 4, "full")
    point = Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1, run_device="cpu", fingerprint={"run": "a"},
                         saves=True, log=notices.append).resume_point(True)
    assert point == ResumePoint(2, ckpt.read_marker(tmp_path, 2), reshape=False)
    assert ckpt.committed_steps(tmp_path) == [2] and ckpt.set_aside_steps(tmp_path, "damaged") == [4]
    assert any(f"{data_file} does not match" in notice and "falling back to checkpoint step 2" in notice
               for notice in notices)

    # the restore puts back step 2's weights, bit for bit, into an engine built from scratch
    fresh, restorer = fsdp_engine(settings), Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1,
                                                          run_device="cpu", fingerprint={"run": "a"}, saves=True,
                                                          log=notices.append)
    assert restorer.restore(fresh, point) == tmp_path / "step2"
    restored = weights(fresh)
    assert restored.keys() == saved[2].keys()
    assert all(torch.equal(restored[name], saved[2][name]) for name in restored)
    assert not all(torch.equal(saved[2][name], saved[4][name]) for name in restored), "steps 2 and 4 differ"
    assert restorer.resumed_from == restorer.last_saved == 2

    # another configuration's checkpoint is refused, naming what changed
    with pytest.raises(ckpt.CheckpointError, match=r"belongs to a different configuration \(run changed\)"):
        Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1, run_device="cpu", fingerprint={"run": "b"},
                     saves=True, log=notices.append).resume_point(True)


def test_a_run_that_saves_nothing_is_never_due(tmp_path):
    settings = TrainSettings(max_steps=STEPS, warmup_steps=1, checkpoint_every=2)
    every = Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1, run_device="cpu", fingerprint={},
                         saves=True, log=print)
    assert [step for step in range(1, 6) if every.due(step)] == [2, 4]
    never = Checkpointer(tmp_path, settings, seq_len=T, rank=0, world=1, run_device="cpu", fingerprint={},
                         saves=False, log=print)
    assert not any(never.due(step) for step in range(1, 6))
