"""One handle on every engine: what DDP's ``attach`` and scheduler and FSDP2's ``wrap`` hand back answer the same
calls (the probe, an early sync, the last report, the step count, explored values, the state), and the handles
whose loop steps HDET itself refuse ``step``.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_handle_distributed.py.
"""

from __future__ import annotations

import pytest
from settings import LR_HELD_AT_GIVEN

from hdet_scale.handle import HDETHandle


def test_the_handles_whose_loop_steps_hdet_refuse_a_step_or_a_loss_of_their_own():
    """A loss observed by hand where the loop hands HDET each one already would count twice."""
    from hdet_scale.engines.deepspeed import HDETDeepSpeed
    from hdet_scale.integrations import hf_trainer, lightning

    for handle, where in ((HDETDeepSpeed, "engine.backward\\(loss\\) hands HDET each loss"),
                          (hf_trainer.HDETCallback, "the Trainer hands HDET each loss"),
                          (lightning.HDETCallback, "HDETCallback hands HDET each loss")):
        assert issubclass(handle, HDETHandle)
        for call in ("step", "observe"):
            with pytest.raises(RuntimeError, match=f"{where}.*: do not call {call}\\(\\)"):
                getattr(handle, call)(object.__new__(handle), 1.0)


def test_the_ensemble_answers_every_call_of_the_handle():
    """DDP's attach hands back the ensemble itself, registered as a handle: the handle's check_one_model was missing
    on it (an AttributeError in code written against the handle)."""
    import torch
    from torch import nn

    from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
    from hdet_scale.engines.ddp import DDPAdapter

    calls = [name for name in dir(HDETHandle) if not name.startswith("_") and name != "loop_feeds_hdet"]
    assert [name for name in calls if not hasattr(HDETEnsemble, name)] == []
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=LR_HELD_AT_GIVEN), DDPAdapter(optimizer),
                        topology=ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1))
    assert isinstance(hdet, HDETHandle)
    hdet.check_one_model("an export")  # at the start: one model
    hdet.step(1.0)
    with pytest.raises(RuntimeError, match="an export is taken at sync points, where the replicas are one model; step "
                                           "1 is between syncs"):
        hdet.check_one_model("an export")
