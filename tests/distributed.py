"""Runs a function on N real gloo ranks (spawned processes) and returns each rank's result."""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gather_rows(vector: torch.Tensor) -> torch.Tensor:
    """Every rank's ``vector`` stacked as rows, in rank order (a collective: all ranks call it)."""
    rows = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, vector.contiguous())
    return torch.stack(rows)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=90))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report every failure, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raises if any rank failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            rank, ok, value = results.get(timeout=timeout)
            outcome[rank] = (ok, value)
            if not ok:
                break
    except queue_module.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcome) == world_size else 0.5)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcome.items()) if not ok]
    if failures:
        raise AssertionError("distributed run failed\n" + "\n".join(failures))
    if len(outcome) < world_size:
        raise AssertionError(f"distributed run timed out: ranks {sorted(outcome)} of {world_size} reported")
    return [outcome[rank][1] for rank in range(world_size)]


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, stepper: Any,
                loss_of: Callable[[torch.nn.Module, int, int], torch.Tensor], rank: int,
                steps: Iterable[int]) -> list[float]:
    """Plain training steps on ``loss_of(model, rank, step)``, calling ``stepper.step(loss)`` (an HDET handle or
    an HDET scheduler) after each optimizer step; returns the losses."""
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        stepper.step(loss)
        losses.append(loss.item())
    return losses
