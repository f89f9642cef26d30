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

    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if str(RANK_SCRIPT) in p.cmdline()]
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


def test_ctrl_c_while_training_ends_the_terminal_with_the_saved_step_and_the_command_to_continue(workdir, tmp_path):
    overlay = write_yaml(tmp_path / "overlay.yaml", OVERLAY)
    checkpoints = workdir / "results" / DATA_NAME / "state" / "checkpoints"
    terminal = tmp_path / "terminal.log"
    target = f"results/{DATA_NAME}/train/summary.json"
    proc = start(workdir, overlay, terminal, target)
    try:
        wait_for(lambda: checkpoints.is_dir() and ckpt.committed_steps(checkpoints), proc, terminal)
        ctrl_c(proc)
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = terminal.read_text()
    assert code != 0, said[-3000:]
    saved = ckpt.committed_steps(checkpoints)[-1]
    assert 2 <= saved < STEPS, said[-3000:]
    tail = "\n".join(said.splitlines()[-TAIL:])
    assert f"checkpoint step {saved} saved" in tail, said[-4000:]
    command = shlex.join(["snakemake", *snakemake_command("--", target, configfiles=(TINY_CONFIG, overlay))[3:]])
    assert command in tail, (command, said[-4000:])
    assert "Traceback" not in said, said[-4000:]
