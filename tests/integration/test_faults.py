"""Faults on the real engine (CPU, gloo, through the launcher): a second run while one trains, pre-emption by SIGTERM,
a full disk during a save, damaged checkpoints, and a resume point beyond the run's last step. Each asserts the
message, the exit status and that nothing committed was lost. The tests that damage or resume a finished run start
from a copy of one shared run (`six_steps`) instead of training their own."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain_bench.train.checkpoints import files as ckpt
from pretrain_bench.train.forked_ranks import FORK_SERVER_NAME
from pretrain_bench.train.run_summary import MEASURED_WHILE_TRAINING, PROVENANCE_MEASURED_WHILE_TRAINING
from support import (  # data: the tiny data (tests/conftest.py)
    DATA_NAME,
    LAUNCHER,
    ROOT,
    SNAKEFILE,
    TINY_CONFIG,
    built_once,
    mounted_tmpfs,
    plan_for,
    read_jsonl,
    read_only_folder,
    recorded_losses,
    run,
    snakemake_command,
    snakemake_env,
    tree_digest,
    write_yaml,
)

pytestmark = pytest.mark.engine
RANK_SCRIPT = ROOT / "workflow_scripts" / "pretrain.py"
TWO_RANKS = {"gpus": 2, "global_batch_size": None}


@pytest.fixture(scope="session")
def six_steps(data, tmp_path_factory) -> Path:
    """The state folder of a DeepSpeed run on 2 ranks, 6 steps with a checkpoint every 2 (committed: 2, 4, 6),
    trained once per session (under pytest-xdist, by the first worker to ask). Tests resume copies of it
    (copy_state), never it."""
    def train(folder: Path) -> None:
        plan = plan_for(data, folder / "run", **TWO_RANKS, max_steps=6, checkpoint_every=2)
        assert run(plan, 2, folder / "train.log") == 0, (folder / "train.log").read_text()[-3000:]
        assert ckpt.committed_steps(folder / "run" / "state" / "checkpoints") == [2, 4, 6]

    return built_once(tmp_path_factory, "faults-six-steps", train) / "run" / "state"


def copy_state(state: Path, run_dir: Path) -> Path:
    """`state` (six_steps) copied, every file as it is, to `run_dir`/state: the run's state of a finished run, without
    its outputs; returns its checkpoints folder."""
    shutil.copytree(state, run_dir / "state", symlinks=True)
    return run_dir / "state" / "checkpoints"


def start_logged(plan: Path, ranks: int, log: Path, stderr: Path) -> subprocess.Popen:
    """The launcher as the rules start it: --log, the terminal (stderr) kept apart."""
    return subprocess.Popen([sys.executable, str(LAUNCHER), "--ranks", str(ranks), "--plan", str(plan),
                             "--log", str(log)], cwd=ROOT, stdout=open(stderr, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(condition, proc, what: Path, timeout=600):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, what.read_text()[-3000:]
        time.sleep(0.05)


def test_second_run_is_refused_while_the_first_trains_and_every_attempt_log_is_kept(data, tmp_path):
    run_dir = tmp_path / "run"
    plan = plan_for(data, run_dir, gpus=1, global_batch_size=None, max_steps=200, checkpoint_every=1000)
    log = tmp_path / "logs" / "pretrain.log"
    first = start_logged(plan, 1, log, tmp_path / "first.terminal")
    try:
        metrics = run_dir / "state" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, first, log)
        first_attempt = log.resolve() if log.is_symlink() else next((tmp_path / "logs" / "pretrain.attempts").iterdir())
        log.unlink()  # what Snakemake does to a job's declared log before it starts the job
        started = time.monotonic()
        second = subprocess.run([sys.executable, str(LAUNCHER), "--ranks", "1", "--plan", str(plan), "--log",
                                 str(log)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and time.monotonic() - started < 60
        assert (f"another training run (pid {first.pid}, started at " in second.stderr
                and f"holds {run_dir / 'state'}" in second.stderr), second.stderr
        assert first.poll() is None, "the first run goes on"
        # pre-emption, as a scheduler sends it to the launcher: the step in flight is saved, the exit is non-zero
        first.send_signal(signal.SIGTERM)
        assert first.wait(300) != 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    saved = ckpt.committed_steps(run_dir / "state" / "checkpoints")
    assert len(saved) == 1 and 3 <= saved[0] < 200, saved  # no checkpoint was due before step 1000
    record = first_attempt.read_text()
    assert record.startswith("=== pretrain-bench launcher: attempt started")
    assert "step 1/200" in record and "SIGTERM received: checkpoint step" in record and "exit status" in record
    assert "another training run" not in record, "the refusal never wrote into the running run's log"
    # A third attempt resumes it; all three attempts' records are there, the declared log names the newest.
    plan = plan_for(data, run_dir, gpus=1, global_batch_size=None, max_steps=saved[0] + 2, checkpoint_every=1000)
    assert start_logged(plan, 1, log, tmp_path / "third.terminal").wait(600) == 0, log.read_text()[-3000:]
    attempts = sorted((tmp_path / "logs" / "pretrain.attempts").iterdir())  # named by start time
    assert len(attempts) == 3
    assert attempts[0] == first_attempt and "attempt refused" in attempts[1].read_text()
    assert f"resumed from {run_dir / 'state' / 'checkpoints' / ckpt.tag_for(saved[0])}" in log.read_text()
    assert log.read_text() == attempts[2].read_text()


@pytest.fixture
def state_on_tmpfs(tmp_path):
    """A real tmpfs for the run's state folder (root only), which the test shrinks to fill it."""
    with mounted_tmpfs(tmp_path, "512m", "the simulated variant covers the save path") as mount:
        yield mount


