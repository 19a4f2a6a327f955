"""A first run on one machine explores: sharded engines get two replicas by default, and a run left with one
replica while HDET is set to explore says so once, on rank 0 and in train.py's header.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_single_node.py and the tests on gloo ranks are in tests/distributed/test_single_node_distributed.py.
"""

from __future__ import annotations

import json

import pytest
from launcher import SHORT, launch, torchrun


@pytest.mark.e2e
def test_train_header_warns_of_one_replica(tmp_path):
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"ranks_per_replica": 2, "sync_interval": 5}))
    result = launch([*torchrun(2), *SHORT[:2], "--steps", "5", *SHORT[4:], "--warmup_steps", "1", "--hdet_config",
                     str(hdet), "--out", str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    header = result.stdout.split("HDET train:")[1].splitlines()
    assert "replicas=1 ranks_per_replica=2" in header[0]
    assert header[1].startswith("WARNING: HDET has ONE replica (2 rank(s), ranks_per_replica=2)")
    assert result.stdout.count("HDET has ONE replica") == 1  # not also as a Python warning before the header
