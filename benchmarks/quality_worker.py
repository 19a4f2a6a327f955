"""One training run of the quality benchmark: a byte-level Llama on the stdlib corpus, DDP on gloo/nccl.

    torchrun --standalone --nproc_per_node 4 benchmarks/quality_worker.py --lr 3e-3 --out runs/x \
        [--hdet_config hdet.json] [--probe] [--optimizer adamw|schedulefree|prodigy]

Every rank is a replica (4 ranks = 4 replicas, the paper's layout). Without ``--hdet_config`` it is plain data
parallel (DDP over all ranks, ``OneCycleLR``); with one, HDET is attached through ``HDETOneCycleLR`` (AdamW)
with the config's alpha, T, controller, warm init and gradient mode. ``schedulefree`` (AdamWScheduleFree, no
schedule) and ``prodigy`` (Prodigy, LR 1.0 with warm-up and cosine decay) are the automatic-LR alternatives,
always plain DP.

``--batch FILE`` (a JSON list of argument lists) runs several runs one after another in one process group;
``benchmarks/quality.py`` launches its runs that way. Rank 0 writes into each run's ``--out``: ``loss.jsonl``
(the report's minimal format: ``{"step", "loss"}`` every ``--log_every`` steps, the mean over ranks and those
steps, and ``{"step", "heldout_loss"}`` at evaluations), ``result.json`` (start, final training and held-out
loss of the final model on fixed batches, divergence, wall time) and, for HDET runs, HDET's own
``hdet_metrics.jsonl`` (the config's ``metrics_path``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hdet_scale import HDETOneCycleLR, ReplicaTopology, load_config
from hdet_scale.comm import broadcast_from_rank0
from hdet_scale.engines.ddp import wrap_model
from hdet_scale.lm.corpus import batch as draw_batch
from hdet_scale.lm.corpus import load_corpus
from hdet_scale.lm.model import build_model, next_token_loss
from hdet_scale.probe import batch_probe

EVAL_SEED = 12345  # the same evaluation windows in every run, so final losses compare across rows
PROBE_SEED = 777


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset of hdet_scale.lm.model")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak LR (OneCycle max_lr; schedule-free's lr)")
    parser.add_argument("--optimizer", choices=("adamw", "schedulefree", "prodigy"), default="adamw")
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_fraction", type=float, default=0.1,
                        help="schedule-free and Prodigy: warm-up steps as a fraction of --steps")
    parser.add_argument("--hdet_config", default=None, help="HDET JSON; none: plain data parallel")
    parser.add_argument("--probe", action="store_true", help="HDET: drive the controller by a shared probe batch")
    parser.add_argument("--probe_batch", type=int, default=32, help="windows in the probe batch")
    parser.add_argument("--corpus_mb", type=float, default=4.0, help="MiB of the stdlib corpus")
    parser.add_argument("--log_every", type=int, default=10, help="steps per training-loss line")
    parser.add_argument("--eval_every", type=int, default=100,
                        help="steps between held-out evaluations (HDET: only at syncs, on the averaged model)")
    parser.add_argument("--eval_batches", type=int, default=16, help="fixed batches per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="model, data and HDET seed")
    parser.add_argument("--out", required=True, help="directory for loss.jsonl and result.json")
    return parser.parse_args(argv)


@torch.no_grad()
def fixed_loss(model: torch.nn.Module, tokens: Any, args: argparse.Namespace, device: torch.device) -> float:
    """Mean loss of ``model`` on ``--eval_batches`` fixed windows of ``tokens`` (the same in every run)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(EVAL_SEED)
    losses = []
    for _ in range(args.eval_batches):
        x, y = draw_batch(tokens, micro_batch_size=args.batch_size, seq_len=args.seq_len, generator=generator)
        losses.append(next_token_loss(model, x.to(device), y.to(device)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def _optimizer(args: argparse.Namespace, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and, for the non-HDET rows, its schedule (None: schedule-free needs none)."""
    warmup = max(1, round(args.warmup_fraction * args.steps))
    if args.optimizer == "schedulefree":
        import schedulefree

        return schedulefree.AdamWScheduleFree(params, lr=args.lr, warmup_steps=warmup,
                                              weight_decay=args.weight_decay), None
    if args.optimizer == "prodigy":
        from prodigyopt import Prodigy

        # Prodigy's authors: LR 1.0 with cosine annealing; safeguard_warmup when the LR warms up.
        optimizer = Prodigy(params, lr=1.0, weight_decay=args.weight_decay, safeguard_warmup=True)

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, args.steps - warmup))))

        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return optimizer, None


def set_heldout_probe(ensemble: Any, model: torch.nn.Module, corpus: Any, args: argparse.Namespace, rank: int) -> None:
    """Scores the replicas at every sync on ``--probe_batch`` held-out windows (rank 0's, shared by all)."""
    generator = torch.Generator().manual_seed(PROBE_SEED + rank)
    probe = draw_batch(corpus.heldout, micro_batch_size=args.probe_batch, seq_len=args.seq_len, generator=generator)
    ensemble.set_probe(batch_probe(model, probe, lambda m, b: next_token_loss(m, *b)))


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, corpus: Any, args: argparse.Namespace,
                  data: torch.Generator, device: torch.device) -> torch.Tensor:
    """One optimizer step on this rank's next ``--batch_size`` training windows; returns its loss."""
    x, y = draw_batch(corpus.train, micro_batch_size=args.batch_size, seq_len=args.seq_len, generator=data)
    loss = next_token_loss(model, x.to(device), y.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def plain_data_parallel(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` in DDP over all ranks, starting from rank 0's weights like HDET's replicas."""
    broadcast_from_rank0(model)
    return torch.nn.parallel.DistributedDataParallel(model)


_CORPORA: dict[float, Any] = {}


def stdlib_corpus(megabytes: float) -> Any:
    """The first ``megabytes`` MiB of the stdlib corpus, loaded once per process."""
    if megabytes not in _CORPORA:
        _CORPORA[megabytes] = load_corpus("stdlib", max_bytes=int(megabytes * 2**20))
    return _CORPORA[megabytes]


def train_one(args: argparse.Namespace, device: torch.device) -> None:
    """One run inside an initialized process group, on ``device``: trains, evaluates and writes the run's files
    (rank 0)."""
    config = load_config(args.hdet_config) if args.hdet_config else None
    if args.optimizer != "adamw" and config is not None:
        raise SystemExit("quality_worker: HDET runs use AdamW (HDETOneCycleLR); drop --hdet_config")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("loss.jsonl", "result.json", "hdet_metrics.jsonl"):
            (out / name).unlink(missing_ok=True)  # a fresh run, never appended to an old one
    dist.barrier()

    corpus = stdlib_corpus(args.corpus_mb)
    torch.manual_seed(args.seed)
    model = build_model(args.preset, vocab_size=corpus.vocab_size, seq_len=args.seq_len).to(device)
    start_train = fixed_loss(model, corpus.train, args, device)
    if config is not None:
        topology = ReplicaTopology.build(config)
        model = wrap_model(model, config, topology)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        scheduler = HDETOneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, hdet_config=config,
                                   model=model, topology=topology)
        if args.probe:
            set_heldout_probe(scheduler.hdet, model, corpus, args, rank)
    else:
        model = plain_data_parallel(model)
        optimizer, scheduler = _optimizer(args, model.parameters())
        if args.optimizer == "adamw":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)
    if args.optimizer == "schedulefree":
        optimizer.train()  # schedule-free keeps two weight sequences: train() puts the training one in place

    data = torch.Generator().manual_seed(args.seed * 100_003 + rank)  # every rank reads different windows
    log = (out / "loss.jsonl").open("a") if rank == 0 else None
    # [sum of this rank's losses since the last line, 1 if they are all finite]: the line is the mean over the
    # ranks whose losses are finite, since HDET leaves a non-finite replica out and trains on.
    diverged_at, loss_sum, started = None, torch.zeros((), dtype=torch.float64), time.perf_counter()

    def evaluate_heldout(step: int) -> None:
        if rank != 0:
            return
        if args.optimizer == "schedulefree":
            optimizer.eval()  # evaluate the averaged sequence, as schedule-free's authors require
        held = fixed_loss(model.module, corpus.heldout, args, device)
        if args.optimizer == "schedulefree":
            optimizer.train()
        log.write(json.dumps({"step": step, "heldout_loss": held}) + "\n")
        log.flush()

    step = 0
    for step in range(1, args.steps + 1):
        loss = training_step(model, optimizer, corpus, args, data, device)
        try:
            if config is not None:
                scheduler.step(loss)
            elif scheduler is not None:
                scheduler.step()
        except FloatingPointError:  # HDET: every replica non-finite at a sync; all ranks raise together
            diverged_at = step
            break
        loss_sum += loss.detach().double()
        if step % args.log_every == 0:
            finite = torch.isfinite(loss_sum)
            row = torch.stack([torch.where(finite, loss_sum, 0.0), finite.double()])
            dist.all_reduce(row)
            mean = row[0].item() / (row[1].item() * args.log_every) if row[1].item() else math.nan
            loss_sum.zero_()
            if rank == 0:
                log.write(json.dumps({"step": step, "loss": mean if math.isfinite(mean) else str(mean)}) + "\n")
                log.flush()
            if not math.isfinite(mean) and config is None:  # same value on every rank: all stop together
                diverged_at = step
                break
        at_sync = config is None or step % config.sync_interval == 0
        if step % args.eval_every == 0 and at_sync and step < args.steps:
            evaluate_heldout(step)
    if config is not None and diverged_at is None and args.steps % config.sync_interval:
        scheduler.hdet.sync()  # end on the averaged model
    wall = time.perf_counter() - started
    if rank == 0:
        if args.optimizer == "schedulefree":
            optimizer.eval()
        final_train = fixed_loss(model.module, corpus.train, args, device)
        final_heldout = fixed_loss(model.module, corpus.heldout, args, device)
        log.write(json.dumps({"step": step, "heldout_loss": final_heldout if math.isfinite(final_heldout)
                              else str(final_heldout)}) + "\n")
        log.close()
        result = {"start_train_loss": start_train, "final_train_loss": final_train,
                  "final_heldout_loss": final_heldout, "diverged_at_step": diverged_at,
                  "steps_run": step, "wall_seconds": wall, "world_size": world, "backend": dist.get_backend(),
                  "tokens": args.steps * world * args.batch_size * args.seq_len,
                  "args": vars(args)}
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"{out.name}: final train loss {final_train:.4f}  held-out loss {final_heldout:.4f}  ({wall:.0f} s)",
              flush=True)
    if config is not None:
        scheduler.hdet.close()
    dist.barrier()


def run_worker(parse: Callable[[list[str]], argparse.Namespace],
               train: Callable[[argparse.Namespace, torch.device], None], argv: list[str] | None = None) -> None:
    """One run from the command line, or every run of ``--batch FILE`` (a JSON list of argument lists) in one
    process group: importing transformers in 4 processes on 2 cores costs ~30 s, more than a short run."""
    batch_parser = argparse.ArgumentParser(add_help=False)
    batch_parser.add_argument("--batch", default=None)
    known, rest = batch_parser.parse_known_args(argv)
    runs = [parse(rest)] if known.batch is None else [parse(item) for item in json.loads(Path(known.batch).read_text())]
    backend, device = backend_and_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # An hour: a benchmark paused (SIGSTOP) while the machine runs something else must outlast the pause; a
    # collective times out by the clock, so a shorter timeout kills a paused launch when it resumes.
    dist.init_process_group(backend, timeout=timedelta(minutes=60))
    for args in runs:
        train(args, device)
    dist.destroy_process_group()


def backend_and_device() -> tuple[str, torch.device]:
    """The process group's backend and this rank's device: NCCL with a GPU per local rank; gloo with the local
    ranks sharing the GPUs when there are fewer GPUs than ranks (NCCL refuses two ranks on one GPU, gloo
    all-reduces CUDA tensors through the host); gloo on the CPU without a GPU."""
    if not torch.cuda.is_available():
        return "gloo", torch.device("cpu")
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    return ("nccl" if gpus >= local_world else "gloo"), torch.device("cuda", local_rank % gpus)


def main(argv: list[str] | None = None) -> None:
    """See the module docstring."""
    run_worker(parse_args, train_one, argv)


if __name__ == "__main__":
    main()
