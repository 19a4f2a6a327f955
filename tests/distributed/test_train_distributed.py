"""train.py's steps that need a process group, on gloo ranks without a launch: taking --out.

The launches themselves are in tests/e2e/test_train_e2e.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from distributed import run_ranks


def take_after_plans_that_differ(rank: int, world: int, directory: str) -> tuple[str, bool]:
    from hdet_scale.lm.agreement import RunFailed
    from hdet_scale.lm.checkpoints import out_state
    from hdet_scale.lm.out_lock import LOCK
    from hdet_scale.lm.train import take_out

    out = Path(directory) / "run"
    out.mkdir(exist_ok=True)
    # The ranks plan one after another: rank 1 finds an empty --out; then another run that held it ends, leaving
    # its checkpoint; then rank 0 plans, and resumes that checkpoint.
    planned = out_state(out, None) if rank == 1 else None
    dist.barrier()
    if rank == 0:
        (out / "checkpoints" / "latest").mkdir(parents=True)
        planned = out_state(out, None)
    dist.barrier()
    checked = SimpleNamespace(out_state=planned, config=SimpleNamespace(metrics_path=None))
    try:
        take_out(out, checked)
        said = "taken"
    except RunFailed as failure:
        said = str(failure)
    dist.barrier()
    return said, (out / LOCK).exists()


def test_ranks_whose_plans_found_different_runs_in_out_do_not_take_it(tmp_path):
    """Rank 0 checked only its own plan against --out: rank 0 resumed the checkpoint while rank 1 started afresh
    (skipping the load's collectives: a hang, or a rank training other weights)."""
    for said, locked in run_ranks(take_after_plans_that_differ, 2, str(tmp_path), timeout=60):
        assert said.startswith(f"taking {tmp_path / 'run'}: OutInUse: --out {tmp_path / 'run'} changed while this "
                               "run was starting (its ranks found different runs there")
        assert not locked
