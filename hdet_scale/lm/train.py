"""Pretrain a decoder-only language model with HDET on FSDP2 or DeepSpeed ZeRO.

    torchrun --nproc_per_node 8 -m hdet_scale.lm.train --preset 125m --data tokens.bin --vocab_size 32000
    deepspeed --hostfile hostfile --num_nodes 4 hdet_scale/lm/train.py --deepspeed_config ds_configs/zero2_bf16.json \\
        --hdet_config ds_configs/hdet_zero.json --preset 1b --data tokens.bin --vocab_size 32000 \\
        --steps 300000

The engine is FSDP2 under torchrun and DeepSpeed under the deepspeed launcher or with --deepspeed or
--deepspeed_config (--engine picks one explicitly). Data: the embedded standard-library source (default, bytes), a
text file or a directory of them (bytes), or a flat uint16/uint32 token file (memory-mapped). Every input is
checked before any process group starts.

Rank 0 shows a progress bar (on a terminal) and prints one line per sync; metrics go to
OUT/hdet_metrics.jsonl (and OUT/tensorboard when TensorBoard is installed), checkpoints to OUT/checkpoints
(at sync points), and the final averaged model to OUT/final for transformers' from_pretrained. The metrics
file has one line per sync and one {"step", "heldout_loss"} line per evaluation; `python -m hdet_scale.tools.report
OUT/hdet_metrics.jsonl --out plots` draws them.

On SIGTERM (Slurm preemption or time limit) or SIGUSR1 (the Slurm templates' time guard) the ranks agree to stop,
average the replicas (--on_signal sync_now, the default: one step later) or train on to the next regular sync
(--on_signal next_sync: the resumed run is then bit-identical to an uninterrupted one), checkpoint (nothing during
the LR range test), write OUT/stopped_early (for the Slurm templates, which requeue a job stopped by a signal they
did not send), and exit with code 0; rerun with
--resume (a requeued job can always pass it: without a checkpoint the run starts at step 0, saying so where an
earlier attempt left output, whose metrics it keeps aside). Without --checkpoint_interval the only checkpoints are
the one at the end and the one a signal asks for: a long job that can die without a signal (a lost node) needs one.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a file (deepspeed hdet_scale/lm/train.py): Python put the package folder first on the path, where its
    # modules (data, model, plan, ...) would shadow top-level modules of those names for every import.
    sys.path.pop(0)

import argparse
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from hdet_scale.comm import cpu_group, free_port, on_rank0, shut_down, shut_down_and_exit
from hdet_scale.config_checks import HDETConfigError
from hdet_scale.durable import (
    fsync_tree,
    replace_folder_durably,
    replacement_folders,
    start_replacement,
    write_text_durably,
)
from hdet_scale.extras import MissingExtra
from hdet_scale.lm import out_lock
from hdet_scale.lm.agreement import RunFailed, agreed
from hdet_scale.lm.backends import Backend, Batch, DeepSpeedBackend, FSDPBackend
from hdet_scale.lm.checkpoints import (
    FINAL_MODEL,
    STOPPED_EARLY,
    ResumePoint,
    check_free_space,
    checkpoint_dir,
    flush_metrics,
    out_state,
    remove_previous_run,
    settle_interrupted_save,
    start_without_checkpoint,
)
from hdet_scale.lm.corpus import TOKEN_FILE_DEFAULTS, batch
from hdet_scale.lm.model import PRESETS, build_model
from hdet_scale.lm.plan import DEFAULT_ZERO_STAGE, OPTIMIZATION_DEFAULTS, Plan, given_peak_lr, plan
from hdet_scale.lm.preemption import StopSignal
from hdet_scale.lm.progress import Progress
from hdet_scale.metrics import SyncReport
from hdet_scale.notices import HDETWarning
from hdet_scale.probe import batch_probe
from hdet_scale.range_test import MEAN_LR_OVER_PICK
from hdet_scale.resolve import add_hdet_args
from hdet_scale.topology import check_same_replica_size, launcher_ranks_per_node

PROBE_SEED = 777
"""Where --probe_batch draws its held-out windows (fixed: the same probe whatever the training seed)."""
BAD_INPUT_GRACE_S = 20.0
"""How long a rank other than 0 waits for its launcher to stop it after a bad input (see refuse_bad_input)."""
SINGLE_PROCESS = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                  "MASTER_ADDR": "127.0.0.1"}
"""The launcher's environment for a run started without one; its MASTER_PORT is the user's, else a free port
(``start_process_group``)."""
PORT_TRIES = 3
"""Free ports a run started without a launcher tries, where another process takes the one it picked first."""


class _OneVoiceParser(argparse.ArgumentParser):
    """argparse whose errors are said once, by global rank 0 (``refuse_bad_input``), not by every rank."""

    def error(self, message: str) -> NoReturn:
        if int(os.environ.get("RANK", "0")) == 0:
            self.print_usage(sys.stderr)
        refuse_bad_input(ValueError(message))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's text as written, and every option's default after its help."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` shows every default)."""
    parser = _OneVoiceParser(description=__doc__, formatter_class=_HelpFormatter)
    _add_model_and_data(parser.add_argument_group("model and data"))
    _add_optimization(parser.add_argument_group("optimization"))
    _add_run(parser.add_argument_group("run"))
    add_hdet_args(parser)
    # What the deepspeed launcher and DeepSpeed users pass, declared here so that an FSDP2 run never imports
    # DeepSpeed (which prints its accelerator on import, once per rank).
    launcher = parser.add_argument_group("DeepSpeed")
    launcher.add_argument("--deepspeed", action="store_true", help="the engine: deepspeed (as --engine deepspeed)")
    launcher.add_argument("--deepspeed_config", default=None, metavar="PATH", help="DeepSpeed JSON (the engine: "
                          "deepspeed)")
    launcher.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def _add_model_and_data(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)}")
    group.add_argument("--dropout", type=float, default=0.0,
                       help="the model's attention dropout (the presets have none; explore.dropout needs some)")
    group.add_argument("--data", default="stdlib", help="'stdlib' (embedded), a text file or a directory of them "
                       "(read as bytes), or a token file")
    group.add_argument("--token_dtype", default=TOKEN_FILE_DEFAULTS["token_dtype"],
                       help="token files: uint16 or uint32")
    group.add_argument("--vocab_size", type=int, default=TOKEN_FILE_DEFAULTS["vocab_size"],
                       help="token files: the tokenizer's vocabulary")
    group.add_argument("--heldout_fraction", type=float, default=TOKEN_FILE_DEFAULTS["heldout_fraction"],
                       help="token files: share held out")
    group.add_argument("--max_data_mb", type=float, default=None,
                       help="read at most this many MiB of the data (of a token file, its first that many MiB; the "
                       "held-out share is cut from them)")
    group.add_argument("--seq_len", type=int, default=128, help="tokens per sequence")
    group.add_argument("--seed", type=int, default=0, help="model and data seed")


