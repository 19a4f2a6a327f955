"""One run of the LR-finding benchmark: a byte-level Llama on the stdlib corpus, data parallel on gloo/nccl.

    torchrun --standalone --nproc_per_node 4 benchmarks/lr_finding_worker.py --lr 3e-3 --out runs/x \
        [--schedule cosine|onecycle|wsd] [--hdet_config hdet.json] [--probe] [--optimizer adamw|schedulefree|prodigy]

Every rank is a replica (the paper's layout; global gradients). Without ``--hdet_config`` it is plain data
parallel with AdamW on the schedule; with one, HDET runs on the same schedule (``HDETScheduler``; the paper's
controller needs the schedule's floor, ``paper_decay``). ``schedulefree`` (AdamWScheduleFree, warm-up only) and
``prodigy`` (Prodigy at LR 1.0 on the schedule) are plain data parallel. ``--range_test`` runs the LR range test
instead (``hdet_scale.range_test``: plain data parallel, AdamW at an exponentially growing LR for ``--range_steps``
steps); its ``result.json`` holds the LRs, the smoothed losses and the picked LR, and no held-out loss.

Schedules, as factors of ``--lr``: ``cosine``, linear warm-up over ``--warmup_fraction`` of the steps, then a
cosine to ``--min_lr_ratio``; ``wsd``, the same warm-up, constant, then a linear decay to ``--min_lr_ratio``
over the last ``--decay_fraction``; ``onecycle``, torch's OneCycleLR with its defaults.

``--batch FILE`` (a JSON list of argument lists) runs several runs one after another in one process group.
Rank 0 writes each run's ``result.json``: the final model's held-out and training loss on fixed batches, the
step it diverged at (None), wall time, tokens, and for HDET the controller's effective scale (the base LR over
the schedule's LR) at every sync and its Delta at every update.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from quality_worker import fixed_loss, plain_data_parallel, run_worker, set_heldout_probe, stdlib_corpus, training_step

from hdet_scale import HDETScheduler, ReplicaTopology, load_config
from hdet_scale.controller import PaperDecay
from hdet_scale.engines.ddp import wrap_model
from hdet_scale.lm.model import build_model
from hdet_scale.range_test import SmoothedLoss, ramp_lr, steepest_descent

SCHEDULES = ("cosine", "onecycle", "wsd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset of hdet_scale.lm.model")
    parser.add_argument("--hidden", type=int, default=None, help="override the preset's hidden size")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--lr", type=float, default=None, help="peak LR (schedule-free's LR)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    parser.add_argument("--warmup_fraction", type=float, default=0.05, help="linear warm-up, share of the steps")
    parser.add_argument("--decay_fraction", type=float, default=0.2, help="wsd: the decay's share of the steps")
    parser.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine and wsd: final LR over --lr")
    parser.add_argument("--optimizer", choices=("adamw", "schedulefree", "prodigy"), default="adamw")
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--hdet_config", default=None, help="HDET JSON; none: plain data parallel")
    parser.add_argument("--replay_scales", default=None,
                        help="plain run whose LR is the schedule times the controller's scale path recorded in "
                             "this result.json of an HDET run (tells the LR path's cost from HDET's own)")
    parser.add_argument("--range_test", action="store_true",
                        help="the LR range test instead of a run (--lr, --schedule and --steps are not used)")
    parser.add_argument("--range_start", action="store_true",
                        help="HDET: run the range test first, start again from the same initial weights, and read "
                             "the config's auto_lr initial_scale, scale_min and scale_max as multiples of the LR the "
                             "test picked (over --lr)")
    parser.add_argument("--range_steps", type=int, default=100, help="range test: steps of the LR ramp")
    parser.add_argument("--range_min", type=float, default=1e-6, help="range test: the ramp's first LR")
    parser.add_argument("--range_max", type=float, default=1.0, help="range test: the ramp's last LR")
    parser.add_argument("--probe", action="store_true", help="HDET: score the replicas on a shared probe batch")
    parser.add_argument("--probe_batch", type=int, default=32, help="windows in the probe batch")
    parser.add_argument("--corpus_mb", type=float, default=4.0, help="MiB of the stdlib corpus")
    parser.add_argument("--eval_batches", type=int, default=16, help="fixed batches for the final losses")
    parser.add_argument("--seed", type=int, default=0, help="model, data and HDET seed")
    parser.add_argument("--out", required=True, help="directory for result.json")
    args = parser.parse_args(argv)
    if args.replay_scales and (args.schedule == "onecycle" or args.hdet_config):
        parser.error("--replay_scales replays on cosine or wsd, in a plain run (no --hdet_config)")
    if args.range_test and (args.hdet_config or args.replay_scales or args.optimizer != "adamw"):
        parser.error("--range_test is a plain AdamW run: drop --hdet_config, --replay_scales and --optimizer")
    if args.lr is None and not args.range_test:
        parser.error("--lr is required (except with --range_test)")
    if args.range_start and not args.hdet_config:
        parser.error("--range_start starts an HDET run: give --hdet_config")
    return args


def schedule_factor(args: argparse.Namespace) -> Callable[[int], float]:
    """The LR at step ``s`` (0-based, the value the ``s``-th optimizer step uses) as a factor of ``--lr``."""
    steps, low = args.steps, args.min_lr_ratio
    warmup = max(1, round(args.warmup_fraction * steps))

    def cosine(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    def wsd(s: int) -> float:
        decay_from = steps - max(1, round(args.decay_fraction * steps))
        if s < warmup:
            return (s + 1) / warmup
        if s < decay_from:
            return 1.0
        return 1.0 - (1.0 - low) * min(1.0, (s - decay_from + 1) / (steps - decay_from))

    shape = cosine if args.schedule == "cosine" else wsd
    if not args.replay_scales:
        return shape
    # A scale recorded at the sync after step s applies from the next step on (0-based index s).
    recorded = json.loads(Path(args.replay_scales).read_text())["scales"]

    def replayed(s: int) -> float:
        scale = 1.0
        for step, value in recorded:
            if step > s:
                break
            scale = value
        return shape(s) * scale

    return replayed


def optimizer_and_schedule(args: argparse.Namespace, model: torch.nn.Module) -> tuple[Any, Any]:
    """The optimizer and its LR scheduler (None for schedule-free, which warms up by itself)."""
    warmup = max(1, round(args.warmup_fraction * args.steps))
    if args.optimizer == "schedulefree":
        import schedulefree

        return schedulefree.AdamWScheduleFree(model.parameters(), lr=args.lr, warmup_steps=warmup,
                                              weight_decay=args.weight_decay), None
    if args.optimizer == "prodigy":
        from prodigyopt import Prodigy

        # Prodigy's authors: LR 1.0 with the usual schedule; safeguard_warmup when the LR warms up.
        optimizer = Prodigy(model.parameters(), lr=1.0, weight_decay=args.weight_decay, safeguard_warmup=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.schedule == "onecycle":
        peak = 1.0 if args.optimizer == "prodigy" else args.lr
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak, total_steps=args.steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(args))


def train_one(args: argparse.Namespace, device: torch.device) -> None:
    """One run inside an initialized process group, on ``device``; rank 0 writes ``result.json``."""
    config = load_config(args.hdet_config) if args.hdet_config else None
    rank = dist.get_rank()
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").unlink(missing_ok=True)
    corpus = stdlib_corpus(args.corpus_mb)
    torch.manual_seed(args.seed)
    overrides = {key: value for key, value in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers))
                 if value is not None}
    model = build_model(args.preset, vocab_size=corpus.vocab_size, seq_len=args.seq_len, **overrides).to(device)
    hdet, picked = None, None
    if args.range_start:
        picked = range_test(args, plain_data_parallel(model), corpus, device)["range_test"]["picked_lr"]
        if picked is None:
            raise SystemExit(f"{out.name}: the range test picked no LR")
        config = relative_to_pick(config, picked / args.lr)
        torch.manual_seed(args.seed)  # the same initial weights as without the test
        model = build_model(args.preset, vocab_size=corpus.vocab_size, seq_len=args.seq_len, **overrides).to(device)
    if args.range_test:
        model = plain_data_parallel(model)
        result = range_test(args, model, corpus, device)
        if rank == 0:
            (out / "result.json").write_text(json.dumps({**result, "args": vars(args)}, indent=1) + "\n")
            print(f"{out.name}: picked LR {result['range_test']['picked_lr']}  ({result['wall_seconds']:.0f} s)",
                  flush=True)
        dist.barrier()
        return
    if config is not None:
        topology = ReplicaTopology.build(config)
        model = wrap_model(model, config, topology)
        optimizer, schedule = optimizer_and_schedule(args, model)
        floor = [PaperDecay(args.steps, args.lr * args.min_lr_ratio)] if config.auto_lr.mode == "paper" else None
        hdet = HDETScheduler(schedule, hdet_config=config, model=model, topology=topology, paper_decay=floor,
                             total_steps=args.steps)
        schedule = hdet
        if args.probe:
            set_heldout_probe(hdet.hdet, model, corpus, args, rank)
    else:
        model = plain_data_parallel(model)
        optimizer, schedule = optimizer_and_schedule(args, model)
    if args.optimizer == "schedulefree":
        optimizer.train()
    result = run_steps(args, model, optimizer, schedule, hdet, corpus, device)
    if rank == 0:
        if args.optimizer == "schedulefree":
            optimizer.eval()  # its averaged sequence is the model, as its authors evaluate it
        result["heldout"] = fixed_loss(model.module, corpus.heldout, args, device)
        result["train"] = fixed_loss(model.module, corpus.train, args, device)
        result["args"] = vars(args)
        library_pick = hdet.hdet.range_test_pick if hdet is not None else None  # auto_lr.range_test's
        result["range_pick"] = picked if picked is not None else library_pick
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"{out.name}: held-out {result['heldout']:.4f}  ({result['wall_seconds']:.0f} s)", flush=True)
    if hdet is not None:
        hdet.hdet.close()
    dist.barrier()


def range_test(args: argparse.Namespace, model: torch.nn.Module, corpus: Any, device: torch.device) -> dict[str, Any]:
    """The LR range test on ``model`` (see ``hdet_scale.range_test``): the ramp's LRs, the mean loss over the ranks
    and its smoothed value at each step until the ramp ends or the smoothed loss diverges, and the picked LR."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.range_min, weight_decay=args.weight_decay)
    data = torch.Generator().manual_seed(args.seed * 100_003 + dist.get_rank())
    smoother, lrs, losses, smoothed, started = SmoothedLoss(), [], [], [], time.perf_counter()
    for step in range(args.range_steps):
        lr = ramp_lr(step, steps=args.range_steps, lr_min=args.range_min, lr_max=args.range_max)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = training_step(model, optimizer, corpus, args, data, device).detach()
        dist.all_reduce(loss)  # the same mean on every rank, so every rank stops at the same step
        mean = loss.item() / dist.get_world_size()
        lrs.append(lr)
        losses.append(mean)
        smoothed.append(smoother.add(mean))
        if smoother.diverged(smoothed[-1]):
            break
    return {"range_test": {"lrs": lrs, "losses": losses, "smoothed": smoothed, "steps_run": len(lrs),
                           "picked_lr": steepest_descent(lrs, smoothed)},
            "wall_seconds": time.perf_counter() - started, "world_size": dist.get_world_size()}


