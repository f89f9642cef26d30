"""CPU ranks through the real launcher are pinned to disjoint cores with cores ÷ ranks threads each, and summary.json
records what each rank had (its affinity and torch threads, read inside the rank), the load before and after, and
what processes outside the job used of its cores meanwhile."""
import json
from pathlib import Path

import pytest

from pretrain_bench.train.run_context import usable_cpus
from support import plan_for, run

pytestmark = pytest.mark.engine


def launched_run(request, data, tmp_path, ranks: int) -> Path:
    """The output folder of a run on `ranks` ranks: 2 ranks are the session's ZeRO-0 run (conftest zero_stage_runs,
    launched like any other), the others a 2-step run of their own."""
    if ranks == 2:
        return request.getfixturevalue("zero_stage_runs") / "z0" / "out"
    plan = plan_for(data, tmp_path / "run", max_steps=2, checkpoint_every=2, warmup_steps=0, gpus=ranks)
    assert run(plan, ranks, tmp_path / "run.log") == 0, (tmp_path / "run.log").read_text()[-3000:]
    return tmp_path / "run" / "out"


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_each_rank_runs_on_its_own_cores_with_cores_divided_by_ranks_threads(request, data, tmp_path, ranks):
    summary = json.loads((launched_run(request, data, tmp_path, ranks) / "summary.json").read_text())
    assert summary["world_size"] == ranks
    placement = summary["provenance"]["placement"]
    cpus = usable_cpus()
    assert [rank["rank"] for rank in placement] == list(range(ranks))
    if ranks <= len(cpus):
        size = len(cpus) // ranks
        assert not summary["oversubscribed"] and summary["threads_per_rank"] == size
        assert all(len(rank["cores"]) == size and rank["threads"] == size for rank in placement), placement
        taken = [core for rank in placement for core in rank["cores"]]
        assert len(set(taken)) == len(taken) and set(taken) <= set(cpus), placement  # disjoint, of this machine
    else:  # oversubscribed: one thread each, on all the cores (no disjoint blocks exist)
        assert summary["oversubscribed"] and summary["threads_per_rank"] == 1
        assert all(rank["threads"] == 1 and rank["cores"] == list(cpus) for rank in placement), placement
    for key in ("load_before", "load_after"):
        load = summary["provenance"][key]
        assert len(load) == 3 and all(value >= 0 for value in load), (key, load)
    assert "load_average" not in summary["provenance"]
    # the job's cores (the launcher's: every usable core), the ranks' own CPU time apart from what others used
    other = summary["provenance"]["other_cpu"]
    assert other["cpus"] == list(cpus) and other["wall_s"] > 0 and other["job_cpu_s"] > 0, other
    assert 0 <= other["share_pct"] <= 100 and other["busy_cpu_s"] >= 0, other
