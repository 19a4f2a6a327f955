"""What rank 0 shows and records while ``hdet_scale.lm.train`` runs: a progress bar on a terminal, one line per
sync (also in log files, where a bar is noise), and scalars for TensorBoard and W&B (``hdet_scale.lm.scalars``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from hdet_scale.durable import write_text_durably
from hdet_scale.lm.scalars import ScalarSinks
from hdet_scale.metrics import MetricsWriter, SyncReport

BAR_REFRESH_STEPS = 10  # the bar's loss needs a host sync: read it every few steps, not every step


def _record(line: str) -> dict[str, Any] | None:
    """The metrics record on ``line``, or None when it is not one (blank, or cut short)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


class Progress:
    """Rank 0's output; every method is a no-op on other ranks (``enabled=False``)."""

    def __init__(self, out: Path, *, enabled: bool, bar: bool, total: int, metrics_path: str | None,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None,
                 resumed: bool = False, sync_lines: bool = True) -> None:
        self.enabled = enabled
        self._sync_lines = sync_lines  # a plain run (a replay) has syncs only to record what it applied
        # Held-out losses go into the metrics file too, as {"step", "heldout_loss"} lines (hdet_scale.tools.report
        # plots them next to the sync lines).
        self._metrics = MetricsWriter(metrics_path, is_writer=enabled)
        self.total = total
        self._bar: Any = None
        self._sinks: ScalarSinks | None = None
        self._started = time.perf_counter()
        self._first_step = 0
        self._tokens_per_step = 0
        self._heldout_recorded: set[int] = set()  # steps whose held-out loss this run or the one it resumes recorded
        if not enabled:
            return
        if bar:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (Slurm logs get the sync lines only).
            self._bar = tqdm(total=total, disable=None, dynamic_ncols=True, unit="step")
        self._sinks = ScalarSinks(out, wandb_project=wandb_project, config=config or {}, resumed=resumed)

    def start(self, step: int, tokens_per_step: int) -> None:
        """Starts the clock at ``step`` (non-zero after a resume)."""
        self._started = time.perf_counter()
        self._first_step = step
        self._tokens_per_step = tokens_per_step
        if self._sinks is not None:
            self._sinks.start(step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def tokens_per_second(self, step: int) -> float:
        return (step - self._first_step) * self._tokens_per_step / max(self.elapsed(), 1e-9)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def step(self, step: int, loss: torch.Tensor, lr: float, report: SyncReport | None) -> None:
        """After optimizer step ``step``: the bar (with ``lr``, the replicas' shared LR now), and the sync line when
        HDET synced."""
        if not self.enabled:
            return
        if report is not None:
            self.sync(report)
        if self._bar is not None and not self._bar.disable:
            self._bar.update(step - self._bar.n)
            if step % BAR_REFRESH_STEPS == 0:
                self._bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}",
                                      tok_s=f"{self.tokens_per_second(step):.0f}")

    def sync(self, report: SyncReport) -> None:
        if not self.enabled:
            return
        lr = report.values.get("lr/0", {})
        scale = lr.get("scale", 1.0)
        scalars = report.scalars()
        mean = scalars["hdet/loss"]
        if self._sync_lines:
            self.line(f"sync step {report.step}  loss {mean:.4f}  replica losses "
                      f"[{', '.join('nan' if loss is None else f'{loss:.4f}' for loss in report.replica_losses)}]  "
                      f"lr {lr.get('base', float('nan')):.3e} ({scale:.3g} x schedule)  "
                      f"{self.tokens_per_second(report.step):.0f} tok/s  sync {report.sync_seconds * 1000:.0f} ms")
        if self._sinks is not None:
            self._sinks.log({**scalars, "train/tokens_per_second": self.tokens_per_second(report.step)}, report.step)

    def heldout(self, step: int, loss: float, *, announce: bool = True) -> None:
        """Says and records a held-out loss; one recorded for ``step`` already (a run resumed from its last
        checkpoint evaluates it again) is not recorded twice."""
        if announce:
            self.line(f"held-out loss {loss:.4f} at step {step}")
        if step in self._heldout_recorded:
            return
        self._heldout_recorded.add(step)
        self._metrics.write({"step": step, "heldout_loss": loss})
        if self.enabled and self._sinks is not None:
            self._sinks.log({"eval/heldout_loss": loss}, step)

    def heldout_recorded(self, step: int) -> bool:
        """Whether the held-out loss at ``step`` is recorded (the same on every rank)."""
        return step in self._heldout_recorded

    def resume_heldout(self, step: int) -> None:
        """The run resumed records its held-out loss at ``step`` no more: the run it resumes did (in the metrics
        file, TensorBoard and W&B, whichever it had)."""
        self._heldout_recorded.add(step)

    def truncate_metrics(self, metrics_path: str | None, step: int) -> None:
        """Drops metrics lines past ``step`` (written by the run before it was interrupted after its last
        checkpoint), so the resumed run's lines follow on without duplicates, and lines that are not whole
        records (a kill in the middle of a write), saying how many. The file is replaced at once, never left
        half written."""
        if not self.enabled or not metrics_path or not Path(metrics_path).is_file():
            return
        path = Path(metrics_path)
        kept, unreadable = [], 0
        for line in path.read_text().splitlines():
            record = _record(line)
            if record is None:
                unreadable += bool(line.strip())
            elif record["step"] <= step:
                kept.append(line)
                if "heldout_loss" in record:
                    self._heldout_recorded.add(record["step"])
        # a node crash cannot bring back the lines dropped, nor lose those kept
        write_text_durably(path, "".join(line + "\n" for line in kept))
        if unreadable:
            self.line(f"{path}: dropped {unreadable} unreadable line(s), left by an interrupted write")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None
