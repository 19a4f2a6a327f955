"""``hdet_scale.lm.demo_ddp``, HDET on plain DDP with the drop-in ``HDETOneCycleLR``, launched by torchrun as its
docstring says: the LR range test's steps come before the run's, and the run trains every step of its schedule."""

from __future__ import annotations

import json

import pytest
from launcher import BIN, free_port, launch

STEPS = 30


@pytest.mark.e2e
def test_the_demo_trains_its_whole_schedule_after_the_range_test(tmp_path):
    out = tmp_path / "out"
    command = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "-m", "hdet_scale.lm.demo_ddp",
               "--steps", str(STEPS), "--batch_size", "2", "--seq_len", "32", "--corpus_mb", "0.5", "--out", str(out)]
    result = launch(command, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "HDET demo: 2 ranks, 2 replicas, alpha=0, T=25" in result.stdout
    lines = [json.loads(line) for line in (out / "hdet_metrics.jsonl").read_text().splitlines()]
    assert "range_test" in lines[0]
    # a sync at T and one at the end: the schedule's 30 steps, after the test's
    assert [line["step"] for line in lines[1:]] == [25, STEPS]
    assert "final train loss" in result.stdout
