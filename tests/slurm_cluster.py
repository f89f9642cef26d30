"""A throw-away SLURM cluster on this machine, for the tests: munged, slurmctld and one slurmd per node, all in the
foreground as children of this process, with every file under one folder, on loopback and unprivileged ports,
without accounting, cgroups or task binding.

- Node 1 is named after this host (else `localhost`), so a rendezvous on the first node resolves. Nodes 2.. are more
  slurmd processes on 127.0.0.N under other names: Debian's SLURM needs distinct node host names, not machines.
- Every node advertises `cpus` CPUs and `gpus` `gpu` generic resources backed by empty files: jobs that ask for
  GPUs (`--gpus`, `--gres=gpu:N`) are scheduled exactly as on a GPU cluster, while their ranks run on the CPU.
- The client commands are wrapped (in <folder>/bin, first on cluster.env's PATH) to always read this cluster's
  slurm.conf: Snakemake's SLURM job step strips SLURM_CONF with the other SLURM_* variables before it calls srun,
  so inside jobs only the default /etc/slurm/slurm.conf would be found, which a real cluster has and this one not.
  Its squeue answers the executor plugin's status query when one of the run's jobs ends (SQUEUE_UNTIL_A_JOB_ENDS).
- Job status comes from squeue only (AccountingStorageType=accounting_storage/none, no slurmdbd); finished jobs stay
  visible to squeue and `scontrol show job` for MinJobAge seconds.

By hand:  python tests/slurm_cluster.py [--nodes 2] [DIR]   (prints the SLURM_CONF to export; Ctrl-C stops)
"""
from __future__ import annotations

import argparse
import getpass
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support import free_port

CLIENTS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sinfo", "sacct")
BINARIES = ("munged", "slurmctld", "slurmd", *CLIENTS)
PACKAGES = ("slurm-wlm", "munge")

# The squeue of the cluster's bin/. The executor plugin's status query (`squeue --format=%i|%T --states=all --noheader
# --name <run>`) answers once one of the run's jobs is in a final state that no earlier query of that run reported, or
# when none is queued or running, or after 50 s (the plugin gives a query 60 s): squeue's own output, taken at that
# moment. The plugin waits 10 s longer after every query that finds no job finished (up to 180 s, whatever its
# settings), so on this cluster, whose jobs follow one another, it would otherwise sit idle for most of each
# job's length again. Every other squeue call answers at once.
SQUEUE_UNTIL_A_JOB_ENDS = """#!{python}
import os, subprocess, sys, time
from pathlib import Path

SQUEUE, ENV = "{squeue}", dict(os.environ, SLURM_CONF="{conf}")
FINAL = {{"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "TIMEOUT"}}
args = sys.argv[1:]
if not ("--format=%i|%T" in args and "--states=all" in args and "--name" in args):
    os.execve(SQUEUE, [SQUEUE, *args], ENV)
reported = Path("{folder}") / ("squeue-reported-" + args[args.index("--name") + 1])
seen = set(reported.read_text().split()) if reported.exists() else set()
deadline = time.monotonic() + 50
while True:
    proc = subprocess.run([SQUEUE, *args], env=ENV, capture_output=True, text=True)
    states = dict(line.strip().split("|", 1) for line in proc.stdout.splitlines() if "|" in line)
    ended = {{job for job, state in states.items() if state in FINAL}}
    if proc.returncode or ended - seen or ended == set(states) or time.monotonic() > deadline:
        break
    time.sleep(0.25)
reported.write_text("\\n".join(sorted(seen | ended)))
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
sys.exit(proc.returncode)
"""


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if not shutil.which(name)]