@pytest.mark.parametrize("disk", ["simulated", "tmpfs"])
def test_full_disk_during_a_save_fails_naming_it_and_keeps_the_committed_checkpoints(data, six_steps, tmp_path,
                                                                                       disk, request):
    """The finished 6-step run trained on to step 10, whose checkpoint does not fit: on a real tmpfs left with 2 MiB
    free, or with the save's ENOSPC simulated."""
    run_dir = tmp_path / "run"
    terminal = tmp_path / "terminal.log"
    if disk == "tmpfs":
        mount = request.getfixturevalue("state_on_tmpfs")
        shutil.copytree(six_steps, mount, symlinks=True, dirs_exist_ok=True)
        run_dir.mkdir()
        (run_dir / "state").symlink_to(mount)
        plan = plan_for(data, run_dir, **TWO_RANKS, max_steps=10, checkpoint_every=5)
        proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--ranks", "2", "--plan", str(plan)], cwd=ROOT,
                                stdout=open(terminal, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: len(recorded_losses(run_dir)) >= 7, proc, terminal)  # resumed, trained step 7
            # Leave 2 MiB: room for metrics and TensorBoard, not for the next ~20 MB checkpoint.
            used = int(subprocess.run(["df", "--output=used", "-B1", str(mount)], capture_output=True, text=True,
                                      check=True).stdout.split()[-1])
            subprocess.run(["mount", "-o", f"remount,size={used + (2 << 20)}", str(mount)], check=True)
            code = proc.wait(600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    else:
        copy_state(six_steps, run_dir)
        plan = plan_for(data, run_dir, **TWO_RANKS, max_steps=10, checkpoint_every=5)
        code = run(plan, 2, terminal, env={"PRETRAIN_BENCH_INJECT_ENOSPC_AT_STEP": "10"})
    output = terminal.read_text()
    root = run_dir / "state" / "checkpoints"
    folder = root / "step10"
    assert code != 0
    assert f"resumed from {root / 'step6'} (step 6)" in output, output[-3000:]
    assert f"saving checkpoint step 10 to {folder} failed: no space left on device (" in output, output[-3000:]
    assert "bytes free on the file system of" in output
    assert not folder.exists(), "the partial checkpoint folder is removed"
    assert ckpt.committed_steps(root) == [2, 4, 6]
    assert ckpt.verify(root, 6, "full")["step"] == 6, "the committed checkpoint is intact, every byte"
    assert not (run_dir / "out" / "summary.json").exists()


def test_damaged_checkpoints_fall_back_and_steps_never_go_backwards(data, six_steps, tmp_path):
    run_dir = tmp_path / "run"
    root = copy_state(six_steps, run_dir)
    good = tree_digest(root / "step2")
    shard = root / "step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)  # a truncated optimizer shard
    (root / "step4" / ckpt.MARKER).write_text("")  # an un-fsynced marker after a power cut
    # Longer run: resumes from step 2, the newest that verifies.
    assert run(plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=8, checkpoint_every=2), 2,
               tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    assert f"warning: checkpoint {root / 'step6'} is damaged: {shard} has" in log
    assert f"Moved it aside to {root / 'step6.damaged'}" in log
    assert f"warning: {root / 'step4' / ckpt.MARKER} is empty" in log
    assert f"resumed from {root / 'step2'} (step 2)" in log
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 8
    assert (root / "step6.damaged" / shard.name).is_file() and (root / "step4.damaged").is_dir()
    assert ckpt.committed_steps(root) == [2, 4, 6, 8] and tree_digest(root / "step2") == good
    # Lowering max_steps below the newest checkpoint: refused before any engine starts, nothing touched.
    # run.lock is the lock's own record (the holder's pid, rewritten by every attempt that takes it), not state
    before = tree_digest(run_dir / "state", exclude=("run.lock",))
    code = run(plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=4, checkpoint_every=2), 2,
               tmp_path / "c.log")
    log = (tmp_path / "c.log").read_text()
    assert code != 0
    assert (f"checkpoint {root / 'step8'} is at step 8, beyond this run's last step 4 (train.max_steps 4)" in log
            and "Set train.max_steps to at least 8" in log), log[-3000:]
    assert "resumed from" not in log and "step 1/4" not in log
    assert tree_digest(run_dir / "state", exclude=("run.lock",)) == before
    assert json.loads((run_dir / "out" / "summary.json").read_text())["steps"] == 8


