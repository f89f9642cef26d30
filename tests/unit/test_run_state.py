"""What a rerun does with the state folder: resume, start fresh beside the old run, or train again."""
import json
from pathlib import Path
from types import SimpleNamespace

from pretrain_bench.train.checkpoints.files import committed_steps, write_marker
from pretrain_bench.train.checkpoints.run_state import fingerprint_id, held_world_size, mark_finished, prepare_state

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


def test_an_empty_marker_in_the_newest_checkpoint_is_passed_over_as_the_resume_will(tmp_path):
    """A save whose COMMITTED.json never reached the disk: the decision before the resume reads the checkpoint
    before it (the resume sets the empty one aside), rather than stopping rank 0 on it."""
    fake_run(tmp_path, FP, [10, 20])
    (tmp_path / "checkpoints" / "step20" / "COMMITTED.json").write_text("")
    assert held_world_size(tmp_path) == 2
    assert prepare_state(tmp_path, FP, 40, "plan-a", [10, 20, 30, 40], 2) == []  # resumes; the resume falls back
    (tmp_path / "ACTIVE.json").unlink()  # a state folder from before ACTIVE.json: the fingerprint from step 10
    assert prepare_state(tmp_path, FP, 40, "plan-a", [10, 20, 30, 40], 2) == []
    # a finished run whose final marker is empty trains the steps after its newest readable checkpoint again
    mark_finished(tmp_path, 20, "plan-a")
    messages = prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 2)
    assert "its final checkpoint is gone, so the steps after 10 (its newest) are trained again" in messages[0]


def test_every_trackers_folder_moves_with_its_run_and_comes_back_with_it(tmp_path):
    from pretrain_bench.train.trackers import TRACKER_FOLDERS, TRACKERS

    assert set(TRACKER_FOLDERS) == {tracker.folder for tracker in TRACKERS.values()} >= {"tensorboard", "csv",
                                                                                          "wandb", "mlruns"}
    fake_run(tmp_path, FP, [10])
    for folder in TRACKER_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rows").write_text(f"{folder} of the first run")
    prepare_state(tmp_path, OTHER, 20, "plan-b", [10, 20], 2)
    kept = tmp_path / "runs" / fingerprint_id(FP)
    for folder in TRACKER_FOLDERS:
        assert not (tmp_path / folder).exists(), f"{folder}/ stayed behind for the next run to append to"
        assert (kept / folder / "rows").read_text() == f"{folder} of the first run"
    fake_run(tmp_path, OTHER, [10])
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "rows").write_text("csv of the second run")
    prepare_state(tmp_path, FP, 20, "plan-a", [10, 20], 2)  # back to the first settings: its trackers come back
    assert (tmp_path / "csv" / "rows").read_text() == "csv of the first run"
    assert (tmp_path / "runs" / fingerprint_id(OTHER) / "csv" / "rows").read_text() == "csv of the second run"


class FakePlan:
    """What run_state reads of a plan: its fingerprint (resume_fingerprint monkeypatched), steps, world size and the
    checkpoints it keeps; `tag` makes its digest differ."""

    def __init__(self, fingerprint, steps, world, needed=(10, 20), tag=""):
        self.fingerprint, self.tag = fingerprint, tag
        self.model = SimpleNamespace(seq_len=1)
        self.train = SimpleNamespace(total_steps=lambda seq_len: steps, world_size=world,
                                     checkpoint_steps=lambda seq_len: list(needed))

    def to_dict(self):
        return {"fingerprint": self.fingerprint, "steps": self.train.total_steps(1), "world": self.train.world_size,
                "needed": self.train.checkpoint_steps(1), "tag": self.tag}

    def __repr__(self):
        return repr(self.to_dict())


def test_a_finished_run_keeps_its_summary_for_the_jobs_that_rewrite_its_outputs(tmp_path, monkeypatch):
    import shutil

    from pretrain_bench.train.checkpoints import run_state
    from pretrain_bench.train.checkpoints.run_state import already_finished, kept_summary, plan_digest
    from pretrain_bench.train.run_summary import RunSummary

    fake_run(tmp_path, FP, [10, 20])
    fields = {name: None for name in RunSummary.__dataclass_fields__ if name != "version"}
    summary = tmp_path / "out-summary.json"
    summary.write_text(json.dumps(RunSummary(**{**fields, "tokens_per_s": 1234.5678, "comm_fraction": 0.29,
                                                "provenance": {"other_cpu": 0.1}}).to_dict(), indent=1))
    mark_finished(tmp_path, 20, "plan-a", summary)
    assert (tmp_path / "summary.json").read_bytes() == summary.read_bytes()
    kept = kept_summary(tmp_path, 20, "plan-a")
    assert kept.same_plan and kept.summary == json.loads(summary.read_text())
    assert not kept_summary(tmp_path, 20, "plan-b").same_plan  # an edit outside the weights: figures kept, not bytes
    assert kept_summary(tmp_path, 40, "plan-a") is None, "more steps asked: the run trains further"
    assert kept_summary(tmp_path, 20, "plan-a").same_plan
    # the terminal's note, taken as prepare_state takes the decision: same run, finished at these steps, final
    # checkpoint there
    monkeypatch.setattr(run_state, "resume_fingerprint", lambda plan: plan.fingerprint)
    asked = FakePlan(FP, steps=20, world=2)
    mark_finished(tmp_path, 20, plan_digest(asked), summary)
    note = already_finished(tmp_path, asked)
    assert f"the run in {tmp_path} already finished step 20" in note and "no step is trained again" in note
    assert prepare_state(tmp_path, FP, 20, plan_digest(asked), [10, 20], 2)[0].startswith(
        f"the run in {tmp_path} already finished step 20: resuming at its final checkpoint")
    for other in (FakePlan(OTHER, 20, 2), FakePlan(FP, 40, 2), FakePlan(FP, 20, 3), FakePlan(FP, 20, 2, [5, 20])):
        assert already_finished(tmp_path, other) is None, other
    assert already_finished(tmp_path, FakePlan(FP, 20, 2, tag="warmup_timing_steps edited")), "same checkpoints"
    (tmp_path / "checkpoints" / "step20" / "COMMITTED.json").write_text("")
    assert already_finished(tmp_path, asked) is None, "its final checkpoint does not read: steps are retrained"
    # a summary of another version is not kept: the job writes it anew (run_summary.regenerate_command)
    old = json.loads(summary.read_text()) | {"version": 1}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    assert kept_summary(tmp_path, 20, "plan-a") is None
    # the summary moves with its run and comes back with it
    shutil.copyfile(summary, tmp_path / "summary.json")
    prepare_state(tmp_path, OTHER, 20, "plan-b", [10, 20], 2)
    assert (tmp_path / "runs" / fingerprint_id(FP) / "summary.json").is_file()
    assert not (tmp_path / "summary.json").exists()


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
    assert messages[0] == (f"the world size changed since the run in {tmp_path} (train.gpus × train.nodes: 2 → 3): "
                           f"that run is kept in {world2} and resumes when the world size is 2 again; resuming the run "
                           f"kept in {world3} (these settings, saved at world size 3)")
    # the run that came back had finished: the second line says no step of it is trained again
    assert len(messages) == 2 and messages[1].startswith(f"the run in {tmp_path} already finished step 20")
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
