"""SIGTERM (Slurm preemption, the time limit, ``scancel``), SIGUSR1 (the Slurm templates' time guard, which
torchrun and DeepSpeed's launchers are made to ignore, so that they do not kill the ranks 30 s after it) or Ctrl-C
turned into a clean stop that every rank agrees on.

The signal reaches ranks at different moments (the deepspeed launcher signals its children one by one), so
a rank cannot act on its own flag: every step the ranks poll an ``AgreedFlag`` on a CPU group, and all see the
same decision at the same step, one step after the first rank was signalled, with no wait in the hot path.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

import torch.distributed as dist

from hdet_scale.comm import AgreedFlag


class StopSignal:
    """Catches SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) and answers, collectively, whether the run should stop now.

    The first signal asks for a stop at the next safe point, with a checkpoint; a second SIGINT (Ctrl-C pressed
    again) aborts this rank at once, without one. A SIGINT within ``REPEAT_SECONDS`` of the first is the same
    Ctrl-C arriving twice (the terminal signals every process, and torchrun forwards what it got), not a
    second press."""

    REPEAT_SECONDS = 2.0

    def __init__(self, group: dist.ProcessGroup | None = None,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)) -> None:
        self.group = group
        self.received: int | None = None
        self.finishing = False
        self._first = 0.0
        self._vote = AgreedFlag(group)
        self._previous = {number: signal.signal(number, self._handle) for number in signals}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if (self.received is not None and number == signal.SIGINT
                and time.monotonic() - self._first > self.REPEAT_SECONDS):  # also while the run finishes
            print(f"rank {rank}: SIGINT again; stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        if self.received is not None:
            return
        self.received, self._first = number, time.monotonic()
        name, ctrl_c = signal.Signals(number).name, number == signal.SIGINT
        if self.finishing:
            print(f"rank {rank}: received {name} while the run finishes; it writes its last checkpoint and model first"
                  + (" (Ctrl-C again: stop now, without them)" if ctrl_c else ""), file=sys.stderr, flush=True)
        else:
            print(f"rank {rank}: received {name}; stopping at the next safe point to checkpoint"
                  + (" (Ctrl-C again: stop now, without one)" if ctrl_c else ""), file=sys.stderr, flush=True)

    def poll(self) -> bool:
        """Call once per step on every rank: True when some rank had been signalled by the previous poll."""
        return self._vote.poll(self.received is not None)

    def stop_polling(self) -> None:
        """Ends the polls (waits for the last one's all-reduce) and keeps catching the signals: a run writing its
        last checkpoint and model is not killed by a SIGTERM in the middle of it (a second Ctrl-C still aborts)."""
        self._vote.finish()
        self.finishing = True

    def close(self) -> None:
        """Ends the polls and restores the previous handlers."""
        self.stop_polling()
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