def test_an_empty_marker_in_the_newest_checkpoint_falls_back_to_the_one_before_on_every_rank(data, tmp_path):
    """A power cut during the last save: its COMMITTED.json never reached the disk (empty), and the run never
    finished. Every rank reaches the same decision (no gloo "Connection closed by peer"): the rerun sets that
    checkpoint aside, resumes from the one before, finishes, and trains the steps after it exactly as the
    uninterrupted run did."""
    run_dir = tmp_path / "run"
    state, root = run_dir / "state", run_dir / "state" / "checkpoints"
    plan = plan_for(data, run_dir, max_steps=6, checkpoint_every=2)  # the tiny config's 3 ranks
    assert run(plan, 3, tmp_path / "a.log") == 0, (tmp_path / "a.log").read_text()[-3000:]
    uninterrupted = recorded_losses(run_dir)
    assert ckpt.committed_steps(root) == [2, 4, 6] and len(uninterrupted) == 6
    (root / "step6" / ckpt.MARKER).write_text("")
    (state / "FINISHED.json").unlink()  # the power cut came before the run could finish
    (run_dir / "out" / "summary.json").unlink()
    assert run(plan, 3, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    assert f"warning: {root / 'step6' / ckpt.MARKER} is empty" in log, log[-3000:]
    assert f"resumed from {root / 'step4'} (step 4)" in log and "Connection closed by peer" not in log
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
    assert (root / "step6.damaged").is_dir() and ckpt.committed_steps(root) == [2, 4, 6]
    assert recorded_losses(run_dir) == uninterrupted, "steps 5 and 6 trained again, bit for bit"


def test_a_read_only_tracker_folder_is_refused_by_the_launcher_naming_it(data, tmp_path):
    """A read-only csv/ under the state folder: the launcher names it on the terminal before any rank starts, rather
    than rank 0's OSError from trackers.py and the other ranks' gloo "Connection closed by peer"."""
    run_dir = tmp_path / "run"
    plan = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=4, checkpoint_every=2,
                    loggers=["tensorboard", "csv"])
    log, terminal = tmp_path / "pretrain.log", tmp_path / "terminal"
    with read_only_folder(run_dir / "state" / "csv"):
        proc = start_logged(plan, 2, log, terminal)
        assert proc.wait(600) == 2, terminal.read_text()[-3000:]
    said = terminal.read_text()
    assert (f"{run_dir / 'state' / 'csv'} cannot be written (Read-only file system), and train.loggers chooses csv"
            in said or "Permission denied" in said), said
    assert "Traceback" not in said and "Connection closed by peer" not in said
    assert "cannot be written" in log.read_text(), "the job's log says why too"
    assert not (run_dir / "state" / "checkpoints").exists(), "no rank started"


# --- Interrupts through Snakemake, and the reruns after them -------------------------------------------------------
INTERRUPT_NAME = DATA_NAME  # in a working directory of its own, from a copy of the tiny data
INTERRUPT_STEPS = 12  # an interrupt after step 3 stops it well before its end (within 5 steps)
INTERRUPT_OVERLAY = {"name": INTERRUPT_NAME, "train": {"gpus": 2, "max_steps": INTERRUPT_STEPS,
                                                       "checkpoint_every": 1000, "eval_every": None}}


