"""CPU ranks pinned to disjoint cores: the blocks each rank gets, the context the launcher hands over, and a process
really pinned by pin_rank."""
import multiprocessing
import os

import pytest

from pretrain_bench.train.launcher import rank_environment
from pretrain_bench.train.run_context import LaunchContext, core_blocks, pin_rank, rank_placement, usable_cpus


def test_cores_are_split_into_disjoint_blocks_of_cores_divided_by_ranks():
    assert core_blocks([0, 1, 2, 3, 4, 5, 6, 7], 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert core_blocks([0, 1, 2, 3, 4, 5, 6, 7], 3) == [(0, 1), (2, 3), (4, 5)]  # 6 and 7 stay idle
    assert core_blocks([4, 9], 1) == [(4, 9)]  # a taskset's share keeps its own ids


def test_more_ranks_than_cores_share_all_of_them_with_one_thread_each():
    assert core_blocks([0, 1], 3) == [(0, 1)] * 3
    context = LaunchContext.for_job("cpu", ranks=3, cores=2, cpus=(0, 1))
    assert context.oversubscribed and context.threads_per_rank == 1
    assert [context.rank_cores(rank) for rank in range(3)] == [(0, 1)] * 3


def test_threads_per_rank_is_the_size_of_each_block_and_reaches_openmp():
    context = LaunchContext.for_job("cpu", ranks=2, cores=16, cpus=range(16))
    assert context.threads_per_rank == 8 and not context.oversubscribed
    assert context.rank_cores(0) == tuple(range(8)) and context.rank_cores(1) == tuple(range(8, 16))
    assert rank_environment(context, base={})["OMP_NUM_THREADS"] == "8"


def test_cuda_ranks_are_not_pinned():
    context = LaunchContext.for_job("cuda", ranks=2, cores=16, cpus=range(16))
    assert context.rank_cores(0) is None and context.cpus == ()


def test_the_cores_reach_the_rank_as_decided():
    context = LaunchContext.for_job("cpu", ranks=3, cores=4, cpus=(2, 3, 5, 7))
    again = LaunchContext.from_json(context.to_json())
    assert again == context and again.rank_cores(2) == (5,)  # core 7 stays idle


def _pinned_child(context, local_rank, queue):
    pin_rank(context, local_rank)
    queue.put(rank_placement(local_rank, threads=1))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_pin_rank_restricts_the_process_to_its_cores():
    cpus = usable_cpus()
    context = LaunchContext.for_job("cpu", ranks=len(cpus), cores=len(cpus), cpus=cpus)
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=_pinned_child,
                                                           args=(context, len(cpus) - 1, queue))
    process.start()
    placement = queue.get(timeout=60)
    process.join(60)
    assert placement["cores"] == [cpus[-1]] and placement["rank"] == len(cpus) - 1
    assert usable_cpus() == cpus  # the parent keeps its own cores
