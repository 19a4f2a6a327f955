"""HDET on plain DDP: a tiny byte-level Llama trained on the standard library's source.

    torchrun --standalone --nproc_per_node 4 -m hdet_scale.lm.demo_ddp [--hdet_config hdet.json]

Every rank is a replica (4 replicas on 4 ranks) unless the HDET config groups ranks. The schedule is
the paper's drop-in ``HDETOneCycleLR``. Rank 0 prints the loss as it goes, then the final training loss
of the averaged model, its held-out loss, and where the metrics went. Runs on CPU (gloo) or GPUs (nccl).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hdet_scale import HDETOneCycleLR, ReplicaTopology, add_hdet_args, load_config
from hdet_scale.engines.ddp import wrap_model
from hdet_scale.extras import require
from hdet_scale.lm.corpus import load_corpus
from hdet_scale.lm.data import random_windows
from hdet_scale.lm.model import next_token_loss

DEMO_DEFAULTS = {"sync_interval": 25}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--max_lr", type=float, default=3e-3, help="OneCycleLR peak LR")
    parser.add_argument("--corpus_mb", type=float, default=4.0, help="MiB of the stdlib corpus to use")
    parser.add_argument("--out", type=str, default="runs/demo_ddp", help="directory for metrics")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed")
    add_hdet_args(parser)
    return parser.parse_args()


def build_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return LlamaForCausalLM(config)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    generator = torch.Generator().manual_seed(12345)  # same batches on every rank and every run
    losses = []
    for _ in range(32):
        x, y = random_windows(tokens, batch_size=args.batch_size, seq_len=args.seq_len, generator=generator)
        losses.append(next_token_loss(model, x.to(device), y.to(device)).item())
    return sum(losses) / len(losses)


def main() -> None:
    args = parse_args()
    require("transformers", "train", "hdet_scale.lm.demo_ddp (its Llama model)")
    # Validate the HDET settings (and the replica layout against WORLD_SIZE) before any process group.
    config = load_config(args.hdet_config or _demo_config(args.out))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    topology = ReplicaTopology.build(config)
    if rank == 0 and config.metrics_path:
        Path(config.metrics_path).unlink(missing_ok=True)  # a fresh run, not appended to the last one

    corpus = load_corpus("stdlib", max_bytes=int(args.corpus_mb * 2**20))  # every 20th file held out
    train_tokens, heldout_tokens = corpus.train, corpus.heldout
    model = wrap_model(build_model(args.seed).to(device), config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.max_lr, weight_decay=0.01)
    scheduler = HDETOneCycleLR(optimizer, max_lr=args.max_lr, total_steps=args.steps, hdet_config=config,
                               model=model, topology=topology)
    data = torch.Generator().manual_seed(args.seed * 100_003 + rank)  # every rank reads different data
    if rank == 0:
        print(f"HDET demo: {topology.world_size} ranks, {topology.num_replicas} replicas, "
              f"alpha={config.spread_alpha(lr=True):g}, "
              f"T={config.sync_interval}, gradient_mode={config.gradient_mode}, backend={backend}", flush=True)
    started, interval = time.perf_counter(), []
    calls = 0
    while scheduler.global_step < args.steps:  # the LR range test's steps come first, outside the run's
        calls += 1
        x, y = random_windows(train_tokens, batch_size=args.batch_size, seq_len=args.seq_len, generator=data)
        loss = next_token_loss(model, x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        report = scheduler.step(loss)
        interval.append(loss.detach())
        if report is not None and rank == 0:
            lr = report.values["lr/0"]  # the effective base (the schedule times the controller's scale)
            print(f"step {scheduler.global_step:5d}  loss {torch.stack(interval).mean().item():.4f}  "
                  f"base lr {lr['base']:.2e}  scale {lr['scale']:.3f}  "
                  f"{(time.perf_counter() - started) / calls * 1000:.0f} ms/step", flush=True)
            interval = []
    if args.steps % config.sync_interval:
        scheduler.hdet.sync()  # end on an averaged model
    final_train = mean_loss(model.module, train_tokens, args, device)
    final_heldout = mean_loss(model.module, heldout_tokens, args, device)
    if rank == 0:
        print(f"final train loss {final_train:.4f}  held-out loss {final_heldout:.4f}  "
              f"({time.perf_counter() - started:.0f} s)")
        print(f"metrics: {config.metrics_path or 'disabled'}")
    dist.destroy_process_group()


def _demo_config(out: str) -> dict:
    return {**DEMO_DEFAULTS, "metrics_path": str(Path(out) / "hdet_metrics.jsonl")}


if __name__ == "__main__":
    main()