def ensure_slurm() -> str | None:
    """Install Debian's slurm-wlm and munge when they are missing and this is possible (root + apt-get).
    Returns None when the binaries are there, else why not."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"SLURM binaries {missing_binaries()} are missing and cannot be installed (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    for cmd in (["apt-get", "update", "-qq"], install):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}"
    missing = missing_binaries()
    return f"SLURM binaries {missing} still missing after installing {PACKAGES}" if missing else None


def first_node_name() -> str:
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
        return host
    except OSError:
        return "localhost"


class SlurmCluster:
    """`with SlurmCluster(folder, nodes=2) as cluster:` — cluster.env has SLURM_CONF for sbatch/squeue/srun."""

    def __init__(self, folder: Path | None = None, *, nodes: int = 1, cpus: int = 2, gpus: int = 3,
                 mem_mb: int = 16000, min_job_age_s: int = 900):
        # A short path of its own by default: munge's socket path must fit a sockaddr_un (108 bytes) and its folder
        # must be traversable by everyone, which pytest's private tmp folders are not.
        self.folder = Path(folder or tempfile.mkdtemp(prefix="pretrain-bench-slurm-")).resolve()
        first = first_node_name()
        self.nodes = [first] + [f"{first}-n{i}" for i in range(2, nodes + 1)]
        self.cpus, self.gpus, self.mem_mb, self.min_job_age_s = cpus, gpus, mem_mb, min_job_age_s
        self.conf = self.folder / "slurm.conf"
        self.bin = self.folder / "bin"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    # 1) configuration
    def write_config(self) -> None:
        f = self.folder
        for sub in ("state", "logs", "bin", *(f"spool/{node}" for node in self.nodes)):
            (f / sub).mkdir(parents=True, exist_ok=True)
        for name in CLIENTS:
            if shutil.which(name):
                wrapper = self.bin / name
                if name == "squeue":
                    wrapper.write_text(SQUEUE_UNTIL_A_JOB_ENDS.format(python=sys.executable, squeue=shutil.which(name),
                                                                      conf=self.conf, folder=f))
                else:
                    wrapper.write_text(f'#!/bin/sh\nSLURM_CONF={self.conf} exec {shutil.which(name)} "$@"\n')
                wrapper.chmod(0o755)
        f.chmod(0o755)  # munged refuses a socket in a folder others cannot traverse
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for i in range(self.gpus):  # character devices like /dev/null where allowed (root), else plain files
            try:
                os.mknod(f / f"fake-gpu{i}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            except PermissionError:
                (f / f"fake-gpu{i}").touch()
        node_lines = []
        for i, name in enumerate(self.nodes, start=1):
            node_lines.append(
                f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.{i} Port={free_port()} CPUs={self.cpus} "
                f"RealMemory={self.mem_mb} Gres=gpu:{self.gpus} State=UNKNOWN")
        controller = socket.gethostname().split(".")[0]
        user = getpass.getuser()
        self.conf.write_text("\n".join([
            "ClusterName=pretrainbench",
            f"SlurmctldHost={controller}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmUser={user}",  # root in CI; the daemons run as whoever starts the cluster
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={f / 'munge.socket'}",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}/%n",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={f / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'logs'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # declared CPUs/memory need not match this machine
            f"MinJobAge={self.min_job_age_s}",
            "KillWait=5",
            "InactiveLimit=0",
            "GresTypes=gpu",
            *node_lines,
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        (f / "gres.conf").write_text(f"NodeName={','.join(self.nodes)} Name=gpu File={f}/fake-gpu[0-{self.gpus - 1}]\n")

    # 2) daemons
    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.folder / "logs" / f"{name}.out", "w")
        self.daemons.append((name, subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)))

    def start(self, timeout_s: float = 60) -> None:
        self.write_config()
        f = self.folder
        self._start("munged", ["munged", "--foreground", f"--key-file={f / 'munge.key'}",
                               f"--socket={f / 'munge.socket'}", f"--pid-file={f / 'munged.pid'}",
                               f"--log-file={f / 'logs' / 'munged.log'}", f"--seed-file={f / 'munged.seed'}"])
        self._wait(lambda: (f / "munge.socket").exists(), timeout_s, "munged socket")
        self._start("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self._wait(self._all_idle, timeout_s, f"nodes {self.nodes} idle")

    def _all_idle(self) -> bool:
        proc = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], env=self.env,
                              capture_output=True, text=True)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, proc in self.daemons if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SLURM test cluster: waiting for {what} failed (exited: {dead}); logs:\n"
                                   + self.logs())
            time.sleep(0.3)

    def logs(self, tail_chars: int = 2000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}"
                         for p in sorted((self.folder / "logs").glob("*")) if p.is_file())

    def stop(self) -> None:
        """Cancel what is still queued or running, then stop the daemons this object started (by their pids)."""
        if any(proc.poll() is None for name, proc in self.daemons if name == "slurmctld"):
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.active_jobs():
                time.sleep(0.5)
        for _, proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.daemons):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.daemons.clear()

    def active_jobs(self) -> list[str]:
        proc = subprocess.run(["squeue", "--noheader", "--format=%i", "--states=PENDING,RUNNING,COMPLETING"],
                              env=self.env, capture_output=True, text=True)
        return proc.stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key → value (while the job is younger than MinJobAge)."""
        out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=self.env, check=True,
                             capture_output=True, text=True).stdout
        return dict(token.split("=", 1) for token in out.split() if "=" in token)

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?", default=None)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    reason = ensure_slurm()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    with SlurmCluster(args.folder, nodes=args.nodes, cpus=args.cpus) as cluster:
        print(f"export SLURM_CONF={cluster.conf}   # nodes {cluster.nodes}; Ctrl-C stops the cluster", flush=True)
        try:
            while all(proc.poll() is None for _, proc in cluster.daemons):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
