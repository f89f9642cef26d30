"""Checkpoints verify themselves: hashes recorded while saving, damaged checkpoints set aside with a fallback, and a
failed save (a full disk: a real small tmpfs when this test may mount one, else a simulated ENOSPC) that says why and
leaves no partial folder."""
import errno
import hashlib
import json
from pathlib import Path

import pytest
import torch

from pretrain_bench.config.schema import schema_default
from pretrain_bench.core import digests
from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.settings import VERIFY_MODES
from support import mounted_tmpfs, tree_digest


@pytest.fixture
def small_samples(monkeypatch):
    """Sample windows small enough for test files: 512 bytes at every 4 KiB."""
    monkeypatch.setattr(digests, "SAMPLE_BYTES", 512)
    monkeypatch.setattr(digests, "SAMPLE_STRIDE", 4096)


def save_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint as training writes one: files through CheckpointWriter, a file written by someone else, marker."""
    folder = root / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    writer = ckpt.CheckpointWriter(step, folder)
    generator = torch.Generator().manual_seed(step)
    writer.save({"module": {"w": torch.randn(64, 64, generator=generator)}}, folder / "mp_rank_00_model_states.pt")
    for rank in range(2):
        writer.save({"optimizer_state_dict": {"exp_avg": torch.randn(4000, generator=generator)}},
                    str(folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    (folder / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script, copied beside the shards\n")
    assert writer.error is None
    ckpt.write_marker(root, step, {"world_size": 2}, writer.files)
    return folder


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_marker_records_every_file_with_the_hashes_taken_while_saving(tmp_path, small_samples):
    folder = save_checkpoint(tmp_path, 2)
    marker = json.loads((folder / ckpt.MARKER).read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name != ckpt.MARKER)
    assert sorted(marker["files"]) == names, "every file of the folder is listed, the copied script too"
    for name, record in marker["files"].items():
        data = (folder / name).read_bytes()
        assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
        sampled = b"".join(data[o:o + 512] for o in range(0, len(data), 4096))
        assert record["sampled_sha256"] == hashlib.sha256(sampled).hexdigest()
    state = torch.load(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    assert state["optimizer_state_dict"]["exp_avg"].shape == (4000,), "the hashing writer wrote a loadable file"
    assert not (folder / (ckpt.MARKER + ".tmp")).exists()
    assert ckpt.verify(tmp_path, 2)["world_size"] == 2 and ckpt.verify(tmp_path, 2, "full")


def test_verify_names_a_truncated_file_and_by_default_finds_any_changed_byte(tmp_path, small_samples):
    folder = save_checkpoint(tmp_path, 2)
    shard = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    assert size > 3 * 4096
    # A byte outside every sampled window: the default (full) check finds it, the sampled opt-out cannot see it.
    flip_byte(shard, 4096 + 1000)
    with pytest.raises(ckpt.CheckpointError, match=f"{shard} does not match the sha256 recorded"):
        ckpt.verify(tmp_path, 2)
    ckpt.verify(tmp_path, 2, "sampled")
    flip_byte(shard, 4096 + 1000)
    flip_byte(shard, 2 * 4096 + 10)  # inside a sampled window
    with pytest.raises(ckpt.CheckpointError, match=f"{shard} does not match the sampled sha256"):
        ckpt.verify(tmp_path, 2, "sampled")
    flip_byte(shard, 2 * 4096 + 10)
    with open(shard, "r+b") as handle:
        handle.truncate(size // 2)
    for mode in VERIFY_MODES:
        with pytest.raises(ckpt.CheckpointError) as caught:
            ckpt.verify(tmp_path, 2, mode)
        assert f"{shard} has {size // 2:,} bytes, {size:,} were saved" in str(caught.value)


def test_the_default_check_finds_same_size_damage_in_several_files_and_names_each(tmp_path):
    """Real sample windows (1 MiB in every 64 MiB): bytes overwritten in place past the first MiB of a file, as a
    bad disk block or a stray writer leaves them, pass the sampled opt-out and fail the default check, which names
    every damaged file and leaves the others unnamed."""
    folder = tmp_path / "step3"
    folder.mkdir()
    writer = ckpt.CheckpointWriter(3, folder)
    for rank in range(3):
        writer.save({"w": torch.randn(600_000)}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    ckpt.write_marker(tmp_path, 3, {"world_size": 3}, writer.files)
    damaged = [folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 2)]
    for path in damaged:
        size = path.stat().st_size
        with open(path, "r+b") as handle:  # same size, in place
            handle.seek(2 << 20)
            handle.write(b"\xff" * 4096)
        assert path.stat().st_size == size
    assert schema_default("train", "verify_checkpoints") == "full"
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.verify(tmp_path, 3)
    message = str(caught.value)
    for path in damaged:
        assert f"{path} does not match the sha256 recorded when it was saved" in message
    assert "zero_pp_rank_1" not in message
    assert ckpt.verify(tmp_path, 3, "sampled")["step"] == 3, "the opt-out's windows miss it: why it is not default"


def test_damaged_newest_checkpoints_are_set_aside_and_the_newest_good_one_is_chosen(tmp_path, small_samples):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step)
    good = tree_digest(tmp_path / "step2")
    shard = tmp_path / "step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(shard, "r+b") as handle:
        handle.truncate(100)  # what a full disk or a killed copy leaves
    (tmp_path / "step4" / ckpt.MARKER).write_text("")  # what a power cut leaves of an un-fsynced marker
    warnings = []
    assert ckpt.newest_verified(tmp_path, warn=warnings.append) == 2
    assert len(warnings) == 2
    assert str(shard) in warnings[0] and f"Moved it aside to {tmp_path / 'step6.damaged'}" in warnings[0]
    assert "falling back to checkpoint step 2" in warnings[0]
    assert f"{tmp_path / 'step4' / ckpt.MARKER} is empty" in warnings[1]
    assert ckpt.committed_steps(tmp_path) == [2]
    assert (tmp_path / "step6.damaged" / shard.name).stat().st_size == 100, "moved aside, not deleted"
    assert (tmp_path / "step4.damaged" / "mp_rank_00_model_states.pt").is_file()
    assert tree_digest(tmp_path / "step2") == good, "the good checkpoint is untouched"
    # A second damaged step 6 later does not overwrite the first one set aside.
    save_checkpoint(tmp_path, 6)
    (tmp_path / "step6" / "mp_rank_00_model_states.pt").unlink()
    assert ckpt.newest_verified(tmp_path, warn=warnings.append) == 2
    assert (tmp_path / "step6.damaged2").is_dir() and "mp_rank_00_model_states.pt is missing" in warnings[-1]


def test_when_no_checkpoint_verifies_the_error_names_the_files_and_nothing_moves(tmp_path, small_samples):
    for step in (2, 4):
        save_checkpoint(tmp_path, step)
    (tmp_path / "step2" / "zero_to_fp32.py").unlink()
    (tmp_path / "step4" / ckpt.MARKER).write_text('{"step": 4, "fi')
    before = tree_digest(tmp_path)
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.newest_verified(tmp_path, warn=pytest.fail)
    message = str(caught.value)
    assert f"no checkpoint in {tmp_path} verifies" in message
    assert f"{tmp_path / 'step2' / 'zero_to_fp32.py'} is missing" in message
    assert f"{tmp_path / 'step4' / ckpt.MARKER} is not valid JSON" in message
    assert tree_digest(tmp_path) == before, "starting over is the user's decision: nothing renamed"
    assert ckpt.newest_verified(tmp_path / "none-yet") is None


def test_markers_from_before_file_lists_still_resume(tmp_path):
    folder = tmp_path / "step3"
    folder.mkdir()
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (folder / ckpt.MARKER).write_text(json.dumps({"step": 3, "world_size": 1}))
    assert ckpt.newest_verified(tmp_path, warn=pytest.fail) == 3


def test_incomplete_folders_are_removed_committed_ones_kept(tmp_path, small_samples):
    save_checkpoint(tmp_path, 2)
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    (tmp_path / "step2.damaged").mkdir()
    assert ckpt.remove_incomplete(tmp_path) == [tmp_path / "step4"]
    assert ckpt.committed_steps(tmp_path) == [2] and (tmp_path / "step2.damaged").is_dir()


def test_simulated_enospc_is_reported_with_the_free_space_and_leaves_no_partial_file(tmp_path):
    folder = tmp_path / "step4"
    folder.mkdir()
    writer = ckpt.CheckpointWriter(4, folder, fail_after=10_000)
    writer.save({"w": torch.zeros(1000)}, folder / "mp_rank_00_model_states.pt")  # 4 KB: fits
    writer.save({"w": torch.zeros(100_000)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    writer.save({"w": torch.zeros(10)}, folder / "rng_rank0.pt")  # after a failure nothing more is written
    assert writer.error.startswith(f"saving checkpoint step 4 to {folder} failed: no space left on device (")
    assert "bytes free on the file system of" in writer.error
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in writer.error
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_model_states.pt"]
    assert list(writer.files) == ["mp_rank_00_model_states.pt"]


def test_other_save_errors_name_the_path_and_reason(tmp_path):
    message = ckpt.save_failure(8, tmp_path / "step8", PermissionError(errno.EACCES, "Permission denied",
                                                                       str(tmp_path / "step8" / "x.pt")))
    assert message == f"saving checkpoint step 8 to {tmp_path / 'step8'} failed: Permission denied " \
                      f"({tmp_path / 'step8' / 'x.pt'})"
    message = ckpt.save_failure(8, tmp_path / "step8", RuntimeError("PytorchStreamWriter failed writing file"))
    assert message.endswith("failed: RuntimeError: PytorchStreamWriter failed writing file")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs, where this test may mount one (root); skipped otherwise (the simulated test stands)."""
    with mounted_tmpfs(tmp_path, "256k", "the simulated ENOSPC test covers the message") as mount:
        yield mount


