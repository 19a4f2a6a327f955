"""The scalars rank 0 of ``hdet_scale.lm.train`` records, and where they go: TensorBoard when it is installed,
Weights & Biases when ``--wandb PROJECT`` asks for it. Both get the same names and values, those of the
metrics file's sync lines (``hdet_metrics.jsonl``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdet_scale.durable import write_text_durably
from hdet_scale.lm.checkpoints import TENSORBOARD, WANDB_ID_FILE

WANDB_STEP = "step"
"""The training step, logged with every W&B row; the x-axis of every chart."""


class ScalarSinks:
    """TensorBoard (``<out>/tensorboard``, when installed) and W&B (with a project); rank 0 only. ``resumed``: the
    run continues a checkpoint, and W&B continues the W&B run recorded in ``out``."""

    def __init__(self, out: Path, *, wandb_project: str | None, config: dict[str, Any], resumed: bool = False) -> None:
        self._board: Any = None
        self._board_dir = out / TENSORBOARD
        self._wandb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # TensorBoard is optional
            SummaryWriter = None  # noqa: N806
        # Opened when the run starts, not here: the output directory is tidied first (--overwrite removes old events)
        self._board_class = SummaryWriter
        if wandb_project:
            import wandb

            self._id_file = out / WANDB_ID_FILE
            run_id = (self._id_file.read_text().strip() if resumed and self._id_file.is_file()
                      else None)  # None: W&B draws one
            self._wandb = wandb.init(project=wandb_project, id=run_id, resume="allow", dir=str(out), config=config)
            self._keep_wandb_id()
            # The training step is a metric every chart is drawn over, not W&B's own step, which drops a row below
            # the highest logged: a resumed run logs again the steps after its checkpoint that an attempt logged.
            self._wandb.define_metric(WANDB_STEP)
            self._wandb.define_metric("*", step_metric=WANDB_STEP)

    def start(self, step: int) -> None:
        """The run starts, or resumes, at ``step`` (it logs the steps after it): TensorBoard drops what an earlier
        attempt in this directory logged after ``step`` (a run interrupted past its last checkpoint, or requeued
        before its first), so the curves go on without steps logged twice. The W&B run's id is kept again: an
        ``--overwrite`` removed the replaced run's, and the file with it, after W&B started."""
        self._open_board(purge_step=step + 1)
        self._keep_wandb_id()

    def _keep_wandb_id(self) -> None:
        """Writes the W&B run's id where a resumed run finds it (``WANDB_ID_FILE``)."""
        if self._wandb is not None:
            write_text_durably(self._id_file, self._wandb.id + "\n")

    def _open_board(self, purge_step: int | None) -> None:
        if self._board is None and self._board_class is not None:
            self._board = self._board_class(str(self._board_dir), purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._open_board(purge_step=None)  # opened here only for a caller that never said where the run starts
        if self._board is not None:
            for name, value in scalars.items():
                self._board.add_scalar(name, value, step)
        if self._wandb is not None:
            self._to_wandb(lambda: self._wandb.log({**scalars, WANDB_STEP: step}))

    def close(self) -> None:
        self._board_class = None  # nothing opens after this
        if self._board is not None:
            self._board.close()
            self._board = None
        if self._wandb is not None:
            self._to_wandb(self._wandb.finish)
            self._wandb = None

    def _to_wandb(self, call: Callable[[], Any]) -> None:
        """W&B's service process is a child of rank 0, and a launcher or Slurm that signals the job for a
        preemption stops it too (the deepspeed launcher terminates its ranks' process trees): logging then fails,
        and it must not fail the checkpoint that follows. One line says so; the metrics file has every sync."""
        try:
            call()
        except Exception as error:  # whatever the lost connection raises
            import wandb

            print(f"W&B stopped logging ({type(error).__name__}: {error}); the metrics file has every sync",
                  file=sys.stderr, flush=True)
            self._wandb = None
            with contextlib.suppress(Exception):  # else its exit hook reports the lost connection as a traceback
                wandb.teardown()
