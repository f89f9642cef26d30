"""What a rerun does with the state folder: resume, start fresh beside the old run, or train again."""
import json
from pathlib import Path

from pretrain_bench.train.checkpoint import committed_steps, write_marker
from pretrain_bench.train.run_state import fingerprint_id, mark_finished, prepare_state

ROOT = Path(__file__).resolve().parents[2]

FP = {"model": {"preset": "tiny"}, "train": {"lr": 0.003, "seed": 1}, "data": "abc"}
OTHER = {**FP, "train": {"lr": 0.001, "seed": 1}}


def fake_run(state: Path, fingerprint: dict, steps: list[int], world_size: int = 2) -> None:
    """A state folder as a training job leaves it: committed checkpoints, metrics, the active marker."""
    for step in steps:
        (state / "checkpoints" / f"step{step}").mkdir(parents=True)
        (state / "checkpoints" / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"w" * step)
        write_marker(state / "checkpoints", step, {"fingerprint": fingerprint, "world_size": world_size})
    (state / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps[-1] + 1)))
    (state / "ACTIVE.json").write_text(json.dumps({"fingerprint": fingerprint, "id": fingerprint_id(fingerprint)}))


def test_same_settings_resume_in_place_and_touch_nothing(tmp_path):
    from support import tree_digest

    fake_run(tmp_path, FP, [10, 20])
    mark_finished(tmp_path, 20, "plan-a")
    before = tree_digest(tmp_path)
    assert prepare_state(tmp_path, FP, 40, "plan-b", [10, 20, 30, 40], 2) == []  # more steps: continue
    assert tree_digest(tmp_path) == before, "a run refused after this point must find the folder as it was"


def test_changed_settings_start_fresh_and_keep_the_old_run_which_comes_back(tmp_path):
    fake_run(tmp_path, FP, [10, 20])
    messages = prepare_state(tmp_path, OTHER, 20, "plan-b", [10, 20], 2)
    kept = tmp_path / "runs" / fingerprint_id(FP)
    assert len(messages) == 1 and "(train.lr)" in messages[0] and str(kept) in messages[0]
    assert committed_steps(tmp_path / "checkpoints") == [] and not (tmp_path / "metrics.jsonl").exists()
    assert committed_steps(kept / "checkpoints") == [10, 20] and (kept / "metrics.jsonl").is_file()
    # the new run trains a little, then the user edits the learning rate back: the old run resumes
    fake_run(tmp_path, OTHER, [10])
    messages = prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 2)
    assert any("resuming the run kept in" in m for m in messages)
    assert committed_steps(tmp_path / "checkpoints") == [10, 20] and not kept.exists()
    assert committed_steps(tmp_path / "runs" / fingerprint_id(OTHER) / "checkpoints") == [10]


def test_a_finished_run_with_the_same_plan_is_never_trained_again(tmp_path):
    from support import tree_digest

    fake_run(tmp_path, FP, [10, 20])
    mark_finished(tmp_path, 20, "plan-a")
    before = tree_digest(tmp_path)
    messages = prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 2)  # --forcerun pretrain, or outputs deleted
    assert len(messages) == 1 and "resuming at its final checkpoint to rewrite the outputs" in messages[0]
    assert f"move {tmp_path} away first" in messages[0]
    assert tree_digest(tmp_path) == before and not (tmp_path / "runs").exists()


def test_a_finished_run_whose_plan_changed_only_outside_the_weights_is_reused(tmp_path):
    fake_run(tmp_path, FP, [10, 20])
    mark_finished(tmp_path, 20, "plan-a")
    # e.g. train.warmup_timing_steps edited: every kept checkpoint exists, so resume at the end
    messages = prepare_state(tmp_path, FP, 20, "plan-b", [10, 20], 2)
    assert "resuming at its final checkpoint" in messages[0] and committed_steps(tmp_path / "checkpoints") == [10, 20]
    # train.checkpoint_every edited to 5: step 5 and 15 do not exist, so it trains again
    mark_finished(tmp_path, 20, "plan-b")
    messages = prepare_state(tmp_path, FP, 20, "plan-c", [5, 10, 15, 20], 2)
    assert "[5, 15]" in messages[0] and "training again" in messages[0]
    assert committed_steps(tmp_path / "checkpoints") == []


def test_a_state_folder_from_before_active_markers_is_read_from_its_checkpoints(tmp_path):
    fake_run(tmp_path, FP, [10])
    (tmp_path / "ACTIVE.json").unlink()
    prepare_state(tmp_path, OTHER, 20, "plan", [10, 20], 2)
    assert committed_steps(tmp_path / "runs" / fingerprint_id(FP) / "checkpoints") == [10]