def _add_optimization(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--engine", choices=("auto", "fsdp", "deepspeed"), default="auto",
                       help="auto: deepspeed under the deepspeed launcher or with --deepspeed or "
                       "--deepspeed_config, else fsdp")
    group.add_argument("--steps", type=int, default=300, help="optimizer steps")
    defaults = OPTIMIZATION_DEFAULTS
    group.add_argument("--micro_batch_size", type=int, default=defaults["micro_batch_size"],
                       help="sequences per rank per micro-batch (DeepSpeed: its JSON's train_micro_batch_size_per_gpu)")
    group.add_argument("--grad_accum", type=int, default=defaults["grad_accum"],
                       help="micro-batches per step (DeepSpeed: its JSON's gradient_accumulation_steps)")
    group.add_argument("--lr", type=float, default=defaults["lr"],
                       help="peak LR of the warm-up + cosine schedule: where HDET starts looking (the LR it finds is "
                       "printed at the end as a multiple of it); DeepSpeed: refused where its JSON's optimizer, or a "
                       "scheduler that sets the LR itself, gives it")
    group.add_argument("--warmup_steps", type=int, default=defaults["warmup_steps"],
                       help="linear LR warm-up steps (DeepSpeed: its JSON's scheduler where it has one)")
    group.add_argument("--min_lr_ratio", type=float, default=defaults["min_lr_ratio"],
                       help="final LR as a fraction of --lr (DeepSpeed: its JSON's scheduler where it has one)")
    group.add_argument("--replay_schedule", metavar="FILE", default=None,
                       help="a plain run (HDET's spread and controller off) on the LRs and weight decays an HDET run "
                       "applied at every step, exported by python -m hdet_scale.tools.report RUN.jsonl "
                       "--export-schedule FILE; replaces --lr's warm-up + cosine")
    group.add_argument("--weight_decay", type=float, default=defaults["weight_decay"],
                       help="AdamW's weight decay (DeepSpeed: its JSON's optimizer where it has one)")
    group.add_argument("--grad_clip", type=float, default=defaults["grad_clip"],
                       help="FSDP: max gradient norm (0: off); DeepSpeed: its JSON's gradient_clipping")
    group.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default=defaults["dtype"],
                       help="FSDP parameters in forward/backward (auto: bf16 on GPUs, fp32 on CPU); DeepSpeed: its "
                       "JSON's bf16 (the config built without one: this)")
    group.add_argument("--zero_stage", type=int, choices=(0, 1, 2, 3), default=None,
                       help=f"DeepSpeed without --deepspeed_config: the ZeRO stage of the built-in config (unset: "
                       f"{DEFAULT_ZERO_STAGE})")
    group.add_argument("--probe_batch", type=int, default=16,
                       help="held-out sequences every replica is scored on at each sync, the same for all, where "
                       "the controller moves a value (the controller's signal, with the replica's weights averaged "
                       "over auto_lr.average_window); 0: no probe, the replicas' training losses")