def start_snakemake(workdir: Path, overlay: Path, output: Path, *args: str) -> subprocess.Popen:
    """`snakemake … -- results/<name>/train/summary.json` as a user starts it, in a process group of its own (the
    terminal's foreground group)."""
    cmd = snakemake_command(*args, "--", f"results/{INTERRUPT_NAME}/train/summary.json",
                            configfiles=(TINY_CONFIG, overlay))
    return subprocess.Popen(cmd, cwd=workdir, stdout=open(output, "w"), stderr=subprocess.STDOUT,
                            env=snakemake_env(), start_new_session=True)


def finish_snakemake(workdir: Path, overlay: Path, output: Path, *args: str) -> str:
    proc = start_snakemake(workdir, overlay, output, *args)
    try:
        assert proc.wait(1800) == 0, output.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return (workdir / "logs" / INTERRUPT_NAME / "pretrain.log").read_text()


@pytest.mark.parametrize("interrupt", ["snakemake", "terminal"])
def test_an_interrupt_stops_training_with_a_checkpoint_the_rerun_resumes_and_a_finished_run_is_never_retrained(
        workdir, tmp_path, interrupt):
    import psutil

    results = workdir / "results" / INTERRUPT_NAME
    overlay = write_yaml(tmp_path / "overlay.yaml", INTERRUPT_OVERLAY)
    run_dir, terminal = results, tmp_path / "terminal.log"
    proc = start_snakemake(workdir, overlay, terminal)
    try:
        wait_for(lambda: len(recorded_losses(run_dir)) >= 3, proc, terminal, timeout=1800)
        seen = len(recorded_losses(run_dir))
        if interrupt == "snakemake":  # kill -INT <snakemake>: Snakemake alone
            os.kill(proc.pid, signal.SIGINT)
        else:  # Ctrl-C: the terminal's whole group (Snakemake, the job's shell, launcher, torchrun) and the ranks
            ranks = rank_processes(proc)
            assert len(ranks) == 2
            os.killpg(proc.pid, signal.SIGINT)
            for rank in ranks:
                rank.send_signal(signal.SIGINT)
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (workdir / "logs" / INTERRUPT_NAME / "pretrain.log").read_text()
    assert code != 0, terminal.read_text()[-3000:]
    saved = ckpt.committed_steps(run_dir / "state" / "checkpoints")
    # the step in flight (or one more, trained while the stop was passed on), saved and committed
    assert len(saved) == 1 and seen <= saved[0] <= seen + 5 and saved[0] < INTERRUPT_STEPS, (saved, seen, log[-3000:])
    assert f"received: checkpoint step {saved[0]} saved in" in log, log[-3000:]
    assert "SIGINT received: asking the ranks to save the step in flight and stop" in log
    # torchrun passes on one stop, the launcher's SIGTERM (a second signal would cut its wait for the save short)
    # (torchrun's words for it: "Sending process … closing signal SIGTERM", or for forked ranks "Closing process …
    # via signal SIGTERM")
    stops = re.findall(r"(?:closing|via) signal (SIG[A-Z]+)", log)
    assert stops == ["SIGTERM", "SIGTERM"], log[-3000:]
    assert ckpt.verify(run_dir / "state" / "checkpoints", saved[0], "full")["step"] == saved[0]
    assert not (run_dir / "train" / "summary.json").exists()
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir / "train" / "plan.json") in
                " ".join(p.info["cmdline"] or [])], "no process of the job is left"

    # the same command resumes from it
    log = finish_snakemake(workdir, overlay, tmp_path / "rerun.log")
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert f"resumed from {Path('results', INTERRUPT_NAME, 'state', 'checkpoints', ckpt.tag_for(saved[0]))}" in log
    assert summary["resumed_from_step"] == saved[0] and summary["steps"] == INTERRUPT_STEPS
    records = read_jsonl(run_dir / "train" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, INTERRUPT_STEPS + 1))
    if interrupt == "terminal":
        return
    # A finished run is never trained again: its outputs deleted, --forcerun, or marked incomplete, rewrite them from
    # the final checkpoint
    checkpoints = tree_digest(run_dir / "state" / "checkpoints")
    state_metrics = (run_dir / "state" / "metrics.jsonl").read_text()
    trained = (run_dir / "train" / "summary.json").read_bytes()
    for args in ((), ("--forcerun", "pretrain")):
        (run_dir / "train" / "summary.json").unlink(missing_ok=True)
        (run_dir / "train" / "metrics.jsonl").unlink(missing_ok=True)
        log = finish_snakemake(workdir, overlay, tmp_path / "rewrite.log", *args)
        assert (f"already finished step {INTERRUPT_STEPS}: resuming at its final checkpoint to rewrite the outputs, "
                "no step is trained again") in log, log[-3000:]
        assert f"move results/{INTERRUPT_NAME}/state away first" in log, "how to train from step 0 instead"
        assert f"step {saved[0] + 1}/" not in log and "starts fresh" not in log
        assert (run_dir / "train" / "summary.json").read_bytes() == trained, "the figures of the run that trained"
        assert (run_dir / "train" / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in records]
        assert not (run_dir / "state" / "runs").exists()
        assert tree_digest(run_dir / "state" / "checkpoints") == checkpoints
        assert (run_dir / "state" / "metrics.jsonl").read_text() == state_metrics
    # Snakemake killed hard while that job ran: the job's outputs stay marked incomplete; the rerun rewrites them too
    attempts = workdir / "logs" / INTERRUPT_NAME / "pretrain.attempts"
    before = set(attempts.iterdir())
    (run_dir / "train" / "summary.json").unlink()
    proc = start_snakemake(workdir, overlay, tmp_path / "killed.log")
    try:
        wait_for(lambda: set(attempts.iterdir()) - before, proc, tmp_path / "killed.log")
        os.kill(proc.pid, signal.SIGKILL)  # Snakemake alone: its job runs on, orphaned, to its end
        proc.wait()
        orphaned = (set(attempts.iterdir()) - before).pop()
        deadline = time.monotonic() + 600
        while "=== attempt ended" not in orphaned.read_text():
            assert time.monotonic() < deadline, orphaned.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # what `snakemake --unlock` does after a hard kill, for this run's lock files only
    for lock in (workdir / ".snakemake" / "locks").glob("*.lock"):
        if all(line.startswith(f"results/{INTERRUPT_NAME}/") for line in lock.read_text().splitlines()):
            lock.unlink()
    dry = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "-n", "--cores", "2",
                          "--configfile", TINY_CONFIG, str(overlay), "--",
                          f"results/{INTERRUPT_NAME}/train/summary.json"], cwd=workdir,
                         capture_output=True, text=True, timeout=300)
    assert "incomplete" in (dry.stdout + dry.stderr).lower(), dry.stdout + dry.stderr
    log = finish_snakemake(workdir, overlay, tmp_path / "incomplete.log", "--rerun-incomplete")
    assert (f"already finished step {INTERRUPT_STEPS}: resuming at its final checkpoint to rewrite the outputs, "
            "no step is trained again") in log, log[-3000:]
    assert (run_dir / "train" / "summary.json").read_bytes() == trained
    assert tree_digest(run_dir / "state" / "checkpoints") == checkpoints