def test_real_full_disk_during_a_save(small_tmpfs):
    root = small_tmpfs / "checkpoints"
    (root / "step2").mkdir(parents=True)
    writer = ckpt.CheckpointWriter(2, root / "step2")
    writer.save({"w": torch.zeros(1000)}, root / "step2" / "mp_rank_00_model_states.pt")
    ckpt.write_marker(root, 2, {"world_size": 1}, writer.files)
    committed = tree_digest(root / "step2")
    folder = root / "step4"
    folder.mkdir()
    writer = ckpt.CheckpointWriter(4, folder)
    writer.save({"w": torch.zeros(200_000)}, folder / "mp_rank_00_model_states.pt")  # 800 KB > 256 KiB
    assert writer.error is not None, "the tmpfs is full"
    assert writer.error.startswith(f"saving checkpoint step 4 to {folder} failed: no space left on device (")
    assert writer.error.endswith(f"; writing {folder / 'mp_rank_00_model_states.pt'})")
    assert list(folder.iterdir()) == [], "the partial file is removed"
    assert ckpt.verify(root, 2, "full") and tree_digest(root / "step2") == committed


def test_checkpoints_set_aside_for_a_reason_are_kept_numbered_and_found_by_that_reason(tmp_path, small_samples):
    for step in (2, 4):
        save_checkpoint(tmp_path, step)
    digest = tree_digest(tmp_path / "step4")
    assert ckpt.aside_path(tmp_path, 4, "nonfinite") == tmp_path / "step4.nonfinite"
    assert ckpt.set_aside(tmp_path, 4, "nonfinite") == tmp_path / "step4.nonfinite"
    assert tree_digest(tmp_path / "step4.nonfinite") == digest, "renamed whole, nothing deleted"
    save_checkpoint(tmp_path, 4)
    assert ckpt.set_aside(tmp_path, 4, "nonfinite") == tmp_path / "step4.nonfinite2"
    ckpt.set_aside(tmp_path, 2)  # damaged: another reason
    assert ckpt.set_aside_steps(tmp_path, "nonfinite") == [4, 4]
    assert ckpt.set_aside_steps(tmp_path, "damaged") == [2]
    assert ckpt.committed_steps(tmp_path) == [] and ckpt.set_aside_steps(tmp_path / "none", "damaged") == []


def test_readable_markers_pass_over_an_empty_or_cut_marker(tmp_path, small_samples):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step)
    (tmp_path / "step6" / ckpt.MARKER).write_text("")
    (tmp_path / "step4" / ckpt.MARKER).write_text('{"step": 4, "fi')
    assert sorted(ckpt.readable_markers(tmp_path)) == [2]
    assert ckpt.newest_readable_marker(tmp_path)["step"] == 2
    (tmp_path / "step2" / ckpt.MARKER).write_text("")
    assert ckpt.newest_readable_marker(tmp_path) is None