def _add_run(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--out", default="runs/train", help="directory for metrics, checkpoints and the model")
    group.add_argument("--checkpoint_interval", type=int, default=0,
                       help="steps between checkpoints, a multiple of sync_interval (0: only at the end and on "
                       "SIGTERM)")
    group.add_argument("--eval_interval", type=int, default=0,
                       help="steps between held-out evaluations, a multiple of sync_interval (0: only at the end)")
    group.add_argument("--eval_batches", type=int, default=8, help="batches per rank in each evaluation")
    group.add_argument("--resume", action="store_true",
                       help="continue from OUT/checkpoints when there is a checkpoint (else start at step 0, "
                       "keeping an earlier attempt's metrics as hdet_metrics.earlier_attempt_N.jsonl)")
    group.add_argument("--overwrite", action="store_true",
                       help="start afresh in an --out that holds a run, removing its checkpoints, final model, "
                       "metrics and TensorBoard events (without it, such an --out is refused unless --resume "
                       "continues it)")
    group.add_argument("--on_signal", choices=("sync_now", "next_sync"), default="sync_now",
                       help="on SIGTERM or SIGUSR1: average early and stop one step later, or train on to the next "
                       "regular sync (bit-identical resume; needs up to sync_interval steps of grace)")
    group.add_argument("--no_progress", action="store_true", help="no progress bar")
    group.add_argument("--wandb", metavar="PROJECT", default=None,
                       help="also log the sync scalars to this Weights & Biases project (pip install "
                       "'hdet_scale[wandb]'; WANDB_MODE=offline works without an account)")


# ------------------------------------------------------------------------------------------- run
def main(argv: list[str] | None = None) -> NoReturn:
    """The training script on every rank: bad input is refused before any process group starts; a complete run
    ends the process through ``shut_down_and_exit`` (status 0), a failed one raises after ``shut_down``."""
    args = parse_args(argv)
    own_world = "WORLD_SIZE" not in os.environ  # plain `python -m hdet_scale.lm.train`: a world of one
    if own_world:
        os.environ.update(SINGLE_PROCESS)
    try:
        checked = plan(args)
        device = rank_device()
    except (ValueError, FileNotFoundError, MissingExtra) as error:
        refuse_bad_input(error)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    start_process_group(checked.engine, cuda, own_world=own_world)
    try:
        train_on_every_rank(args, checked, device)
    except BaseException:
        shut_down()
        raise
    shut_down_and_exit(0)


def rank_device() -> torch.device:
    """This rank's GPU, one a rank by LOCAL_RANK; the CPU on a machine without one. A ValueError where the node has
    more ranks than GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    ranks, gpus = launcher_ranks_per_node() or 1, torch.cuda.device_count()
    if ranks > gpus:
        raise ValueError(f"{ranks} ranks on this node and {gpus} GPU(s): one rank a GPU, so start at most {gpus} "
                         f"(--nproc_per_node {gpus}), or train on the CPU (CUDA_VISIBLE_DEVICES= before the command)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def start_process_group(engine: str, cuda: bool, *, own_world: bool) -> None:
    """The launch's process group, or the world of one this process sets up itself (``own_world``: started without
    a launcher) on the user's MASTER_PORT, else on a free port: two such runs on one machine do not collide."""
    picks_port = own_world and "MASTER_PORT" not in os.environ
    for attempt in range(1, PORT_TRIES + 1):
        if picks_port:  # again where another process took the port since it was picked
            os.environ["MASTER_PORT"] = str(free_port())
        try:
            if engine == "fsdp":
                dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
            else:
                import deepspeed

                deepspeed.init_distributed(timeout=timedelta(minutes=10))
            return
        except dist.DistNetworkError as error:
            if not own_world or "EADDRINUSE" not in str(error) or attempt == PORT_TRIES:
                raise
            if not picks_port:
                refuse_bad_input(ValueError(f"MASTER_PORT={os.environ['MASTER_PORT']} is in use on this machine "
                                            "(another run?): set MASTER_PORT to a free port, or leave it unset and "
                                            "the run picks one"))