def test_rewriting_a_finished_runs_outputs_keeps_its_summary_and_says_so_on_the_terminal(workdir, tmp_path):
    """`--forcerun pretrain`, and a rerun after `--delete-all-output`, on a finished run: the job trains no step, so
    its summary.json is the one the training wrote, byte for byte (not figures measured over a 0.1-second non-run),
    and the terminal, not only the job's log, says the run was already finished."""
    results = workdir / "results" / INTERRUPT_NAME
    short = {"max_steps": 4, "checkpoint_every": 2, "warmup_steps": 2, "warmup_timing_steps": 1}
    overlay = write_yaml(tmp_path / "overlay.yaml", {**INTERRUPT_OVERLAY, "train": {**INTERRUPT_OVERLAY["train"],
                                                                                   **short}})
    finish_snakemake(workdir, overlay, tmp_path / "first.log")
    summary = results / "train" / "summary.json"
    trained, checkpoints = summary.read_bytes(), tree_digest(results / "state" / "checkpoints")
    assert json.loads(trained)["comm_fraction"] is not None
    for name, args in (("forcerun", ("--forcerun", "pretrain")), ("deleted", ())):
        if name == "deleted":
            cmd = snakemake_command("--delete-all-output", "--", f"results/{INTERRUPT_NAME}/train/summary.json",
                                    configfiles=(TINY_CONFIG, overlay))
            subprocess.run(cmd, cwd=workdir, env=snakemake_env(), check=True, capture_output=True, timeout=600)
            assert not summary.exists() and (results / "state" / "checkpoints").is_dir()
        terminal = tmp_path / f"{name}.terminal"
        log = finish_snakemake(workdir, overlay, terminal, *args)
        said = terminal.read_text()
        assert (f"the run in results/{INTERRUPT_NAME}/state already finished step 4: its outputs are written again "
                "from its final checkpoint with the figures it measured, no step is trained again") in said, said
        assert "step 1/4" not in log and "step 3/4" not in log and "resumed from" in log
        if name == "forcerun":
            assert summary.read_bytes() == trained, "the same plan: the summary the training wrote, byte for byte"
        else:  # the plan is made again, with the machine's peak measured again: the training's figures are kept
            rewritten, first = json.loads(summary.read_text()), json.loads(trained)
            for key in (*MEASURED_WHILE_TRAINING, "tokens_per_s", "step_time_s", "loss", "peak_mem_bytes"):
                assert rewritten[key] == first[key], key
            for key in PROVENANCE_MEASURED_WHILE_TRAINING:
                assert rewritten["provenance"][key] == first["provenance"][key], key
        assert tree_digest(results / "state" / "checkpoints") == checkpoints


