"""Running on torch 2.11 and newer: torchrun's newer options passed only where its parser has them (a faked older
parser), torch.distributed.all_gather_single's older name, and an older torch refused at `snakemake -n` in one line
naming the version to install."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_bench.train.launcher import (
    GRACEFUL_STOP_S,
    _installed_torchrun_source,
    torchrun_command,
    torchrun_options,
)

ROOT = Path(__file__).resolve().parents[2]
NEWER_OPTIONS = ("--shutdown-timeout", "--signals-to-handle")


class _WithoutNewerOptions(ast.NodeTransformer):
    """torch/distributed/run.py as torch 2.11 had it: no add_argument for the options added since."""

    def visit_Expr(self, node):
        call = node.value
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument" and any(
                isinstance(arg, ast.Constant) and arg.value in NEWER_OPTIONS for arg in call.args):
            return None
        return node


def older_torchrun_source() -> str:
    return ast.unparse(_WithoutNewerOptions().visit(ast.parse(_installed_torchrun_source())))


def parser_of(source: str):
    """get_args_parser() of a torchrun module with this source."""
    namespace = {"__name__": "older_torchrun"}
    exec(compile(source, "older_torchrun.py", "exec"), namespace)
    return namespace["get_args_parser"]()


def test_this_torchs_torchrun_gets_the_graceful_stop_options_and_accepts_them():
    from torch.distributed.run import get_args_parser

    options = torchrun_options()
    assert set(NEWER_OPTIONS) <= options and "--nproc-per-node" in options
    cmd = torchrun_command(Path("pretrain.py"), ["--plan", "p.json"], ranks=2, nodes=1, max_restarts=0)
    assert f"--shutdown-timeout={GRACEFUL_STOP_S}" in cmd
    args = get_args_parser().parse_args(cmd[3:])
    assert args.shutdown_timeout == GRACEFUL_STOP_S and args.training_script == "pretrain.py"


def test_an_older_torchrun_gets_only_the_options_its_parser_has():
    source = older_torchrun_source()
    older = parser_of(source)
    full = torchrun_command(Path("pretrain.py"), [], ranks=2, nodes=1, max_restarts=0)
    with pytest.raises(SystemExit) as refused:  # what torch 2.11 did: exit 2, "unrecognized arguments"
        older.parse_args(full[3:])
    assert refused.value.code == 2
    options = torchrun_options(source)
    assert not set(NEWER_OPTIONS) & options and "--max-restarts" in options
    cmd = torchrun_command(Path("pretrain.py"), ["--plan", "p.json"], ranks=2, nodes=1, max_restarts=1,
                           options=options)
    assert not any(arg.startswith(NEWER_OPTIONS) for arg in cmd)
    args = older.parse_args(cmd[3:])
    assert (args.nproc_per_node, args.max_restarts, args.standalone) == ("2", 1, True)


def test_gather_floats_uses_the_older_name_where_torch_lacks_all_gather_single(monkeypatch, tmp_path):
    import torch.distributed as dist

    from pretrain_bench.train.rank import gather_floats

    monkeypatch.delattr(dist, "all_gather_single")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        import torch

        assert gather_floats([1.5, torch.tensor([2.5])], "cpu") == [[1.5, 2.5]]
    finally:
        dist.destroy_process_group()


def test_a_torch_older_than_the_oldest_that_runs_is_refused_naming_the_version_to_install():
    from pretrain_bench.config.checks import PINNED_TORCH, check_torch_version
    from pretrain_bench.train.settings import ConfigError

    assert f"torch=={PINNED_TORCH}\n" in (ROOT / "requirements.txt").read_text()
    for version in ("2.11.0+cu130", "2.13.0", "3.0.0"):
        check_torch_version(version)
    with pytest.raises(ConfigError, match=r"^torch 2\.10\.1\+cu128 is older than 2\.11, the oldest this pipeline runs "
                                          rf"on: pip install torch=={PINNED_TORCH} "):
        check_torch_version("2.10.1+cu128")


def test_snakemake_dry_run_refuses_an_older_torch_in_one_line(tmp_path):
    from pretrain_bench.config.checks import PINNED_TORCH
    from support import snakemake_command, workflow_dir

    # an older torch's distribution record first on the path: what importlib.metadata reports, as pip left it
    fake = tmp_path / "site" / "torch-2.9.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(snakemake_command("-n"), cwd=workflow_dir(tmp_path / "workflow"), capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode != 0
    line = (f"torch 2.9.1 is older than 2.11, the oldest this pipeline runs on: pip install torch=={PINNED_TORCH} "
            "(the version requirements.txt pins)")
    output = proc.stdout + proc.stderr
    assert line in output.splitlines(), output[-3000:]


def test_make_install_checks_the_torch_it_ended_up_with_in_one_line(tmp_path):
    """The Makefile's install recipe runs `python -m pretrain_bench.config.checks` after installing: with an older
    torch's record first on the path it exits 1 with the one line (no traceback); with the installed torch, 0."""
    from pretrain_bench.config.checks import PINNED_TORCH

    assert "$(BIN)/python -m pretrain_bench.config.checks\n" in (ROOT / "Makefile").read_text()
    fake = tmp_path / "site" / "torch-2.10.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    command = [sys.executable, "-m", "pretrain_bench.config.checks"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "workflow_scripts")])}
    old = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert old.returncode == 1 and old.stdout == ""
    assert old.stderr == (f"pretrain-bench: torch 2.10.0 is older than 2.11, the oldest this pipeline runs on: pip "
                          f"install torch=={PINNED_TORCH} (the version requirements.txt pins)\n")
    current = subprocess.run(command, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "workflow_scripts")})
    assert (current.returncode, current.stdout, current.stderr) == (0, "", "")