def relative_to_pick(config: Any, factor: float) -> Any:
    """``config`` with the controller's initial scale and bounds multiplied by ``factor`` (the range test's pick
    over ``--lr``): the variant states them relative to the pick."""
    lr = config.auto_lr
    return dataclasses.replace(config, auto_lr=dataclasses.replace(
        lr, initial_scale=lr.initial_scale * factor, scale_min=lr.scale_min * factor, scale_max=lr.scale_max * factor))


def run_steps(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any, schedule: Any,
              hdet: HDETScheduler | None, corpus: Any, device: torch.device) -> dict[str, Any]:
    """The training loop; returns the run's record so far (divergence, wall time, the controller's scales)."""
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(args.seed * 100_003 + rank)
    scales, deltas, diverged_at, started = [], [], None, time.perf_counter()
    others: dict[str, list[list[float]]] = {}  # every other explored value's scale over its given value, per sync
    step = 0
    while step < args.steps:
        # a step of the LR range test a run starts with (auto_lr.range_test) comes before the run's steps
        testing = hdet is not None and hdet.hdet.ramping
        loss = training_step(model, optimizer, corpus, args, data, device)
        step += 0 if testing else 1
        if hdet is None:
            if schedule is not None:
                schedule.step()
            if step % 50 == 0:  # plain runs stop together once the mean loss is non-finite
                finite = torch.tensor(float(math.isfinite(loss.item())))
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
                if not finite.item():
                    diverged_at = step
                    break
            continue
        try:
            report = hdet.step(loss)
        except FloatingPointError:  # every replica non-finite at a sync: all ranks raise together
            diverged_at = step
            break
        if report is not None:
            scheduled = optimizer.param_groups[0]["lr"]
            if scheduled > 0:
                scales.append([step, report.values["lr/0"]["base"] / scheduled])
            if report.controller_updated:
                deltas.append([step, report.values["lr/0"]["delta"]])
            for name, value in report.values.items():
                if not name.startswith("lr/"):
                    others.setdefault(name, []).append([step, value["scale"]])
    if hdet is not None and diverged_at is None and args.steps % hdet.hdet.config.sync_interval:
        hdet.hdet.sync()  # end on the averaged model
    world = dist.get_world_size()
    return {"diverged_at_step": diverged_at, "wall_seconds": time.perf_counter() - started, "scales": scales,
            "deltas": deltas, "other_scales": others,
            "tokens": args.steps * world * args.batch_size * args.seq_len, "world_size": world}


def main(argv: list[str] | None = None) -> None:
    """See the module docstring."""
    run_worker(parse_args, train_one, argv)


if __name__ == "__main__":
    main()