def rank_processes(proc: subprocess.Popen) -> list:
    """The ranks below `proc`: the children of its torchrun agent (whose command names the rank script), started by
    it (exec), or forked (train.rank_start fork) from its fork server, a fork of the agent (the same command line)."""
    import psutil

    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if str(RANK_SCRIPT) in p.cmdline() and str(RANK_SCRIPT) in p.parent().cmdline()
            and p.name() != FORK_SERVER_NAME]


def mapped_deleted_files(pid: int, folder: Path) -> list[str]:
    """Files under `folder` that process `pid` still maps although they were deleted (their blocks stay allocated)."""
    return [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if str(folder.resolve()) in line and line.endswith("(deleted)")]


@pytest.mark.parametrize("engine", [{}, {"engine": "ddp", "zero_stage": 0}], ids=["deepspeed", "ddp"])
def test_pruned_checkpoints_free_their_disk_while_a_resumed_run_continues(data, six_steps, tmp_path, engine):
    run_dir = tmp_path / "run"
    root = run_dir / "state" / "checkpoints"
    if engine:  # DDP: a run of its own, which keeps only its newest checkpoint
        first = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=4, checkpoint_every=2,
                         keep_checkpoints=1, **engine)
        assert run(first, 2, tmp_path / "a.log") == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert ckpt.committed_steps(root) == [4]
        resumed = 4
    else:  # DeepSpeed: a copy of the session's run (committed 2, 4, 6), whose first save below prunes all three
        copy_state(six_steps, run_dir)  # (train.keep_checkpoints is not in the resume fingerprint)
        resumed = 6
    # resumed from its newest checkpoint, which a save of this run prunes (with any older one) while the run goes on
    plan = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=400, checkpoint_every=2,
                    keep_checkpoints=1, **engine)
    log = tmp_path / "b.log"
    proc = start_logged(plan, 2, log, tmp_path / "b.terminal")
    try:
        # step 9 recorded: the save of step 8 (whose commit prunes) is over
        wait_for(lambda: len(recorded_losses(run_dir)) >= 9 and 8 in ckpt.committed_steps(root), proc, log)
        assert not [step for step in range(2, resumed + 1, 2) if (root / ckpt.tag_for(step)).exists()], \
            sorted(p.name for p in root.iterdir())
        ranks = rank_processes(proc)
        assert len(ranks) == 2
        # forked ranks (CPU's train.rank_start) come from the fork server, a fork of torchrun's agent made before the
        # agent's threads started, which has one thread: no lock another thread held can be copied into a rank
        servers = {rank.parent().pid: rank.parent() for rank in ranks}
        assert [(server.name(), server.num_threads()) for server in servers.values()] == [(FORK_SERVER_NAME, 1)]
        assert [server.parent().num_threads() > 1 for server in servers.values()] == [True], "the agent's threads"
        assert sorted(rank.name() for rank in ranks) == ["rank0", "rank1"]
        held = {rank.pid: mapped_deleted_files(rank.pid, root) for rank in ranks}
        assert held == {rank.pid: [] for rank in ranks}, held
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"resumed from {root / ckpt.tag_for(resumed)} (step {resumed})" in log.read_text()



