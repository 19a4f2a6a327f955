"""One handle on every engine: what DDP's ``attach`` and scheduler and FSDP2's ``wrap`` hand back answer the same
calls (the probe, an early sync, the last report, the step count, explored values, the state), and the handles
whose loop steps HDET itself refuse ``step``.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_handle_distributed.py.
"""

from __future__ import annotations

import pytest

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
