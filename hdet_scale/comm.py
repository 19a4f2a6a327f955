"""Communication: replica-safe gradient means, small gathers, finiteness checks, and rank-0 sections that end
together on every rank.

In ``global`` gradient mode a contributor count rides with every cross-replica gradient all-reduce
(``HealthyMean``, and ``healthy_mean_hook`` for DDP): a member whose part of that all-reduce (a DDP bucket, an
FSDP2 unit's shard, a ZeRO partition) has a non-finite element contributes nothing to that part's mean, decided on
the device with no host synchronization and no extra collective, so one diverging replica's non-finite values
never reach the others (its finite parts still count until the sync leaves the whole replica out). The sync's
bucketed averaging is ``hdet_scale.averaging``.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hdet_scale.durable import see_fresh_folder, start_fresh_folder
from hdet_scale.topology import built_once, collective_device, forget_built

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on this machine that no process listens on now (another may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The bucket dtype for a tensor dtype: fp32, or fp64 for fp64 tensors (never lose precision)."""
    if not dtype.is_floating_point:
        raise TypeError(f"HDET averages floating-point tensors only, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``tensor``'s device: every element is finite (no host synchronization).

    The sum is finite exactly when every element is, except when finite values add up past the float32 range
    (3e38: weights or gradients that have diverged anyway); a vectorized sum reads the tensor once, several
    times faster than ``aminmax`` on the CPU, and makes no full-size temporary as ``isfinite`` does."""
    if not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.isfinite(tensor.sum(dtype=accumulate))


# ------------------------------------------------------------------------------ gradients, every step
def _count_dtype(dtype: torch.dtype, group_size: int) -> torch.dtype:
    """``dtype`` if it counts up to ``group_size`` exactly (bf16: 256 members, fp16: 2048), else fp32."""
    exact = round(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)
    return dtype if group_size <= exact else torch.float32


def zero_unless(payload: torch.Tensor, flag: torch.Tensor) -> None:
    """Zeros ``payload`` unless the 0-dim bool ``flag`` is true, with no host synchronization on an accelerator.
    On the CPU the flag is host memory already, and a branch is far cheaper than a broadcast mask."""
    if flag.device.type == "cpu":
        if not bool(flag):
            payload.zero_()
    else:
        payload.masked_fill_(~flag, 0.0)


def pack_healthy(tensor: torch.Tensor, group_size: int, packed: torch.Tensor | None = None) -> torch.Tensor:
    """A flat buffer of ``tensor / group_size`` (zeros where any element of ``tensor`` is non-finite) and one
    last element, the contributor count: 1, or 0 for a non-finite ``tensor``. Pre-dividing like DDP's own
    hook keeps low-precision sums in range and makes a mean over healthy members bit-exact with it. ``packed``:
    a buffer of the right size and dtype to fill (``packing_buffer``), else a new one."""
    flat = tensor.reshape(-1)
    if packed is None:
        packed = packing_buffer(tensor, group_size)
    healthy = all_finite_flag(flat)
    payload = packed[:-1]
    torch.div(flat, group_size, out=payload)
    zero_unless(payload, healthy)
    packed[-1].copy_(healthy)
    return packed


def packing_buffer(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    """An empty buffer for ``pack_healthy(tensor, group_size)``."""
    return torch.empty(tensor.numel() + 1, dtype=_count_dtype(tensor.dtype, group_size), device=tensor.device)


def unpack_healthy_mean(packed: torch.Tensor, out: torch.Tensor, group_size: int) -> torch.Tensor:
    """Writes the contributors' mean of an all-reduced ``pack_healthy`` buffer into ``out``; returns ``out``. Where
    nobody contributed it is NaN, as DDP's own mean would be: a loss scaler (``GradScaler``, fp16) then skips the
    step and lowers its scale, and without one the failure shows instead of a step on zeros."""
    # exactly 1 when every member contributed; 1/0 = inf where none did, and their zeros times it NaN
    rescale = float(group_size) / packed[-1]
    torch.mul(packed[:-1], rescale, out=out.view(-1))  # a 0-dim factor: a 1-element one is slow on the CPU
    return out


class PackingPool:
    """The CPU's pool of ``pack_healthy`` buffers for a group of ``size`` members: reused once their all-reduce is
    unpacked (a fresh multi-MB buffer every step costs page faults there), so it holds as many as are in flight at
    once; on an accelerator the caching allocator reuses memory, in stream order. DDP releases buffers from gloo's
    callback thread while its main thread packs the next bucket: the pool is changed under a lock.

    It holds no process group on purpose: DDP's callback, which holds the pool, can be freed on gloo's thread
    after the main thread destroyed the group, and a group freed there joins its own thread (the process aborts).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._used: set[tuple[int, torch.dtype]] = set()
        self._lock = threading.Lock()

    def packed(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` packed (``pack_healthy``) into a pooled or new buffer; ``unpacked`` returns it to the pool."""
        key = (tensor.numel(), tensor.dtype)
        buffer = None
        with self._lock:
            self._used.add(key)
            pool = self._free.get(key) if tensor.device.type == "cpu" else None
            if pool:
                buffer = pool.pop()
        return pack_healthy(tensor, self.size, buffer)

    def keep_only_used(self) -> None:
        """Drops the pooled buffers of sizes not packed since the last call: DDP rebuilds its buckets after the
        first step, and the first step's sizes would otherwise hold a copy of the gradients for good."""
        with self._lock:
            for key in [key for key in self._free if key not in self._used]:
                del self._free[key]
            self._used.clear()

    def pooled_bytes(self) -> int:
        """Bytes held in the pool now."""
        with self._lock:
            return sum(buffer.numel() * buffer.element_size() for pool in self._free.values() for buffer in pool)

    def unpacked(self, packed: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Writes the all-reduced ``packed`` into ``tensor`` (``unpack_healthy_mean``), returns ``packed`` to the
        pool and ``tensor``."""
        unpack_healthy_mean(packed, tensor, self.size)
        if packed.device.type == "cpu":
            with self._lock:
                self._free.setdefault((tensor.numel(), tensor.dtype), []).append(packed)
        return tensor


class HealthyMean:
    """Replica-safe gradient means over ``group`` (None: all ranks): a member whose gradient has a non-finite
    element contributes nothing, decided on the device in the same all-reduce (see ``pack_healthy``).

    Call it on a tensor to average it in place (FSDP2's all-reduce hook), or register it with DDP as the state
    of ``healthy_mean_hook``. Its ``pool`` reuses the packing buffers on the CPU.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.pool = PackingPool(dist.get_world_size(group))

    def __call__(self, tensor: torch.Tensor) -> int:
        """Replaces ``tensor`` by the healthy members' mean (collective; one all-reduce, no host synchronization);
        returns the bytes all-reduced."""
        packed = self.pool.packed(tensor)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        self.pool.unpacked(packed, tensor)
        return packed.numel() * packed.element_size()


def healthy_mean_hook(state: HealthyMean, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook, ``ddp.register_comm_hook(HealthyMean(group), healthy_mean_hook)``: each
    gradient bucket becomes the mean over the ranks of the group whose bucket is all finite (NaN where none is:
    ``unpack_healthy_mean``)."""
    buffer = bucket.buffer()
    pool = state.pool  # the callback holds the pool only, never the group (see PackingPool)
    packed = pool.packed(buffer)
    if bucket.is_last():  # the step's last bucket: every size this step uses has been packed
        pool.keep_only_used()
    future = dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=state.group, async_op=True).get_future()
    return future.then(lambda _: pool.unpacked(packed, buffer))


# DDP checks a hook's annotations against the real classes, and this module's are strings (future annotations).
healthy_mean_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


class PeerFailed(RuntimeError):
    """Raised on every rank of a collective section but the one that failed: rank ``rank`` failed ``what`` with
    ``text`` (its error's one line)."""

    def __init__(self, what: str, rank: int, text: str) -> None:
        super().__init__(f"{what} failed on rank {rank}: {text}")
        self.rank, self.text = rank, text


def one_line(error: BaseException) -> str:
    """``error``'s type and first line: for a ``PeerFailed``, the failing rank's own; for
    torch.distributed.checkpoint's collective exception (raised on every rank, its text every rank's traceback),
    the first failing rank's error."""
    if isinstance(error, PeerFailed):
        return error.text
    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    text = str(error).splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def failed_rank(error: BaseException, rank: int) -> int:
    """The rank ``error`` comes from: the failing rank for a ``PeerFailed`` or DCP's collective exception, else
    ``rank``, the one that raised it."""
    if isinstance(error, PeerFailed):
        return error.rank
    if isinstance(error, CheckpointException) and error.failures:
        return min(error.failures)
    return rank


def raise_together(error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what`` (``error``: this rank's failure, None if it did not),
    in one collective, and then all raise together: the failing ranks their own error, the others ``PeerFailed``
    naming the first failing rank. Ends a section in which each rank may fail alone, so that none is left
    waiting in a collective the failing one never reaches."""
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, None if error is None else one_line(error))
    first = next(((rank, text) for rank, text in enumerate(texts) if text is not None), None)
    if first is None:
        return
    if error is not None:
        raise error
    raise PeerFailed(what, *first)


def file_work_together(work: Callable[[], object], what: str, *, here: bool = True) -> None:
    """``work()``, file-system work whose failure is an OSError, on the ranks where ``here``; then every rank learns
    whether any failed and all raise together (``raise_together``, collective)."""
    failure = None
    if here:
        try:
            work()
        except OSError as error:
            failure = error
    raise_together(failure, what)


def on_rank0(work: Callable[[], T], what: str, *, share_result: bool = False) -> T | None:
    """``work()`` on global rank 0 alone, ended by one collective on every rank that carries its outcome (it
    replaces the barrier such a section would end with). A failure on rank 0 is raised there as it is and on every
    other rank as ``PeerFailed``: all ranks stop together at once, none is left in a barrier that rank 0 never
    reaches. Returns ``work()``'s result on rank 0, None elsewhere; with ``share_result`` on every rank (sent with
    the outcome, so keep it small): one rank's reading of a shared file system that all then act on alike, where
    each rank's own reading could differ (a stale network file system cache) and leave them in different
    collectives."""
    result, outcome = None, [None, None]
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException as error:
            outcome[0] = one_line(error)
            dist.broadcast_object_list(outcome, src=0)
            raise
        if share_result:
            outcome[1] = result
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise PeerFailed(what, 0, outcome[0])
    return outcome[1] if share_result else result


def open_fresh_folder(folder: Path, what: str, *, prepare: Callable[[], object] | None = None) -> None:
    """Rank 0 runs ``prepare()`` (where given) and makes ``folder`` with a new token (``start_fresh_folder``); then
    every rank waits until its node sees that folder (``see_fresh_folder``): a name saved through again by every save
    may show a node, on a network file system, the folder it had before. Collective; ``what`` names the save in
    errors, which every rank raises together."""

    def start() -> str:
        if prepare is not None:
            prepare()
        return start_fresh_folder(folder)

    token = on_rank0(start, f"preparing {what}", share_result=True)
    file_work_together(lambda: see_fresh_folder(folder, token), f"opening {folder} on every node")


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Overwrites every parameter and buffer of ``module`` with global rank 0's, so all replicas start alike. A
    model still on the CPU under NCCL (which carries GPU tensors only: DeepSpeed and FSDP2 move the model after
    this) goes through the GPU one tensor at a time."""
    device = collective_device()
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "cpu" and device.type != "cpu":
            staged = tensor.data.to(device)
            dist.broadcast(staged, src=0)
            tensor.data.copy_(staged)
        else:
            dist.broadcast(tensor.data, src=0)


def start_gather_rows(row: Sequence[float], *, world_size: int) -> tuple[torch.Tensor, dist.Work | None]:
    """Starts gathering every rank's ``row`` into a (world_size, len(row)) float64 table (one small all-reduce:
    each rank fills its own row of zeros); the table holds it once the returned work (None: nothing to wait
    for) has finished."""
    if world_size == 1 or not dist.is_initialized():
        return torch.tensor([list(row)], dtype=torch.float64), None
    device = collective_device()
    table = torch.zeros(world_size, len(row), dtype=torch.float64, device=device)
    table[dist.get_rank()] = torch.tensor(list(row), dtype=torch.float64, device=device)
    return table, dist.all_reduce(table, op=dist.ReduceOp.SUM, async_op=True)


def gather_rows(row: Sequence[float], *, world_size: int) -> torch.Tensor:
    """All ranks' ``row`` values as a (world_size, len(row)) float64 CPU tensor (one small all-reduce)."""
    table, work = start_gather_rows(row, world_size=world_size)
    if work is not None:
        work.wait()
    return table.cpu()


def all_finite_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether every element of ``tensors`` is finite, as a 0-dim bool tensor on ``device`` (no host
    synchronization): each tensor's sum is finite exactly when every element is (up to float32's range, as
    ``all_finite_flag``; float64 tensors sum in float64). On an accelerator the sums of absolute values of each
    device and precision run as one fused pass: a model has hundreds of tensors, and one kernel each would cost
    more than the pass itself. On the CPU ``all_finite_flag``'s plain sum per tensor is several times faster than
    that fused norm (the two differ only for finite values adding up to about 1e38)."""
    kinds: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.device, tensor.dtype == torch.float64), []).append(tensor)
    flags = []
    for (where, wide), group in kinds.items():
        if where.type == "cpu":
            flag = torch.stack([all_finite_flag(tensor) for tensor in group]).all()
        else:
            flag = torch.stack(torch._foreach_norm(group, 1, dtype=torch.float64 if wide else torch.float32)) \
                .isfinite().all()
        # onto an accelerator a copy waits on its stream; onto the CPU it must not return before the flag is there
        flags.append(flag.to(device, non_blocking=device.type != "cpu"))
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)


def first_accelerator(devices: Iterable[torch.device]) -> torch.device | None:
    """The first of ``devices`` that is not the CPU, None where all are."""
    return next((device for device in devices if device.type != "cpu"), None)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite (``all_finite_on``, then one host synchronization)."""
    return bool(all_finite_on(tensors, first_accelerator(t.device for t in tensors) or torch.device("cpu")))


_BITS_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FINGERPRINT_CHUNK = 2**22  # elements: bounds the int64 temporaries (a few times 32 MiB)


@torch.no_grad()
def bits_fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit fingerprint of the bits of ``tensors``, taken in order as one sequence: the sum of each element's
    bits (read as a signed integer) times ``2 i + 1``, ``i`` its place in the sequence, in int64 arithmetic that
    wraps around. Exact integer sums: the same tensors give the same fingerprint on every device and in any
    reduction order. Changing one element always changes it (its weight is odd, so invertible modulo 2^64); changes
    to several cancel only by coincidence. Returns the fingerprint as an unsigned int."""
    sums: dict[torch.device, torch.Tensor] = {}  # per device, read once at the end: no host wait per chunk
    start = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_BITS_AS_INTEGERS[flat.element_size()])
        total = sums.setdefault(bits.device, torch.zeros((), dtype=torch.int64, device=bits.device))
        for offset in range(0, bits.numel(), _FINGERPRINT_CHUNK):
            # a copy even where the bits are int64 already (float64), which mul_ would otherwise write over
            chunk = bits[offset:offset + _FINGERPRINT_CHUNK].to(torch.int64, copy=True)
            weights = torch.arange(start + offset, start + offset + chunk.numel(), dtype=torch.int64,
                                   device=chunk.device).mul_(2).add_(1)
            total.add_(chunk.mul_(weights).sum())
        start += bits.numel()
    return sum(int(total) for total in sums.values()) % 2**64


def shut_down() -> None:
    """Ends a process's distributed state in order, while the interpreter is whole, on every rank: for a process
    that goes on after it; a script's last call is ``shut_down_and_exit``, which begins with this.

    What the run built (models, optimizers, HDET's state, held in reference cycles through optimizer hooks) is
    collected while the process groups live, then every group is destroyed, then their objects are collected.
    Left to interpreter exit (Lightning's ``Trainer`` destroys no group), a gloo thread that drops a tensor after
    Python has finalized can abort a finished run: ``terminate called without an active exception``, SIGABRT,
    a failed job. Groups that torch itself still holds keep their threads even after this."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_built()
    gc.collect()


def shut_down_and_exit(code: int = 0) -> NoReturn:
    """``shut_down``, then the end of the process without interpreter finalization: the last call of a script.

    ``destroy_process_group`` does not stop gloo's worker threads: a group's threads end only when its last
    reference goes, and torch and other libraries keep groups alive on their own (a ``DeviceMesh`` that outlives
    the model, a ``group=dist.group.WORLD`` default argument evaluated after ``init_process_group``). Those
    threads then live into the interpreter's finalization, where a thread that needs the GIL cannot have it
    (torch's ``destroy_process_group`` says so of completion hooks). A finished run can then abort at exit:
    ``terminate called without an active exception``, SIGABRT, a failed job (about 1 in 100 four-rank Lightning
    FSDP2 jobs here, with ``shut_down`` called). This function ends the process as a normal exit would up to
    finalization (non-daemon threads joined, ``atexit`` handlers run, standard streams flushed), then exits
    with ``code`` before finalization starts, so no thread of the run can meet a finalizing interpreter.
    """
    shut_down()
    for thread in threading.enumerate():
        if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def cpu_group() -> dist.ProcessGroup | None:
    """A process group over all ranks for objects on the CPU: None (the default group) where that is gloo, else a
    gloo group, built once (``built_once``; collective the first time: every rank calls it, in the same order).
    Objects sent over NCCL are staged on the GPU, a gather's at the world size times the largest on its
    destination."""
    return None if dist.get_backend() == "gloo" else built_once("gloo", lambda: dist.new_group(backend="gloo"))


class AgreedFlag:
    """A flag that any rank may raise and every rank reads alike, one poll later, with no wait in the hot path:
    each ``poll`` starts a non-blocking MAX all-reduce of this rank's flag on ``group`` (a CPU group: see
    ``cpu_group``) and reads the previous poll's, which has long arrived. Every rank polls at the same points
    (each step), so all see the flag at the same one. Without a process group it is this rank's flag as it is."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def poll(self, raised: bool) -> bool:
        """Whether some rank had raised the flag by its previous poll (collective); ``raised``: this rank's now."""
        if not dist.is_initialized():
            return raised
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(raised)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return agreed

    def finish(self) -> None:
        """Waits for the last poll's all-reduce: none is left in flight when the groups go."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