def test_a_world_size_edit_starts_fresh_keeping_the_old_run_or_resumes_reshaped_where_allowed(data, tmp_path):
    run_dir = tmp_path / "run"
    state = run_dir / "state"
    one = plan_for(data, run_dir, gpus=1, global_batch_size=None, max_steps=4, checkpoint_every=2)
    assert run(one, 1, tmp_path / "a.log") == 0, (tmp_path / "a.log").read_text()[-3000:]
    # train.gpus 1 -> 2 on the finished run
    two = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=4, checkpoint_every=2)
    assert run(two, 2, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    kept = next((state / "runs").iterdir())
    assert (f"the world size changed since the run in {state} (train.gpus × train.nodes: 1 → 2): that run is kept "
            f"in {kept} and resumes when the world size is 1 again") in log, log[-3000:]
    assert "resuming at its" not in log and "resumed from" not in log
    assert ckpt.committed_steps(kept / "checkpoints") == [2, 4] and ckpt.read_marker(kept / "checkpoints", 4)[
        "world_size"] == 1
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from_step"] is None
    # back to 1 rank and 2 more steps, with train.allow_reshape: the 2-rank run continues at 1 rank
    reshaped = plan_for(data, run_dir, gpus=1, global_batch_size=None, max_steps=6, checkpoint_every=2,
                        allow_reshape=True)
    assert run(reshaped, 1, tmp_path / "c.log") == 0, (tmp_path / "c.log").read_text()[-3000:]
    log = (tmp_path / "c.log").read_text()
    assert (f"the run in {state} was saved at world size 2, this run has 1 (train.gpus × train.nodes): resuming it "
            "reshaped (train.allow_reshape)") in log, log[-3000:]
    assert f"resumed from {state / 'checkpoints'}" in log and "saved at world size 2, now 1" in log
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["resumed_from_step"] == 4 and summary["steps"] == 6
    assert ckpt.committed_steps(kept / "checkpoints") == [2, 4], "the 1-rank run set aside stays as it was"


def test_a_crash_before_the_first_checkpoint_and_a_cut_last_line_leave_each_step_once(data, tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    metrics = run_dir / "state" / "metrics.jsonl"
    plan = plan_for(data, run_dir, gpus=2, global_batch_size=None, max_steps=8, checkpoint_every=1000)
    log = tmp_path / "a.log"
    proc = start_logged(plan, 2, log, tmp_path / "a.terminal")
    try:
        wait_for(lambda: len(recorded_losses(run_dir)) >= 3, proc, log)
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for process in job:  # a hard crash of the whole job, before any checkpoint
            process.kill()
        psutil.wait_procs(job, timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert ckpt.committed_steps(run_dir / "state" / "checkpoints") == []
    crashed = recorded_losses(run_dir)
    with open(metrics, "a") as handle:  # and a record cut short as the crash hit its append
        handle.write(json.dumps({"step": len(crashed) + 1, "loss": 9.0})[:17])
    assert run(plan, 2, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    assert f"{metrics}: dropped its last line (17 bytes), a record cut short while it was written" in log
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] is None and summary["steady_steps"] == 7  # steps 2-8 (1 is warm-up)
    assert summary["loss"]["first"] == crashed[0], "the same seed: step 1 trained again the same"


def overwrite_in_place(path: Path, start: int, data: bytes) -> None:
    """Bytes overwritten on disk, in place: same size, same inode, as a bad block or a stray writer leaves them."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(data)
    assert path.stat().st_size == size


def fp32_weights_span(shard: Path) -> tuple[int, int]:
    """The byte range, in the file, of the fp32 master weights a ZeRO-1/2 optimizer shard holds (DeepSpeed loads the
    model's weights from them): the zip entry whose stored bytes are that tensor's."""
    import struct
    import zipfile

    import torch

    state = torch.load(shard, map_location="cpu", weights_only=False)
    weights = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach().numpy().tobytes()
    with zipfile.ZipFile(shard) as archive, open(shard, "rb") as raw:
        for info in archive.infolist():
            if info.file_size == len(weights) and archive.read(info) == weights:
                raw.seek(info.header_offset)
                header = struct.unpack(zipfile.structFileHeader, raw.read(zipfile.sizeFileHeader))
                start = (info.header_offset + zipfile.sizeFileHeader + header[zipfile._FH_FILENAME_LENGTH]
                         + header[zipfile._FH_EXTRA_FIELD_LENGTH])
                return start, start + len(weights)
    raise AssertionError(f"no entry of {shard} holds its fp32 weights")


def test_same_size_overwrite_of_a_checkpoint_is_found_by_default_and_never_loaded(data, six_steps, tmp_path):
    run_dir = tmp_path / "run"
    root = copy_state(six_steps, run_dir)
    shard = root / "step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    start, stop = fp32_weights_span(shard)
    damaged_at = max(start, ckpt.SAMPLE_BYTES)  # beyond the sampled window: only a full check sees it
    assert damaged_at + 4096 <= min(stop, ckpt.SAMPLE_STRIDE)
    garbage = os.urandom(4096)
    overwrite_in_place(shard, damaged_at, garbage)
    assert ckpt.verify(root, 6, "sampled"), "the fault is one the sampled opt-out misses"
    good = tree_digest(root / "step4")
    # No train.verify_checkpoints in the plan: the default finds it before anything is loaded.
    assert run(plan_for(data, run_dir, **TWO_RANKS, max_steps=8, checkpoint_every=2), 2,
               tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    assert (f"warning: checkpoint {root / 'step6'} is damaged: {shard} does not match the sha256 recorded when it "
            "was saved" in log), log[-3000:]
    assert f"Moved it aside to {root / 'step6.damaged'}; falling back to checkpoint step 4" in log
    assert f"resumed from {root / 'step4'} (step 4)" in log and f"resumed from {root / 'step6'}" not in log
    assert (root / "step6.damaged" / shard.name).read_bytes()[damaged_at:damaged_at + 4096] == garbage, "kept aside"
    assert ckpt.committed_steps(root) == [2, 4, 6, 8] and tree_digest(root / "step4") == good
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 8


def test_non_finite_loss_right_after_a_resume_names_the_checkpoint_and_falls_back_once(data, six_steps, tmp_path):
    import math
    import re

    run_dir = tmp_path / "run"
    root = copy_state(six_steps, run_dir)  # trained to step 6

    def plan(max_steps):  # the sampled opt-out: the weights below pass it, as damage before saving would pass any
        return plan_for(data, run_dir, **TWO_RANKS, max_steps=max_steps, checkpoint_every=2,
                        verify_checkpoints="sampled")

    # Garbage that still loads as a tensor: float32 +inf over the weights past the sampled first MiB.
    shard = root / "step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    start, stop = fp32_weights_span(shard)
    damaged_at = max(start, ckpt.SAMPLE_BYTES)
    damaged_at += (damaged_at - start) % 4 and 4 - (damaged_at - start) % 4  # on a float boundary
    assert stop - damaged_at > 1 << 20 and stop <= ckpt.SAMPLE_STRIDE
    overwrite_in_place(shard, damaged_at, b"\x00\x00\x80\x7f" * ((stop - damaged_at) // 4))
    assert ckpt.verify(root, 6, "sampled")
    suspect = tree_digest(root / "step6")
    before = {step: tree_digest(root / ckpt.tag_for(step)) for step in (2, 4)}

    # 1) resumed from step 6, the loss turns non-finite: the error names step 6, which is set aside
    assert run(plan(8), 2, tmp_path / "b.log") != 0
    log = (tmp_path / "b.log").read_text()
    assert f"resumed from {root / 'step6'} (step 6)" in log, log[-3000:]
    # step 7 runs on the module's weights (loaded from mp_rank_00_model_states.pt), its optimizer step copies the
    # damaged fp32 master weights into them: step 8 at the latest, still before the next save
    assert re.search(r"non-finite loss at step [78] on rank\(s\) \[", log), log[-3000:]
    assert (f"], right after resuming from checkpoint {root / 'step6'}: its weights are the likely cause. Moved it "
            f"aside to {root / 'step6.nonfinite'}" in log), log[-3000:]
    assert "rerun to resume from checkpoint step 4, the one before it" in log
    assert ckpt.committed_steps(root) == [2, 4]
    assert tree_digest(root / "step6.nonfinite") == suspect, "kept as it was, for inspection"

    # 2) once only: a non-finite loss right after that fallback (injected at step 5) moves nothing more
    assert run(plan(8), 2, tmp_path / "c.log", env={"PRETRAIN_BENCH_INJECT_NAN_AT_STEP": "5"}) != 0
    log = (tmp_path / "c.log").read_text()
    assert f"resumed from {root / 'step4'} (step 4)" in log, log[-3000:]
    assert (f"non-finite loss at step 5 on rank(s) [1], right after resuming from checkpoint {root / 'step4'}, "
            "which this run fell back to after a non-finite loss right after resuming from step 6" in log), log[-3000:]
    assert "the checkpoints are not the likely cause and nothing was moved" in log
    assert ckpt.committed_steps(root) == [2, 4] and ckpt.set_aside_steps(root, "nonfinite") == [6]
    assert {step: tree_digest(root / ckpt.tag_for(step)) for step in (2, 4)} == before

    # 3) the rerun trains on from step 4 to the end, with finite losses
    assert run(plan(8), 2, tmp_path / "d.log") == 0, (tmp_path / "d.log").read_text()[-3000:]
    assert f"resumed from {root / 'step4'} (step 4)" in (tmp_path / "d.log").read_text()
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 8
    assert all(math.isfinite(loss) for loss in summary["loss"].values())
    assert ckpt.committed_steps(root) == [2, 4, 6, 8] and tree_digest(root / "step6.nonfinite") == suspect
