"""What a checkpoint of ``hdet_scale.lm.train`` holds, part by part: FSDP2 and DeepSpeed ZeRO-2, 2 replicas of 2
ranks (4 CPU ranks, gloo, the tiny preset), in ``global`` and ``local`` gradient mode, at this commit and, with
``--before COMMIT``, at another (its ``hdet_scale`` exported and run from there), in one table.

Each run trains 10 steps, syncing every 5, and writes the checkpoint at its end. The parts are read from the
checkpoint itself: FSDP2's from DCP's metadata (the bytes stored under ``model`` and under each
``optimizer_replica<r>`` key), DeepSpeed's from its file names (the model files; ``*optim_states.pt``, which hold
the fp32 masters and the optimizer's moments, replica 0's beside the model and the other replicas' in
``hdet_replicas/``). The baseline, measured in the same checkpoint, is one model and one optimizer state: what a
checkpoint needs where the replicas' optimizer states are alike.

    .venv/bin/python benchmarks/checkpoint_size.py --before 2aa90d8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import (
    RESULTS,
    bullets,
    head_commit,
    machine_info,
    note,
    save_markdown,
    snapshot_source,
    table_header,
    table_row,
    torchrun_command,
    write_json,
)

ENGINES = ("fsdp", "deepspeed")
MODES = ("global", "local")
RANKS, RANKS_PER_REPLICA, STEPS, SYNC_INTERVAL = 4, 2, 10, 5
TRAIN_ARGS = ["--preset", "tiny", "--steps", str(STEPS), "--seq_len", "32", "--micro_batch_size", "4",
              "--max_data_mb", "1", "--warmup_steps", "2", "--no_progress", "--eval_batches", "1"]
MIB = 2**20


def parts_of_dcp(checkpoint: Path) -> dict[str, Any]:
    """Bytes of an FSDP2 checkpoint's model and of each optimizer state, from DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    model, optimizer = 0, {}
    for index, stored in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            model += stored.length
        elif match := re.match(r"optimizer_replica(\d+)\.", index.fqn):
            optimizer[match.group(1)] = optimizer.get(match.group(1), 0) + stored.length
    return {"model": model, "optimizer": sum(optimizer.values()), "optimizer_states": len(optimizer)}


def parts_of_deepspeed(checkpoint: Path) -> dict[str, Any]:
    """Bytes of a DeepSpeed checkpoint's model files and optimizer files, and how many replicas wrote the latter."""
    optimizer_files = list(checkpoint.rglob("*optim_states.pt"))
    writers = {path.name.split("_", 1)[0] if path.parent.name == "hdet_replicas" else "replica0"
               for path in optimizer_files}
    model_files = list(checkpoint.rglob("*model_states.pt"))
    return {"model": sum(path.stat().st_size for path in model_files),
            "optimizer": sum(path.stat().st_size for path in optimizer_files), "optimizer_states": len(writers)}


def measure(engine: str, mode: str, source: Path, work: Path) -> dict[str, Any]:
    """Trains one run with the code in ``source`` and returns its checkpoint's parts."""
    out = work / f"{engine}_{mode}"
    hdet = work / f"hdet_{mode}.json"
    hdet.write_text(json.dumps({"ranks_per_replica": RANKS_PER_REPLICA, "sync_interval": SYNC_INTERVAL,
                                "gradient_mode": mode, "auto_lr": {"enabled": False}}))
    zero = ["--zero_stage", "2"] if engine == "deepspeed" else []
    command = torchrun_command(RANKS, "-m", "hdet_scale.lm.train", "--engine", engine, *TRAIN_ARGS, *zero,
                               "--hdet_config", str(hdet), "--out", str(out))
    result = subprocess.run(command, cwd=source, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise RuntimeError(f"{engine} {mode} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    checkpoints = out / "checkpoints"
    checkpoint = checkpoints / ("latest" if engine == "fsdp" else (checkpoints / "latest").read_text().strip())
    parts = parts_of_dcp(checkpoint) if engine == "fsdp" else parts_of_deepspeed(checkpoint)
    total = sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())
    return {**parts, "total": total}


def report(record: dict[str, Any]) -> list[str]:
    lines = ["# Checkpoint size", "",
             f"train.py's checkpoint at step {STEPS}: tiny preset, {RANKS} CPU ranks as "
             f"{RANKS // RANKS_PER_REPLICA} replicas of {RANKS_PER_REPLICA}, ZeRO-2 for DeepSpeed, AdamW. "
             "Baseline (same checkpoint): one model and one optimizer state. Sizes in MiB.", "",
             *table_header("code", "engine", "mode", "total", "model", "optimizer", "optimizer states saved",
                           "total / baseline")]
    for row in record["rows"]:
        one_state = row["optimizer"] / row["optimizer_states"]
        baseline = row["total"] - row["optimizer"] + one_state
        lines.append(table_row(row["code"], row["engine"], row["mode"], f"{row['total'] / MIB:.2f}",
                               f"{row['model'] / MIB:.2f}", f"{row['optimizer'] / MIB:.2f}",
                               row["optimizer_states"], f"{row['total'] / baseline:.2f}x"))
    lines += ["", *bullets([f"{key}: {value}" for key, value in record["machine"].items()]), "",
              *note("reading")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=None, help="a commit to measure beside this one")
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint_size")
    args = parser.parse_args()
    commits = [head_commit()] + ([args.before] if args.before else [])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for commit in commits:
            source = snapshot_source(commit, Path(scratch))
            for engine in ENGINES:
                for mode in MODES:
                    work = Path(scratch) / commit[:12]
                    work.mkdir(exist_ok=True)
                    rows.append({"code": commit[:9], "engine": engine, "mode": mode,
                                 **measure(engine, mode, source, work)})
                    print(rows[-1], flush=True)
    record = {"machine": machine_info(backend="gloo", ranks=RANKS, packages=("torch", "deepspeed")),
              "command": " ".join(sys.argv), "rows": rows}
    write_json(args.out.with_suffix(".json"), record)
    save_markdown(args.out.with_suffix(".md"), report(record))


if __name__ == "__main__":
    main()
