"""The fork server that forked CPU ranks come from (pretrain_bench.forked_ranks): a fork of the process that starts it,
with one thread, named in ps, which ends when that process stops it."""
import subprocess
import sys

CODE = """
import os, threading, time
import psutil
from pretrain_bench import forked_ranks
# a thread of the starting process, as torchrun's agent runs its own: not copied into the fork server
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
pid = forked_ranks.start_fork_server()
server = psutil.Process(pid)
deadline = time.monotonic() + 30
while server.name() != forked_ranks.FORK_SERVER_NAME and time.monotonic() < deadline:  # named just after the fork
    time.sleep(0.01)
print(server.ppid() == os.getpid(), server.name(), server.num_threads(), psutil.Process().num_threads() > 1)
print(server.cmdline() == psutil.Process().cmdline())  # a fork of this process, not a fresh interpreter
forked_ranks.stop_fork_server()
print(psutil.pid_exists(pid))
"""


def test_the_fork_server_is_a_one_thread_fork_of_its_starter_and_ends_when_stopped():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["True fork-server 1 True", "True", "False"], proc.stdout
