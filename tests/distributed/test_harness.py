"""The rank harness (tests/distributed.py) itself: what a rank reports reaches the test, and a rank that fails
after reporting fails the test."""

from __future__ import annotations

import multiprocessing.util
import os

import pytest
import torch

import distributed
from distributed import free_port, run_ranks


def a_tensor(rank: int, world: int) -> torch.Tensor:
    return torch.arange(4.0) + rank


def test_a_ranks_tensor_reaches_the_test_after_the_rank_has_exited():
    context = distributed._rank_context()
    results = context.Queue()
    rank = context.Process(target=distributed._entry,
                           args=(a_tensor, 0, 1, free_port(), dict(os.environ), results, ()))
    rank.start()
    rank.join(timeout=120)
    assert rank.exitcode == 0
    assert distributed._receive(results, timeout=10)[2].tolist() == [0.0, 1.0, 2.0, 3.0]


def abort_after_reporting(rank: int, world: int) -> int:
    if rank == 1:  # at exit, after the result queue's own finalizer (priority -5) has sent the report
        multiprocessing.util.Finalize(None, os.abort, exitpriority=-10)
    return rank


def test_a_rank_that_aborts_after_reporting_fails_the_run():
    with pytest.raises(AssertionError, match=r"rank 1 reported, then exited with code -6"):
        run_ranks(abort_after_reporting, 2)