def test_a_world_size_edit_starts_fresh_keeping_the_old_run_which_comes_back_at_its_size(tmp_path):
    fake_run(tmp_path, FP, [10, 20], world_size=2)
    messages = prepare_state(tmp_path, FP, 40, "plan-b", [10, 20, 30, 40], 3)  # train.gpus 2 -> 3
    kept = tmp_path / "runs" / f"{fingerprint_id(FP)}-world2"
    assert len(messages) == 1 and "world size changed" in messages[0] and "2 → 3" in messages[0]
    assert str(kept) in messages[0] and "starts fresh" in messages[0] and "train.allow_reshape" in messages[0]
    assert committed_steps(tmp_path / "checkpoints") == [] and committed_steps(kept / "checkpoints") == [10, 20]
    # the fresh run at 3 ranks saves step 10; back at 2 ranks, the old run comes back and the new one is kept
    fake_run(tmp_path, FP, [10], world_size=3)
    messages = prepare_state(tmp_path, FP, 40, "plan-a", [10, 20, 30, 40], 2)
    assert any(f"resuming the run kept in {kept}" in m for m in messages) and not kept.exists()
    assert committed_steps(tmp_path / "checkpoints") == [10, 20]
    assert committed_steps(tmp_path / "runs" / f"{fingerprint_id(FP)}-world3" / "checkpoints") == [10]


def test_a_world_size_edit_resumes_reshaped_where_allowed_but_never_reshapes_a_finished_run(tmp_path):
    fake_run(tmp_path, FP, [10, 20], world_size=2)
    messages = prepare_state(tmp_path, FP, 40, "plan-b", [10, 20, 30, 40], 3, allow_reshape=True)
    assert len(messages) == 1 and "resuming it reshaped" in messages[0] and "world size 2" in messages[0]
    assert committed_steps(tmp_path / "checkpoints") == [10, 20]
    mark_finished(tmp_path, 20, "plan-a")
    messages = prepare_state(tmp_path, FP, 20, "plan-c", [10, 20], 3, allow_reshape=True)
    assert "nothing to continue" in messages[0] and committed_steps(tmp_path / "checkpoints") == []


def test_a_world_size_edit_back_to_a_kept_size_says_once_that_the_kept_run_resumes(tmp_path):
    """Finished at 3 ranks, then at 2 (the 3-rank run kept), then back at 3: the 2-rank run is set aside and the
    3-rank run resumes, said in one line that never says 'starts fresh'."""
    fake_run(tmp_path, FP, [10, 20], world_size=3)
    mark_finished(tmp_path, 20, "plan-a")
    world3 = tmp_path / "runs" / f"{fingerprint_id(FP)}-world3"
    world2 = tmp_path / "runs" / f"{fingerprint_id(FP)}-world2"
    (fresh,) = prepare_state(tmp_path, FP, 20, "plan-b", [10, 20], 2)
    assert f"that run is kept in {world3}" in fresh and fresh.endswith("starts fresh (set train.allow_reshape: true "
                                                                       "to continue it at the new size instead)")
    fake_run(tmp_path, FP, [10, 20], world_size=2)
    mark_finished(tmp_path, 20, "plan-b")
    messages = prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 3)
    assert messages == [f"the world size changed since the run in {tmp_path} (train.gpus × train.nodes: 2 → 3): that "
                        f"run is kept in {world2} and resumes when the world size is 2 again; resuming the run kept "
                        f"in {world3} (these settings, saved at world size 3)"]
    assert committed_steps(tmp_path / "checkpoints") == [10, 20] and not world3.exists()
    assert committed_steps(world2 / "checkpoints") == [10, 20]


def test_settings_edited_back_set_the_other_run_aside_and_resume_the_kept_one_in_one_line(tmp_path):
    fake_run(tmp_path, FP, [10])
    prepare_state(tmp_path, OTHER, 20, "plan-b", [10, 20], 2)
    fake_run(tmp_path, OTHER, [10])
    messages = prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 2)
    kept_fp, kept_other = (tmp_path / "runs" / fingerprint_id(fp) for fp in (FP, OTHER))
    assert messages == [f"the settings changed since the run in {tmp_path} (train.lr): that run is kept in "
                        f"{kept_other}; resuming the run kept in {kept_fp} (these settings, saved at world size 2)"]
    assert not any("starts fresh" in message for message in messages)