def train_on_every_rank(args: argparse.Namespace, checked: Plan, device: torch.device) -> None:
    """The run, holding ``--out`` for itself; a ``RunFailed`` on any rank exits every rank with status 1 after
    rank 0 has said why, as ranks that disagree on the replica size exit with status 2 (bad input)."""
    # Caught from the process group on: a signal while --out is taken or the model is built, wrapped and resumed
    # (minutes for a large one) stops the run at its first steps, with a checkpoint, where it was lost.
    stop = StopSignal(cpu_group())
    try:
        _train_holding_out(args, checked, device, stop)
    finally:
        stop.close()  # no signal all-reduce left in flight


def _train_holding_out(args: argparse.Namespace, checked: Plan, device: torch.device, stop: StopSignal) -> None:
    """``train_on_every_rank`` once its signals are caught (``stop``)."""
    try:  # each node's launcher counts its own ranks: only the ranks together can tell
        check_same_replica_size(checked.config.ranks_per_replica, dist.get_rank(), dist.get_world_size())
    except HDETConfigError as error:  # on every rank
        if dist.get_rank() == 0:
            print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        dist.barrier()
        raise SystemExit(2) from None
    out = Path(args.out)
    try:
        take_out(out, checked)
        try:
            Run(args, checked, device, stop).train()
        finally:
            stop.close()  # no signal all-reduce left in flight
            if dist.get_rank() == 0:
                out_lock.release(out)
        dist.barrier()  # every rank is past its last collective before any tears the groups down
    except RunFailed as failure:
        if dist.get_rank() == 0:
            print(f"train.py: error: {failure}", file=sys.stderr, flush=True)
        dist.barrier()  # no rank exits, and gets rank 0 stopped by the launcher, before rank 0 has said why
        raise SystemExit(1) from None


def take_out(out: Path, checked: Plan) -> None:
    """Takes ``out`` for this run (collective): every rank's plan found the same in it, and rank 0 holds its lock
    and finds it unchanged (``take_as_planned``); else ``RunFailed`` on every rank, the lock released. The ranks
    plan one after another: a run that ended between two of them left one rank resuming its checkpoint and another
    starting afresh."""
    def take() -> None:
        planned: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(planned, checked.out_state)
        if any(state != planned[0] for state in planned):
            raise out_lock.OutInUse(f"--out {out} changed while this run was starting (its ranks found different "
                                    "runs there: another run wrote there meanwhile); nothing was touched: start this "
                                    "run again")
        on_rank0(lambda: take_as_planned(out, checked), f"taking {out}")
        # Checkpoints are written by every rank and named by rank 0: one folder for all, not one per node's disk.
        holder = [out_lock.this_process() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, out_lock.held_by(out, holder[0]))
        if not all(seen):
            if dist.get_rank() == 0:
                out_lock.release(out)
            raise out_lock.OutInUse(f"--out {out} is not one folder for every rank: rank {seen.index(False)} does not "
                                    "see the lock rank 0 took there (a disk of each node's own?); give an --out on a "
                                    "file system every node shares")

    agreed(f"taking {out}", take)


def take_as_planned(out: Path, checked: Plan) -> None:
    """Takes ``out``'s lock, then checks that ``out`` still holds what the plan found: a run that held it until
    just now (it ended, or saved for a preemption) may have written there since, and this run would overwrite
    that or resume from a checkpoint it did not check. Rank 0 only."""
    out_lock.take(out)
    if out_state(out, checked.config.metrics_path) != checked.out_state:
        out_lock.release(out)
        raise out_lock.OutInUse(f"--out {out} changed while this run was starting (another run wrote there "
                                "meanwhile); nothing was touched: start this run again")


