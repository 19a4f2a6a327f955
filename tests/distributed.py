"""Runs a function on N real gloo ranks (fresh processes) and returns each rank's result.

A spawned rank spends seconds importing torch, DeepSpeed and transformers before its first collective, which on
a small machine cost more than many a test's own work. So the ranks are forked from a multiprocessing
forkserver that imported those libraries once per session (``PRELOAD``). Every call still gets fresh processes
with a fresh process group: groups, device meshes, DeepSpeed's globals, environment variables and RNG state a
test leaves behind die with its ranks, and a rank that fails or hangs is killed without touching the next test.
"""

from __future__ import annotations

import datetime
import multiprocessing.forkserver
import os
import pickle
import queue as queue_module
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hdet_scale.comm import free_port

PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers.models.llama.modeling_llama", "hdet_scale",
           "pytest"]
"""What the forkserver imports once (its import starts no thread, so forking stays safe); a module that fails
to import is left to each rank, as under spawn."""

# The forkserver's environment is the one its preloaded modules were imported under: the session's, taken
# before any test ran (not whatever a test has monkeypatched when the first ranks start).
_SESSION_ENVIRONMENT = dict(os.environ)


def gather_rows(vector: torch.Tensor) -> torch.Tensor:
    """Every rank's ``vector`` stacked as rows, in rank order (a collective: all ranks call it)."""
    rows = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, vector.contiguous())
    return torch.stack(rows)


def _rank_context() -> Any:
    """The forkserver context, its server running (started, or restarted if it died, in the session's
    environment)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRONMENT)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(current)
    return context


def _report(results: Any, rank: int, ok: bool, value: Any) -> None:
    """Sends a rank's outcome, pickled here, by value: torch's queue would send a tensor as a handle to this
    process's memory, which the parent cannot open once the rank has exited."""
    results.put((rank, ok, pickle.dumps(value)))


def _receive(results: Any, timeout: float = 1.0) -> tuple[int, bool, Any]:
    """The next outcome a rank sent with ``_report`` (raises ``queue.Empty`` after ``timeout`` seconds)."""
    rank, ok, value = results.get(timeout=timeout)
    return rank, ok, pickle.loads(value)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, environment: dict[str, str],
           results: Any, args: tuple) -> None:
    # A forked rank inherits the forkserver's environment: give it the caller's, as a spawned one would have.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=90))
        _report(results, rank, True, fn(rank, world_size, *args))
    except BaseException:  # report every failure, including assertion errors, to the parent
        _report(results, rank, False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raises if any rank failed."""
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    environment = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, environment, results, args), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    died: list[str] = []
    try:
        waited = 0.0
        while len(outcome) < world_size and all(ok for ok, _ in outcome.values()) and not died and waited < timeout:
            try:
                rank, ok, value = _receive(results)
            except queue_module.Empty:
                waited += 1.0
                # A rank that exited without a report (its function could not even be imported) is not waited for.
                # A report is flushed before its rank exits: read what came meanwhile before judging.
                exited = {rank for rank, proc in enumerate(procs) if rank not in outcome and proc.exitcode is not None}
                while exited:
                    try:
                        rank, ok, value = _receive(results)
                    except queue_module.Empty:
                        break
                    outcome[rank] = (ok, value)
                died = [f"rank {rank} exited with code {procs[rank].exitcode} before reporting (see its stderr)"
                        for rank in sorted(exited - set(outcome))]
                continue
            waited = 0.0
            outcome[rank] = (ok, value)
    finally:
        killed = set()
        for rank, proc in enumerate(procs):
            proc.join(timeout=5 if len(outcome) == world_size else 0.5)
            if proc.is_alive():
                proc.kill()
                killed.add(rank)
    # A rank that aborts while tearing down (its report already sent) fails too: a user's job would end in error.
    # One that reported but still runs 5 s later is killed and passes: a loaded machine can take that long to exit.
    died += [f"rank {rank} reported, then exited with code {proc.exitcode} (see its stderr)"
             for rank, proc in enumerate(procs) if rank in outcome and rank not in killed and proc.exitcode != 0]
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcome.items()) if not ok] + died
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
