"""metrics.OtherCpu, with real processes: CPU time that a process outside the job takes on the job's cores is
counted as others', and the job's own processes (a child that exited and was waited for included) are not."""
import os
import subprocess
import sys
import time

import pytest

from pretrain_bench.report.physical_checks import busy_flag
from pretrain_bench.train.metrics import OTHER_CPU_METHOD, OtherCpu

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to one core (Linux)")

CORE = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
SPIN_S = 1.5
# a busy loop pinned to CORE for SPIN_S seconds
SPIN = f"import os, time\nos.sched_setaffinity(0, {{{CORE}}})\nend = time.monotonic() + {SPIN_S}\n" \
       "while time.monotonic() < end:\n    pass\n"


def test_a_process_outside_the_job_on_its_core_is_counted_as_others():
    """The spinning process is started through a shell that exits at once (so it is no descendant of this one: it
    belongs to no job here), pinned to the one core measured."""
    meter = OtherCpu((CORE,))
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" </dev/null >/dev/null 2>&1 &', SPIN], check=True)
    time.sleep(SPIN_S + 0.5)
    used = meter.stop()
    assert used["cpus"] == [CORE] and used["method"] == OTHER_CPU_METHOD
    # it had the core for most of the time (anything else on that core only adds to others' share)
    assert used["share_pct"] > 50, used
    assert busy_flag(used) == f"other processes used {round(used['share_pct'])} % of the 1 core"


def test_the_jobs_own_children_are_not_counted_as_others():
    """A child of this process (the job) spins on the measured core and is waited for: its CPU time is the job's."""
    import resource

    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    meter = OtherCpu((CORE,))
    before = children_cpu()
    subprocess.run([sys.executable, "-c", SPIN], check=True)
    child = children_cpu() - before
    used = meter.stop()
    assert child > 0.3 * SPIN_S  # it spun (however busy the core was)
    # all of the child's CPU time is the job's (a few clock ticks of this process's own besides), none of it others'
    assert child - 0.05 <= used["job_cpu_s"] <= child + 0.5, (child, used)
    others = used["share_pct"] / 100 * used["wall_s"]
    assert others == pytest.approx(max(0.0, used["busy_cpu_s"] - used["job_cpu_s"]))


def test_a_summary_without_the_measurement_shows_it_as_not_available_and_flags_nothing():
    """A summary.json written before provenance had `other_cpu` (its version unchanged) reads as not measured."""
    from pretrain_bench.report.physical_checks import run_busy_flag, run_contention_text

    provenance = {"load_before": [3.5, 1.0, 1.0], "load_after": [4.0, 1.0, 1.0]}
    assert run_contention_text(provenance) == "1-min 3.50 before, 4.00 after, other processes n/a"
    assert run_busy_flag(provenance) is None