def tidy_out(out: Path, metrics_path: str | None, *, overwrite: bool, resume: ResumePoint | None,
             resume_asked: bool = False) -> list[str]:
    """Readies ``out`` for the run, once it holds ``out``: ``--overwrite`` removes the earlier run, except where
    the plan continues this requeued Slurm job's own checkpoint; a run that starts at step 0 without it keeps what an
    earlier attempt left (``--resume`` without a checkpoint: the plan refuses such an ``out`` otherwise), and says
    that a ``--resume`` (``resume_asked``) found nothing to continue, unless it is a Slurm job's (the templates pass
    it to every job, whose first start finds nothing); what an interrupted save left is settled, and an earlier
    run's ``stopped_early`` removed. Returns one line per change or finding. Rank 0 only."""
    if resume is not None:
        said = [f"--overwrite: this Slurm job was requeued after its checkpoint at step {resume.step}; it continues "
                "from it instead of erasing it"] if overwrite else []
    elif overwrite:
        said = [f"--overwrite: removed {path}" for path in remove_previous_run(out, metrics_path)]
    else:
        said = start_without_checkpoint(out, metrics_path)
        if resume_asked and not said and "SLURM_JOB_ID" not in os.environ:
            said = [f"--resume: no checkpoint in {out / 'checkpoints'}: this run starts at step 0"]
    (out / STOPPED_EARLY).unlink(missing_ok=True)  # the stop it said is this run's to continue or replace
    return said + settle_interrupted_save(out)


