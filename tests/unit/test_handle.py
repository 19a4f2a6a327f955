"""One handle on every engine: what DDP's ``attach`` and scheduler and FSDP2's ``wrap`` hand back answer the same
calls (the probe, an early sync, the last report, the step count, explored values, the state), and the handles
whose loop steps HDET itself refuse ``step``.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_handle_distributed.py.
"""

from __future__ import annotations

import pytest

from hdet_scale.handle import HDETHandle


def test_the_handles_whose_loop_steps_hdet_refuse_a_step_of_their_own():
    from hdet_scale.engines.deepspeed import HDETDeepSpeed
    from hdet_scale.integrations import hf_trainer, lightning

    for handle, where in ((HDETDeepSpeed, "engine.step\\(\\) takes HDET's step"),
                          (hf_trainer.HDETCallback, "the Trainer's optimizer steps take HDET's steps"),
                          (lightning.HDETCallback, "HDETCallback steps HDET after every Lightning optimizer step")):
        assert issubclass(handle, HDETHandle)
        with pytest.raises(RuntimeError, match=where):
            handle.step(object.__new__(handle), 1.0)
