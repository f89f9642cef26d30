"""Ctrl-C through Snakemake as a terminal sends it (SIGINT to the whole foreground process group): what the terminal
shows last, and the plain rerun of the same command afterwards."""
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pretrain_bench.train.checkpoints import files as ckpt
from support import DATA_NAME, ROOT, TINY_CONFIG, snakemake_command, snakemake_env, write_yaml

pytestmark = [pytest.mark.pipeline, pytest.mark.engine]
RANK_SCRIPT = ROOT / "workflow_scripts" / "pretrain.py"
STEPS = 40  # a Ctrl-C after the first checkpoint (step 2) stops it long before its end
OVERLAY = {"name": DATA_NAME, "train": {"gpus": 2, "max_steps": STEPS, "checkpoint_every": 2, "eval_every": None}}
TAIL = 12  # the terminal lines a user reads after Ctrl-C


def start(workdir: Path, overlay: Path, output: Path, *targets: str) -> subprocess.Popen:
    """Snakemake as a user starts it, in a process group of its own (the terminal's foreground group)."""
    cmd = snakemake_command("--", *targets, configfiles=(TINY_CONFIG, overlay))
    return subprocess.Popen(cmd, cwd=workdir, stdout=open(output, "w"), stderr=subprocess.STDOUT,
                            env=snakemake_env(), start_new_session=True)


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the foreground group (Snakemake, its job's shell, the launcher,
    torchrun), and to the ranks, which torchrun starts in sessions of their own."""
    import psutil

    ranks = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if str(RANK_SCRIPT) in child.cmdline():
                ranks.append(child)
        except psutil.Error:
            pass  # ended meanwhile
    os.killpg(proc.pid, signal.SIGINT)
    for rank in ranks:
        try:
            rank.send_signal(signal.SIGINT)
        except psutil.Error:
            pass


def wait_for(condition, proc: subprocess.Popen, output: Path, timeout=1800) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.1)


def interrupted(workdir, overlay, terminal, targets, until) -> tuple[int, str]:
    """Snakemake on `targets` with Ctrl-C once `until()` holds: its exit status and what its terminal showed."""
    proc = start(workdir, overlay, terminal, *targets)
    try:
        wait_for(until, proc, terminal)
        ctrl_c(proc)
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, terminal.read_text()


def test_ctrl_c_while_training_ends_the_terminal_with_the_saved_step_and_the_command_to_continue(workdir, tmp_path):
    overlay = write_yaml(tmp_path / "overlay.yaml", OVERLAY)
    checkpoints = workdir / "results" / DATA_NAME / "state" / "checkpoints"
    terminal = tmp_path / "terminal.log"
    target = f"results/{DATA_NAME}/train/summary.json"
    code, said = interrupted(workdir, overlay, terminal, [target],
                             until=lambda: checkpoints.is_dir() and ckpt.committed_steps(checkpoints))
    assert code != 0, said[-3000:]
    saved = ckpt.committed_steps(checkpoints)[-1]
    assert 2 <= saved < STEPS, said[-3000:]
    tail = "\n".join(said.splitlines()[-TAIL:])
    assert f"checkpoint step {saved} saved" in tail, said[-4000:]
    command = shlex.join(["snakemake", *snakemake_command("--", target, configfiles=(TINY_CONFIG, overlay))[3:]])
    assert command in tail, (command, said[-4000:])
    assert "Traceback" not in said, said[-4000:]


EVAL_OVERLAY = {"name": DATA_NAME, "train": {"gpus": 1, "max_steps": 2, "checkpoint_every": 2, "warmup_steps": 1,
                                                "warmup_timing_steps": 1, "eval_every": None}}


def test_ctrl_c_late_in_evaluate_leaves_no_output_marked_incomplete_and_the_same_command_finishes(workdir, tmp_path):
    """Ctrl-C once the held-out evaluation is written, while lm-eval still runs on the same model: the plain rerun
    of the same command evaluates again and finishes (Snakemake refused it with IncompleteFilesException until
    --rerun-incomplete)."""
    overlay = write_yaml(tmp_path / "overlay.yaml", EVAL_OVERLAY)
    results = workdir / "results" / DATA_NAME
    trained = subprocess.run(snakemake_command("--", f"results/{DATA_NAME}/train/summary.json",
                                               configfiles=(TINY_CONFIG, overlay)),
                             cwd=workdir, capture_output=True, text=True, env=snakemake_env(), timeout=1800)
    assert trained.returncode == 0, trained.stderr[-3000:]
    targets = [f"results/{DATA_NAME}/{kind}/step2{suffix}"
               for kind, suffix in (("export", ""), ("eval", ".json"), ("lm_eval", ".json"))]
    terminal = tmp_path / "terminal.log"
    # the held-out result written (under its staged name, or, before the fix, its own), lm-eval running
    code, said = interrupted(workdir, overlay, terminal, targets,
                             until=lambda: any((results / "eval").glob("step2.json*")))
    assert code != 0, said[-3000:]
    assert not (results / "lm_eval" / "step2.json").exists(), ("interrupted before lm-eval's result", said[-3000:])
    rerun = subprocess.run(snakemake_command("--", *targets, configfiles=(TINY_CONFIG, overlay)), cwd=workdir,
                           capture_output=True, text=True, env=snakemake_env(), timeout=1800)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "IncompleteFilesException" not in rerun.stderr
    assert all((workdir / target).exists() for target in targets)