def refuse_bad_input(error: Exception) -> NoReturn:
    """Stop this rank over a bad input that every rank finds; global rank 0 says it, once.

    A launcher (torchrun, deepspeed) stops all of a node's ranks as soon as one exits with an error. A rank
    other than 0 that exited at once could have rank 0 killed before it printed (seen under load), so it
    waits for its launcher to stop it after rank 0 has exited. Still running after BAD_INPUT_GRACE_S, it
    found an error rank 0 did not (a file missing on its node only) and says it itself.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(BAD_INPUT_GRACE_S)
    where = "" if rank == 0 else f" (rank {rank})"
    print(f"train.py: error{where}: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def mean_loss_in_chunks(loss: Callable[[Batch], torch.Tensor], windows: Batch, size: int) -> torch.Tensor:
    """``loss`` (a mean over equally long windows) of the (inputs, targets) ``windows``, taken ``size`` windows at a
    time: the same mean, each chunk weighted by its windows."""
    chunks = zip(*(part.split(size) for part in windows), strict=True)
    return sum(loss(chunk) * len(chunk[0]) for chunk in chunks) / len(windows[0])


class Run:
    """One training run on an initialized process group; ``stop`` answers whether the ranks were signalled to stop."""

    def __init__(self, args: argparse.Namespace, checked: Plan, device: torch.device, stop: StopSignal) -> None:
        self.args = args
        self.plan = checked
        self.corpus = checked.corpus
        self.out = Path(args.out)
        self.rank = dist.get_rank()
        torch.manual_seed(args.seed)  # the same initial model on every rank (rank 0's is broadcast anyway)
        dropout = {"attention_dropout": args.dropout} if args.dropout else {}
        model = build_model(args.preset, vocab_size=checked.corpus.vocab_size, seq_len=args.seq_len, **dropout)
        self.parameters = sum(p.numel() for p in model.parameters())  # whole: ZeRO-3 partitions them below
        self.saved_at: int | None = None
        self.saved_path: Path | None = None  # the checkpoint of step saved_at
        args.dtype = checked.dtype
        # the header says it, after the run's own line (_train); not in a catch_warnings block, which would also
        # drop the filters the backend sets up for the whole run
        warnings.filterwarnings("ignore", message="HDET has ONE replica", category=HDETWarning)
        self.backend: Backend = (
            FSDPBackend(model, checked.config, args, device) if checked.engine == "fsdp"
            else DeepSpeedBackend(model, checked.config, args, checked.ds_config or {}, device))
        self.config = self.backend.ensemble.config
        if args.probe_batch and self.backend.ensemble.wants_probe:
            self._set_probe()
        self.step = 0
        self.stop = stop
        self.cpu_group = stop.group  # the signal's votes and the checkpoints' random streams, off the GPU
        # W&B's start can fail on rank 0 alone (not logged in, no network): every rank stops, none left waiting
        self.progress = agreed("starting the run's logs (--wandb, TensorBoard)", lambda: Progress(
            self.out, enabled=self.rank == 0, bar=not args.no_progress, total=args.steps,
            metrics_path=self.config.metrics_path, wandb_project=args.wandb, resumed=checked.resume is not None,
            sync_lines=not args.replay_schedule, config={"train": _plain(vars(args)), "hdet": self.config.to_dict()}))
        self.engine = checked.engine

    def _set_probe(self) -> None:
        """Scores every replica at each sync on --probe_batch held-out windows (rank 0's draw, shared by all), a
        micro-batch at a time: more windows at once than the training steps take could run out of memory."""
        windows = batch(self.corpus.heldout, micro_batch_size=self.args.probe_batch, seq_len=self.args.seq_len,
                        generator=torch.Generator().manual_seed(PROBE_SEED))
        self.backend.ensemble.set_probe(batch_probe(
            self.backend.module, windows,
            lambda _, probe: mean_loss_in_chunks(self.backend.loss, probe, self.backend.micro_batch_size)))

    # ------------------------------------------------------------------------------------- loop
    def train(self) -> None:
        try:
            self._train()
        finally:  # on every way out: no bar or writer thread left open
            self.progress.close()

    def _train(self) -> None:
        args, topo = self.args, self.backend.topology
        self._start_or_resume()
        self.started_at = self.step
        tokens_per_step = (topo.world_size * self.backend.micro_batches * self.backend.micro_batch_size
                           * args.seq_len)
        self.progress.line(
            f"HDET train: engine={self.engine} ranks={topo.world_size} replicas={topo.num_replicas} "
            f"ranks_per_replica={topo.ranks_per_replica} preset={args.preset} "
            f"({self.parameters / 1e6:.1f}M parameters) data={self.corpus.description} "
            f"alpha={self.config.spread_alpha(lr=True):g} T={self.config.sync_interval} "
            f"gradient_mode={self.config.gradient_mode} steps={args.steps} "
            f"tokens/step={tokens_per_step}")
        if self.backend.ensemble.single_replica_warning:
            self.progress.line(f"WARNING: {self.backend.ensemble.single_replica_warning}")
        if self.backend.ensemble.ramping and not self._range_test():
            self._say_stopped_early()
            return
        self.progress.start(self.step, tokens_per_step)
        stop_at_sync = False
        while self.step < args.steps:
            loss, report = self._train_step(self._batches(self.step))
            self.step += 1
            self.progress.step(self.step, loss, self.backend.ensemble.base("lr/0"), report)
            if args.eval_interval and self.step % args.eval_interval == 0 and self.step < args.steps:
                self.progress.heldout(self.step, self._evaluate(self.corpus.heldout))
            if args.checkpoint_interval and self.step % args.checkpoint_interval == 0 and self.step < args.steps:
                self._checkpoint()
            stop_at_sync = self.stop.poll() or stop_at_sync
            if stop_at_sync and self.step < args.steps and (args.on_signal == "sync_now"
                                                             or self.backend.ensemble.at_sync_point):
                self._preempt()
                self._say_stopped_early()
                return
        self._finish()

    def _train_step(self, batches: list[Batch]) -> tuple[torch.Tensor, SyncReport | None]:
        """One optimizer step: forward and backward on every micro-batch (the gradients reduced on the last, and
        averaged over every replica in HDET's global mode), the optimizer's and the LR schedule's step, then HDET's
        step, which averages the replicas every sync_interval steps and returns that sync's report."""
        losses = [self.backend.forward_backward(micro_batch, index=index, of=len(batches))
                  for index, micro_batch in enumerate(batches)]
        return torch.stack(losses).mean(), self.backend.optimizer_step(losses)

    def _range_test(self) -> bool:
        """Runs the LR range test the run starts with (``auto_lr.range_test``), on the run's first batches, before
        its --steps; False when stopped during it (nothing to save: a rerun starts afresh)."""
        ensemble, test_step = self.backend.ensemble, 0
        self.progress.line(f"LR range test: up to {self.config.auto_lr.range_test} steps, the LR growing from 1e-06 "
                           "to 1 on every replica")
        while ensemble.ramping:
            self._train_step(self._batches(test_step))
            test_step += 1
            if self.stop.poll():
                self.progress.line(f"stopped during the LR range test at its step {test_step}: nothing to save; "
                                   "a rerun starts afresh")
                return False
        pick, (peak, source) = ensemble.range_test_pick, given_peak_lr(self.args, self.plan.ds_config)
        if pick is None:
            self.progress.line(f"LR range test: no LR picked in {test_step} steps; the run goes on at {source}")
        else:
            self.progress.line(f"LR range test: picked {pick:.3g} ({pick / peak:.3g} x {source}) in {test_step} "
                               f"steps; every replica starts again from its first weights at {MEAN_LR_OVER_PICK:g} "
                               "times that LR")
        return True

    def _start_or_resume(self) -> None:
        def tidy() -> list[str]:
            return tidy_out(self.out, self.config.metrics_path, overwrite=self.args.overwrite, resume=self.plan.resume,
                            resume_asked=self.args.resume)

        for line in agreed(f"tidying {self.out}", lambda: on_rank0(tidy, f"tidying {self.out}")) or []:
            self.progress.line(line)
        point = self.plan.resume
        if point is not None:
            # where a promoted checkpoint now is, as rank 0 (which promoted it) finds it: a network file system's
            # cache may still show other nodes the folder before the rename
            path = agreed(f"resuming from {self.out}", lambda: on_rank0(lambda: checkpoint_dir(self.out),
                                                                          f"finding the checkpoint in {self.out}",
                                                                          share_result=True))
            if point.layout_changed:
                self.progress.line(point.layout_line())
            if point.changed:
                self.progress.line(point.changed_line())
            extra = agreed(f"resuming from {path}", lambda: self.backend.load(path))
            saved_streams = extra.get("rng_states")  # checkpoints of earlier versions have none
            if saved_streams is not None and len(saved_streams) == dist.get_world_size():
                _restore_rng(saved_streams[self.rank])  # another world size cannot go on bit-identically anyway
            self.step = self.saved_at = self.backend.ensemble.global_step
            self.saved_path = path
            if extra.get("heldout_recorded"):  # a run's end: its held-out loss is evaluated again, not recorded twice
                self.progress.resume_heldout(self.step)
            self.progress.line(f"resumed from {path} at step {self.step}")  # every rank has loaded
            if self.step == self.args.steps:  # a run requeued after its last checkpoint, its model perhaps unwritten
                self.progress.line(f"the checkpoint at step {self.step} ends this run (--steps {self.args.steps}): "
                                   "nothing to train; its model is written again (a larger --steps trains on)")
            agreed(f"rewriting {self.config.metrics_path}",
                   lambda: self.progress.truncate_metrics(self.config.metrics_path, self.step))
        dist.barrier()

    def _batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of ``step``: a function of (seed, step, rank) only, so a resumed run reads
        exactly what the uninterrupted run would have."""
        generator = torch.Generator().manual_seed(_mix(self.args.seed, step, self.rank))
        return [batch(self.corpus.train, micro_batch_size=self.backend.micro_batch_size, seq_len=self.args.seq_len,
                      generator=generator) for _ in range(self.backend.micro_batches)]

    def _evaluate(self, tokens: Any) -> float:
        """Mean loss over ``eval_batches`` fixed batches per rank, averaged over all ranks (at a sync point,
        where the replicas are one model), at the explored values that model is exported with
        (``HDETEnsemble.one_model_values``)."""
        generator = torch.Generator().manual_seed(_mix(self.args.seed, -1, self.rank))
        self.backend.train(False)
        total = torch.zeros((), dtype=torch.float64, device=self.backend.device)
        with self.backend.ensemble.one_model_values():
            for _ in range(self.args.eval_batches):
                total += self.backend.loss(batch(tokens, micro_batch_size=self.backend.micro_batch_size,
                                                 seq_len=self.args.seq_len, generator=generator)).double()
        self.backend.train(True)
        dist.all_reduce(total)
        return float(total) / (self.args.eval_batches * dist.get_world_size())

    def _checkpoint(self) -> Path:
        """Saves once per step (a preemption may land on a checkpoint step); a failure on any rank stops all."""
        directory = self.out / "checkpoints"
        if self.saved_at != self.step:
            def before_saving() -> None:
                check_free_space(self.out)
                if self.rank == 0:
                    flush_metrics(self.config.metrics_path)

            agreed(f"saving a checkpoint in {directory}", before_saving)
            # every rank's random stream (--dropout draws from it), so that a resumed run draws what an
            # uninterrupted one would; the extra state is the same on every rank, so it holds all of them
            rng_states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(rng_states, _rng_state(), group=self.cpu_group)
            extra = {"step": self.step, "seed": self.args.seed, "rng_states": rng_states,
                     "heldout_recorded": self.progress.heldout_recorded(self.step)}
            self.saved_path = agreed(f"saving a checkpoint in {directory}",
                                     lambda: self.backend.save(directory, extra, self.plan.run))
            self.saved_at = self.step
            self.progress.line(f"checkpoint: {self.saved_path}")
        return self.saved_path

    def _end_on_one_model(self) -> None:
        if not self.backend.ensemble.at_sync_point:
            self.progress.sync(self.backend.sync())

    def _preempt(self) -> None:
        self._end_on_one_model()
        self.stop.stop_polling()
        path = self._checkpoint()
        self.progress.line(f"preempted at step {self.step}; checkpoint: {path}; rerun with --resume")
        self.progress.close()

    def _say_stopped_early(self) -> None:
        """Writes ``OUT/stopped_early`` (the step, the run's --steps and the step this start began at): the ranks exit
        0 after a stop as after the end, and a Slurm template that did not ask for the stop (sbatch's
        ``--signal=USR1@<s>`` signals the ranks alone) reads it and requeues the job, which would otherwise end
        COMPLETED and start what waits for its success (``afterok``), or fails it where the start made no progress
        (requeued, it would stop there again)."""
        path = self.out / STOPPED_EARLY
        agreed(f"writing {path}", lambda: on_rank0(
            lambda: write_text_durably(path, f"step {self.step} of {self.args.steps}, from step {self.started_at}\n"),
            f"writing {path}"))

    def _finish(self) -> None:
        self._end_on_one_model()
        self.stop.stop_polling()  # a signal from here on waits for the last checkpoint and the model
        train_loss = self._evaluate(self.corpus.train)
        heldout_loss = self._evaluate(self.corpus.heldout)
        self.progress.heldout(self.step, heldout_loss, announce=False)  # in the final line below
        self._checkpoint()
        final = self.out / FINAL_MODEL
        self._export(final)
        self.progress.close()
        self.progress.line(f"final train loss {train_loss:.4f}  held-out loss {heldout_loss:.4f}  "
                           f"({self.progress.elapsed():.0f} s)")
        self.progress.line(f"metrics: {self.config.metrics_path or 'disabled'}")
        self.progress.line(f"model: {final} (transformers from_pretrained)")
        found = self.backend.ensemble.found_lr_factor()
        if found is not None:
            peak, source = given_peak_lr(self.args, self.plan.ds_config)
            self.progress.line(f"found LR {found * peak:.2e} ({found:.3g} x {source})")

    def _export(self, path: Path) -> None:
        """The final model, written beside ``path`` and put in its place once complete (a kill meanwhile leaves a
        model written before intact), without transformers' progress bar, which would cut into this run's output."""
        from transformers.utils import logging as transformers_logging

        staging = replacement_folders(path)[0]
        action = f"writing the model to {path}"  # each part agreed: a failure on one rank stops all in one line
        agreed(action, lambda: on_rank0(lambda: start_replacement(path), f"clearing {staging}"))
        shown = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            agreed(action, lambda: self.backend.export(staging))
        finally:
            if shown:
                transformers_logging.enable_progress_bar()

        def put_in_place() -> None:
            fsync_tree(staging)
            replace_folder_durably(staging, path)

        agreed(action, lambda: on_rank0(put_in_place, action))


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with what is not a JSON scalar (paths, dtypes) as text, for a run's recorded config."""
    return {key: value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
            for key, value in values.items()}


def _rng_state() -> dict[str, torch.Tensor | None]:
    """This rank's global random streams: the CPU's, and the GPU's where there is one."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _restore_rng(state: dict[str, torch.Tensor | None]) -> None:
    """Sets this rank's global random streams to ``_rng_state()``'s."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _mix(seed: int, step: int, rank: int) -> int:
    """A generator seed unique to (seed, step, rank) for seeds up to about 9e7, and a generator's seed (below 2**63)
    for any."""
    return ((seed * 1_000_003 + step) * 100_003 + rank + 2**40) % 2**63


if __name__ == "__main__":
    main()
