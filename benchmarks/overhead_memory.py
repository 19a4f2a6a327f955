"""The overhead benchmark's section 4: peak memory of the plain engine, of HDET in both gradient modes and with
the controller signals that keep copies of the weights, and the meter it reads (CUDA's allocator statistics,
or on CPU the kernel's peak resident set size). Run in a launch of its own (see ``overhead.py``)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from overhead_engines import SIGNALS, Settings, Trainer, build_engines, hdet_config
from overhead_timing import gather

MEMORY_SYNC_INTERVAL, MEMORY_STEPS = 2, 4  # two syncs in the window


# ------------------------------------------------------------------------------------------- meter
class PeakMemory:
    """Memory in use on ``device`` inside a ``with`` block, counted from its start: ``peak_bytes`` (the most at
    any moment, every thread included) and ``retained_bytes`` (still in use at its end).

    CUDA reads the caching allocator's statistics. The CPU allocator keeps none, so on CPU (Linux) the kernel's
    peak resident set size is reset at the start (``/proc/self/clear_refs``) and read at the end. That counts
    tensors exactly only when freed blocks go back to the kernel: call ``map_every_large_block`` first.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = self.retained_bytes = 0
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
            self._base = resident_bytes()["VmRSS"]
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak, now = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        else:
            sizes = resident_bytes()
            peak, now = sizes["VmHWM"], sizes["VmRSS"]
        self.peak_bytes, self.retained_bytes = peak - self._base, now - self._base


def map_every_large_block() -> None:
    """Makes glibc map every block of 64 KiB or more by itself, as ``PeakMemory`` on CPU needs: with its default
    sliding mmap threshold glibc serves later tensors from its heap, which the resident set never gives back."""
    m_mmap_threshold = -3  # glibc's malloc.h
    if not ctypes.CDLL(None).mallopt(m_mmap_threshold, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the CPU memory measurement needs glibc")


def resident_bytes() -> dict[str, int]:
    """This process's current (VmRSS) and peak (VmHWM) resident set size in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}  # reported in kB


# ----------------------------------------------------------------------------------------- measurement
def metered(settings: Settings, device: torch.device, build: Callable[[], Trainer]) -> dict[str, int]:
    """Builds a trainer and trains it ``MEMORY_STEPS`` steps inside one ``PeakMemory`` window; the maximum
    over ranks of the window's peak and retained bytes (collective). The trainer is dropped afterwards."""
    generator = torch.Generator().manual_seed(3000 + dist.get_rank())
    x = torch.randn(settings.batch, settings.width, generator=generator).to(device)
    y = torch.randint(0, 16, (settings.batch,), generator=generator).to(device)
    gc.collect()
    with PeakMemory(device) as meter:
        trainer = build()
        for _ in range(MEMORY_STEPS):
            trainer.train_step(x, y)
    if trainer.hdet is not None:
        trainer.hdet.close()
    del trainer
    gc.collect()
    peak, retained = (max(column) for column in zip(*gather([meter.peak_bytes, meter.retained_bytes]), strict=True))
    return {"peak_bytes": peak, "retained_bytes": retained}


def measure_memory(settings: Settings, device: torch.device) -> dict[str, dict[str, dict[str, int]]]:
    """Section 4 of every engine part: the plain engine, HDET in both gradient modes, then with each controller
    signal (``SIGNALS``)."""
    engines = build_engines(settings, device)

    def after_warmup(build: Callable[[], Trainer]) -> dict[str, int]:
        # A variant's first run in a process sets up what then stays (thread pools, a process group's first
        # collectives: about 2 MiB for HDET's groups here), which is not what each run of it costs.
        metered(settings, device, build)
        return metered(settings, device, build)

    # All plain engines before any HDET engine, for the same reason as in ``overhead.measure``.
    plain = {engine.part: after_warmup(engine.plain_trainer) for engine in engines}
    return {engine.part: {"plain": plain[engine.part], **{
        f"hdet_{mode}": after_warmup(lambda engine=engine, mode=mode: engine.hdet_trainer(
            mode, hdet_config(settings, MEMORY_SYNC_INTERVAL, gradient_mode=mode)))
        for mode in ("global", "local")}, **{
        f"hdet_{name}": after_warmup(lambda engine=engine, name=name: engine.signal_trainer(
            name, MEMORY_SYNC_INTERVAL, name)) for name in SIGNALS}} for engine in engines}
