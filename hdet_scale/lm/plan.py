"""What ``hdet_scale.lm.train`` checks and loads before any process group starts (``plan``): every argument, the
DeepSpeed JSON, the HDET settings resolved for the run, the output folder, the corpus and the checkpoint a resume
continues from. A bad input is one ``ValueError`` or ``FileNotFoundError`` naming the argument."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hdet_scale.config import HDETConfig
from hdet_scale.config_rules import PROBE_ONLY_KNOBS
from hdet_scale.controller import sync_interval_for_run
from hdet_scale.durable import replacement_folders
from hdet_scale.engines.deepspeed_settings import check_ds_config, zero_section
from hdet_scale.extras import require
from hdet_scale.lm.checkpoints import (
    FINAL_MODEL,
    ResumeError,
    ResumePoint,
    check_resume,
    identity,
    out_state,
    written_before_this_requeue,
)
from hdet_scale.lm.corpus import (
    BYTE_VOCAB,
    TOKEN_FILE_DEFAULTS,
    Corpus,
    held_out_but_trained,
    load_corpus,
    reads_bytes,
    trained_so_far,
)
from hdet_scale.lm.model import PRESETS, check_preset
from hdet_scale.metrics import writable_directory
from hdet_scale.resolve import load_config, resolve, stuck_start_error

DEFAULT_ZERO_STAGE = 2
"""The ZeRO stage of the DeepSpeed config train.py builds when it is given none (``--zero_stage``)."""
OPTIMIZATION_DEFAULTS: dict[str, Any] = {"micro_batch_size": 8, "grad_accum": 1, "lr": 3e-3, "warmup_steps": 30,
                                         "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "dtype": "auto"}
"""The defaults of train.py's flags whose settings a DeepSpeed JSON of the user's may make instead
(``_refuse_flags_json_sets``)."""


@dataclass
class Plan:
    """Everything checked and loaded before the process group starts."""

    engine: str
    config: HDETConfig
    corpus: Corpus
    ds_config: dict[str, Any] | None
    world_size: int
    dtype: str
    run: dict[str, Any]
    """What a checkpoint of this run records and a resumed run must share (``lm.checkpoints.identity``), and how far
    it trained on each data file (``trained_to``: a resume may not hold out what it trained on)."""
    resume: ResumePoint | None
    """The checkpoint to continue from (``--resume`` and there is one, or this requeued Slurm job's own)."""
    out_state: tuple[tuple[str, ...], int | None]
    """What ``--out`` held when this plan was made (``checkpoints.out_state``): the run checks it again once it
    holds ``--out``, in case another run wrote there meanwhile."""


def plan(args: argparse.Namespace) -> Plan:
    """Checks every input and loads the corpus; raises ValueError / FileNotFoundError naming the argument."""
    _check_numbers(args)
    engine = args.engine
    if engine == "auto":
        engine = "deepspeed" if args.deepspeed or args.deepspeed_config or args.local_rank >= 0 else "fsdp"
    require("transformers", "train", "hdet_scale.lm.train (its Llama model)")
    if engine == "deepspeed":
        require("deepspeed", "deepspeed", "hdet_scale.lm.train on DeepSpeed")
    ds_config = _deepspeed_config(args) if engine == "deepspeed" else None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if ds_config is not None:
        _refuse_trainer_auto(args, ds_config)
        check_ds_config(ds_config, world_size)
        if args.deepspeed_config:
            _refuse_flags_json_sets(args, ds_config)
    if engine == "fsdp":
        given = [name for name in ("deepspeed", "deepspeed_config", "zero_stage") if getattr(args, name)
                 not in (None, False)]
        if given:
            raise ValueError(f"--{given[0]} is DeepSpeed's and the engine is FSDP2 (--engine {args.engine}): pass "
                             "--engine deepspeed (or launch with deepspeed), or drop it")
    if args.zero_stage is not None and args.deepspeed_config:
        raise ValueError("--zero_stage and --deepspeed_config both set the ZeRO stage: set it in the JSON's "
                         "zero_optimization.stage, and drop --zero_stage")
    if args.replay_schedule:
        _check_replay(args, ds_config)
    _check_warmup(args, ds_config)
    values, picked_interval = _hdet_values(args, ds_config)
    config = resolve(load_config(values, world_size=None), world_size=world_size,
                     auto="rank" if engine == "deepspeed" and _zero_stage(ds_config) == 0 else "node",
                     total_steps=args.steps)
    replicas = world_size // config.ranks_per_replica
    stuck = stuck_start_error(config, replicas)
    if stuck is not None:
        raise stuck
    if args.wandb:
        require("wandb", "wandb", "--wandb")
    if config.explore.dropout is not None and args.dropout == 0:
        raise ValueError("explore.dropout explores the model's dropout, and it has none: pass --dropout P with "
                         "0 < P < 1 (the presets have no dropout), or remove explore.dropout")
    scored_on_probe = config.explore.given(PROBE_ONLY_KNOBS)
    if scored_on_probe and args.probe_batch == 0 and config.auto_lr.enabled and replicas > 1:
        raise ValueError(f"explore.{scored_on_probe[0]} is compared on the probe batch alone, and --probe_batch is 0: "
                         "give it held-out sequences (16 by default), or turn the controller off (auto_lr.enabled "
                         "false: a spread without a search)")
    json_optimizer = "optimizer" in (ds_config or {})
    no_decay = built_weight_decay(ds_config) == 0 if json_optimizer else args.weight_decay == 0
    if config.explore.weight_decay is not None and no_decay:
        where = "the DeepSpeed JSON's optimizer.params.weight_decay" if json_optimizer else "--weight_decay"
        raise ValueError(f"explore.weight_decay explores the weight decay, and {where} is 0: give it one above 0, "
                         "or remove explore.weight_decay")
    if config.auto_lr.enabled and config.auto_lr.mode == "paper":
        raise ValueError("auto_lr.mode 'paper' decays the LR to OneCycleLR's floor (HDETOneCycleLR, in a script of "
                         "your own), and train.py's schedule is a warm-up and a cosine: use mode 'log' (the "
                         "default) or 'scale'")
    if ds_config is not None:
        _check_schedule_length(args, ds_config)
    out, found = _check_out(args, config.metrics_path)
    picked = f" (picked for --steps {args.steps}: the HDET settings leave it out)" if picked_interval else ""
    for name in ("checkpoint_interval", "eval_interval"):
        if getattr(args, name) % config.sync_interval:
            raise ValueError(f"--{name}={getattr(args, name)} must be a multiple of sync_interval="
                             f"{config.sync_interval}{picked}: the replicas are one model only right after a sync")
    micro_batch = (ds_config or {}).get("train_micro_batch_size_per_gpu", args.micro_batch_size)

    def read_corpus() -> Corpus:
        corpus = load_corpus(args.data, token_dtype=args.token_dtype, vocab_size=args.vocab_size,
                             heldout_fraction=args.heldout_fraction,
                             max_bytes=None if args.max_data_mb is None else int(args.max_data_mb * 2**20))
        corpus.check_fits(seq_len=args.seq_len, micro_batch_size=int(micro_batch))
        return corpus

    # Text is read whole into memory: only once the checkpoint to resume is known to fit (its vocabulary is the
    # bytes'). A token file is memory-mapped, and opening it tells the vocabulary.
    text = reads_bytes(args.data)
    token_file_flags = [f"--{name}" for name, default in TOKEN_FILE_DEFAULTS.items() if getattr(args, name) != default]
    if text and token_file_flags:
        raise ValueError(f"{', '.join(token_file_flags)} set the reading of a token file, and --data {args.data} is "
                         f"text, read as bytes (a vocabulary of {BYTE_VOCAB}): drop them, or give a token file")
    corpus = None if text else read_corpus()
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    zero_stage = _zero_stage(ds_config) if engine == "deepspeed" else None
    vocab_size = BYTE_VOCAB if corpus is None else corpus.vocab_size
    run = identity(engine=engine, zero_stage=zero_stage,
                   model={"preset": args.preset, **PRESETS[args.preset], "vocab_size": vocab_size},
                   replicas=replicas, ranks_per_replica=config.ranks_per_replica,
                   explored=[name for name, knob in vars(config.explore).items() if knob is not None],
                   optimizer={"peak_lr": given_peak_lr(args, ds_config)[0],
                              "weight_decay": given_weight_decay(args, ds_config)},
                   settings=resumable_settings(args, config, ds_config, dtype))
    # A requeued job passes its command line again: an --overwrite meant for the run before it must not erase the
    # job's own progress, as it would on every requeue.
    resume = check_resume(out, run) if args.resume or args.overwrite and written_before_this_requeue(out) else None
    if resume is not None and resume.step > args.steps:
        raise ValueError(f"--steps {args.steps} is below the step of the checkpoint to resume, {resume.step} "
                         f"({resume.path}): pass --steps {resume.step} or more (the run's own length, or longer to "
                         "train on), or choose another --out")
    final = [path for path in map(Path, found[0])
             if path in (out / FINAL_MODEL, *replacement_folders(out / FINAL_MODEL))]  # or its export, cut short
    if args.resume and resume is None and final:
        raise ValueError(f"--resume: {out} holds a finished run's model ({final[0]}) and no checkpoint to "
                         "continue from: pass --overwrite instead of --resume to start afresh over it (RESUME=0 "
                         "with the Slurm templates), or choose another --out")
    corpus = corpus or read_corpus()
    trained_before = resume.trained_to if resume is not None else {}
    trained = held_out_but_trained(corpus.held_from, trained_before)
    if trained:
        raise ResumeError(f"--resume: --data {args.data}: {trained}, so the held-out loss would be measured on "
                          "training data; resume with the data as the run had it (the same files, --max_data_mb and "
                          "--heldout_fraction: a larger --max_data_mb, a smaller --heldout_fraction or files added "
                          "after the others in name order are fine; other data under the same name: rename it), "
                          "or start a new run in another --out")
    run = {**run, "trained_to": trained_so_far(trained_before, corpus.trained_to)}
    return Plan(engine, config, corpus, ds_config, world_size, dtype, run, resume, found)


def _check_numbers(args: argparse.Namespace) -> None:
    """The preset, and every number of the command line in its range."""
    check_preset(args.preset)
    for name in ("steps", "seq_len", "micro_batch_size", "grad_accum", "eval_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("checkpoint_interval", "eval_interval", "warmup_steps", "probe_batch"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        raise ValueError(f"--min_lr_ratio must be in [0, 1], got {args.min_lr_ratio}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    for name in ("weight_decay", "grad_clip"):
        if not (getattr(args, name) >= 0 and math.isfinite(getattr(args, name))):
            raise ValueError(f"--{name} must be a number >= 0, got {getattr(args, name)}")
    if args.max_data_mb is not None and not (args.max_data_mb > 0 and math.isfinite(args.max_data_mb)):
        raise ValueError(f"--max_data_mb must be a positive number of MiB, got {args.max_data_mb} (leave it out to "
                         "read all the data)")


def _check_warmup(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> None:
    """train.py's warm-up ends before the run does; a replayed schedule or the DeepSpeed JSON's "scheduler" replaces
    it (and --warmup_steps with it)."""
    if args.replay_schedule or "scheduler" in (ds_config or {}):
        return
    if args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup_steps {args.warmup_steps} is not below --steps {args.steps}: the LR would still "
                         f"be warming up when the run ends, and never decay; pass a --warmup_steps below {args.steps} "
                         "(a tenth of the run is usual), or more --steps")


def _check_out(args: argparse.Namespace, metrics_path: str | None) -> tuple[Path, tuple[tuple[str, ...], int | None]]:
    """``--out`` (and the metrics file's folder) can be written, and hold no run this one would overwrite
    unless ``--resume`` continues it or ``--overwrite`` asks for that. Returns it and what it holds
    (``checkpoints.out_state``), read before every decision the plan makes on it: the run checks it again once it
    holds ``--out``."""
    out = writable_directory(args.out, "--out")
    if metrics_path:
        if not Path(metrics_path).resolve().is_relative_to(out.resolve()):
            raise ValueError(f"metrics_path {metrics_path} is outside --out {out}: one run at a time holds --out, and "
                             "two runs given these HDET settings would write into one metrics file; leave metrics_path "
                             f"out (the metrics go to {out / 'hdet_metrics.jsonl'}), or put it under --out")
        writable_directory(Path(metrics_path).parent, "metrics_path's folder")
    if args.resume and args.overwrite:
        # under Slurm the --resume is likely the templates' own (RESUME=1), not one the user typed
        templates = (" (the Slurm templates in launch/ pass --resume themselves: submit with RESUME=0 to overwrite)"
                     if os.environ.get("SLURM_JOB_ID") else "")
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them"
                         + templates)
    found = out_state(out, metrics_path)
    left = found[0]
    if left and not args.resume and not args.overwrite:
        raise ValueError(f"--out {out} holds a run already ({', '.join(left)}): pass --resume to continue "
                         "it, --overwrite to start afresh over it, or choose another --out")
    return out, found


def _deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.deepspeed_config is None:
        bf16 = args.dtype == "bf16" or args.dtype == "auto" and torch.cuda.is_available()
        return {"train_micro_batch_size_per_gpu": args.micro_batch_size,
                "gradient_accumulation_steps": args.grad_accum, "gradient_clipping": args.grad_clip,
                "zero_optimization": {"stage": DEFAULT_ZERO_STAGE if args.zero_stage is None else args.zero_stage},
                "bf16": {"enabled": bf16},
                "steps_per_print": 10**9}
    ds_config = _read_json(args.deepspeed_config, "--deepspeed_config")
    if not isinstance(ds_config, dict):
        raise ValueError(f"--deepspeed_config {args.deepspeed_config} must hold a JSON object "
                         f"({{\"zero_optimization\": ...}}), got a {type(ds_config).__name__}")
    return ds_config


def _refuse_flags_json_sets(args: argparse.Namespace, ds_config: dict[str, Any]) -> None:
    """Flags given away from their defaults (``OPTIMIZATION_DEFAULTS``) whose setting the user's DeepSpeed JSON makes
    instead are refused, naming where the JSON sets it: DeepSpeed would take the JSON's silently."""
    where = {"micro_batch_size": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps",
             "grad_clip": "gradient_clipping", "dtype": "bf16"}
    if "optimizer" in ds_config:
        where.update(lr="optimizer.params.lr", weight_decay="optimizer.params.weight_decay")
    if "scheduler" in ds_config:
        where.update(warmup_steps="scheduler", min_lr_ratio="scheduler")
        if scheduler_lr(ds_config) is not None:
            where["lr"] = f"scheduler.params.{SCHEDULER_LR_KEYS[ds_config['scheduler']['type']][0]}"
    given = [name for name, default in OPTIMIZATION_DEFAULTS.items()
             if name in where and getattr(args, name) != default]
    if given:
        flags = ", ".join(f"--{name} (its {where[name]})" for name in given)
        raise ValueError(f"with --deepspeed_config {args.deepspeed_config} DeepSpeed takes {flags} from the JSON "
                         "(or from its own defaults where the JSON leaves the key out), not from the command line: "
                         "set it there and drop the flag")


def _refuse_trainer_auto(args: argparse.Namespace, ds_config: dict[str, Any]) -> None:
    """A DeepSpeed JSON written for transformers' Trainer (``"auto"`` values, which the Trainer fills in) is refused
    in one line naming them: train.py passes the JSON to DeepSpeed as it is. Its "hdet" section is HDET's, where
    ``"auto"`` is a value of its own."""
    deepspeed_own = {key: value for key, value in ds_config.items() if key != "hdet"}
    found = [name for name, value in _dotted("", deepspeed_own).items() if value == "auto"]
    if found:
        raise ValueError(f"--deepspeed_config {args.deepspeed_config}: {', '.join(found)} "
                         f"{'is' if len(found) == 1 else 'are'} \"auto\", which transformers' Trainer fills in; "
                         "train.py gives DeepSpeed the JSON as it is: write numbers there (ds_configs/zero2_bf16.json "
                         "is one for train.py)")


def _read_json(path_text: str, argument: str) -> Any:
    """The JSON file named by ``argument``; errors name the argument."""
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"{argument} {path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{argument} {path} is not valid JSON: {error}") from error


def _zero_stage(ds_config: dict[str, Any] | None) -> int:
    return int(zero_section(ds_config or {}).get("stage", 0))


def _check_schedule_length(args: argparse.Namespace, ds_config: dict[str, Any]) -> None:
    """The DeepSpeed JSON's scheduler ends when the run does: it sets the LR (and the controller's window)."""
    total = ((ds_config.get("scheduler") or {}).get("params") or {}).get("total_num_steps")
    if total is not None and total != args.steps:
        raise ValueError(f"--steps is {args.steps} and the DeepSpeed JSON's scheduler.params.total_num_steps is "
                         f"{total}: the LR schedule must end when the run does; pass --steps {total}, or set "
                         f"total_num_steps (and warmup_num_steps) for a run of {args.steps} steps")


def _check_replay(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> None:
    """A schedule to replay is as long as the run, holds only what a plain run can replay, and is the only
    schedule."""
    from hdet_scale.replay import optimizer_entry, read_schedule

    try:
        schedule = read_schedule(args.replay_schedule)
    except ValueError as error:
        raise ValueError(f"--replay_schedule {error}") from None
    if schedule["steps"] != args.steps:
        raise ValueError(f"--replay_schedule {args.replay_schedule} covers {schedule['steps']} steps and --steps is "
                         f"{args.steps}: pass --steps {schedule['steps']} (a replay trains the whole run it came "
                         "from)")
    others = [name for name in schedule["values"] if optimizer_entry(name) is None]
    if others:
        raise ValueError(f"--replay_schedule {args.replay_schedule} also explored {others}: train.py replays LRs "
                         "and weight decays only; remove those entries from the file's \"values\" and give the "
                         "values you want by hand (e.g. --dropout)")
    if "scheduler" in (ds_config or {}):
        raise ValueError("--replay_schedule and the DeepSpeed JSON's \"scheduler\" both set the LR: remove one")
    replaced = ["lr", "warmup_steps", "min_lr_ratio"]
    if any(optimizer_entry(name)[0] == "weight_decay" for name in schedule["values"]):
        replaced.append("weight_decay")
    given = [f"--{name}" for name in replaced if getattr(args, name) != OPTIMIZATION_DEFAULTS[name]]
    if given:
        raise ValueError(f"--replay_schedule {args.replay_schedule} sets every step's "
                         f"{'LR and weight decay' if 'weight_decay' in replaced else 'LR'} itself: drop "
                         f"{', '.join(given)}, which the replay would ignore")


def _hdet_values(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """The HDET settings (from --hdet_config, the DeepSpeed JSON's "hdet" section, or train.py's defaults)
    with the metrics going to OUT unless they say otherwise, and whether their sync interval is the one picked for
    --steps (they left it out). A replay turns HDET's spread, range test and controller off."""
    section = (ds_config or {}).pop("hdet", None)
    if section is not None and args.hdet_config:
        raise ValueError("HDET settings given twice: --hdet_config and the DeepSpeed JSON's \"hdet\" section; "
                         "keep one")
    if args.replay_schedule:
        if args.hdet_config or section is not None:
            raise ValueError("--replay_schedule trains without HDET: drop --hdet_config (or the DeepSpeed JSON's "
                             "\"hdet\" section)")
        # One replica over every rank: plain FSDP2 / ZeRO. Its syncs only write the metrics lines (the training
        # loss, the applied LRs): as often as an HDET run of this length would, and at every checkpoint and
        # evaluation step.
        every = math.gcd(sync_interval_for_run(args.steps), args.checkpoint_interval, args.eval_interval)
        return {"metrics_path": str(Path(args.out) / "hdet_metrics.jsonl"), "alpha": 0.0, "sync_interval": every,
                "ranks_per_replica": int(os.environ.get("WORLD_SIZE", 1)),
                "auto_lr": {"enabled": False, "range_test": 0}}, False
    values = _read_json(args.hdet_config, "--hdet_config") if args.hdet_config else section or {}
    if not isinstance(values, dict):
        raise ValueError(f"the HDET settings must be a JSON object, got {type(values).__name__}")
    # settings without a sync interval: one that gives the controller the updates it was measured with, whatever
    # the run's length (the library's T = 1000 suits long runs only)
    return ({"metrics_path": str(Path(args.out) / "hdet_metrics.jsonl"),
             "sync_interval": sync_interval_for_run(args.steps), **values}, "sync_interval" not in values)


RESUMABLE_ARGUMENTS = ("steps", "warmup_steps", "min_lr_ratio", "seed", "data", "token_dtype", "max_data_mb",
                       "heldout_fraction", "seq_len", "micro_batch_size", "grad_accum", "grad_clip", "dropout",
                       "probe_batch", "replay_schedule")
"""The command-line settings a resumed run may change (each applies from the resumed step on)."""
DEEPSPEED_ONLY_IN_JSON = ("micro_batch_size", "grad_accum", "grad_clip", "dtype")
"""Settings DeepSpeed takes from its JSON alone (train.py writes them into the JSON it builds without one): the
JSON's keys are recorded instead."""
DEEPSPEED_SCHEDULE = ("warmup_steps", "min_lr_ratio")
"""Arguments a DeepSpeed JSON's "scheduler" replaces."""


def resumable_settings(args: argparse.Namespace, config: HDETConfig, ds_config: dict[str, Any] | None,
                       dtype: str) -> dict[str, Any]:
    """The settings in effect that a resume says it changed: ``RESUMABLE_ARGUMENTS`` and the precision (under
    DeepSpeed those it takes from its JSON alone, ``DEEPSPEED_ONLY_IN_JSON`` and ``DEEPSPEED_SCHEDULE`` where the
    JSON has a scheduler, are left to the JSON, recorded whole as ``deepspeed.<key>``), and every HDET setting
    (``hdet.<field>``) but where the metrics go and the replica size (a requeued job may change it)."""
    overridden = set()
    if ds_config is not None:
        overridden.update(DEEPSPEED_ONLY_IN_JSON)
        if "scheduler" in ds_config:
            overridden.update(DEEPSPEED_SCHEDULE)
    hdet = {name: value for name, value in config.to_dict().items()
            if name not in ("metrics_path", "ranks_per_replica")}
    given = {**{name: getattr(args, name) for name in RESUMABLE_ARGUMENTS}, "dtype": dtype}
    return {**{name: value for name, value in given.items() if name not in overridden},
            **_dotted("deepspeed.", ds_config or {}), **_dotted("hdet.", hdet)}


def _dotted(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """The leaves of the nested ``values``, each under its path joined by dots after ``prefix``."""
    return {key: value for name, item in values.items() for key, value in
            (_dotted(f"{prefix}{name}.", item) if isinstance(item, dict) else {f"{prefix}{name}": item}).items()}


def given_weight_decay(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> float:
    """The weight decay the run was given: the DeepSpeed JSON's optimizer's where it sets one, else
    ``--weight_decay``."""
    if "optimizer" in (ds_config or {}):  # as the DeepSpeed backend decides whose optimizer it is
        return float(((ds_config["optimizer"] or {}).get("params") or {}).get("weight_decay", 0.0))
    return args.weight_decay


def built_weight_decay(ds_config: dict[str, Any]) -> float:
    """The weight decay DeepSpeed builds the JSON's optimizer with: its own, else its class's default: torch's
    AdamW's 0.01 where ``torch_adam`` gives one (AdamW, or Adam in DeepSpeed's default AdamW mode) and for mup's
    MuAdamW, else 0 (DeepSpeed's fused and CPU Adam, torch's Adam, the others)."""
    optimizer = ds_config["optimizer"] or {}
    params = optimizer.get("params") or {}
    if "weight_decay" in params:
        return float(params["weight_decay"])
    kind = str(optimizer.get("type", "")).lower()
    if kind == "muadamw":  # mup's, with torch's AdamW's defaults
        return 0.01
    adamw = kind == "adamw" or kind == "adam" and params.get("adam_w_mode", True)
    return 0.01 if params.get("torch_adam", False) and adamw else 0.0


SCHEDULER_LR_KEYS: dict[str, tuple[str, float | None]] = {
    "WarmupLR": ("warmup_max_lr", None), "WarmupDecayLR": ("warmup_max_lr", 0.001),
    "OneCycle": ("cycle_max_lr", None), "LRRangeTest": ("lr_range_test_min_lr", 1e-3)}
"""DeepSpeed's schedulers that set the LR themselves (``WarmupCosineLR`` scales the optimizer's): the key of their
params that sets it, and DeepSpeed's default for it (None: the optimizer's LR where the key is left out)."""


def scheduler_lr(ds_config: dict[str, Any]) -> tuple[float, str] | None:
    """The LR the DeepSpeed JSON's scheduler trains at instead of the optimizer's, and where it comes from; None
    where there is no scheduler or it takes the optimizer's LR."""
    scheduler = ds_config.get("scheduler") or {}
    kind = scheduler.get("type")
    if kind not in SCHEDULER_LR_KEYS:
        return None
    key, default = SCHEDULER_LR_KEYS[kind]
    value = (scheduler.get("params") or {}).get(key)
    if isinstance(value, list) and value and isinstance(value[0], (int, float)):  # per param group: the first's
        return float(value[0]), f"the DeepSpeed JSON's {key}[0]"
    if isinstance(value, (int, float)):
        return float(value), f"the DeepSpeed JSON's {key}"
    return None if default is None else (default, f"DeepSpeed's default {key} of {kind}")


def given_peak_lr(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> tuple[float, str]:
    """The peak LR the run was given (LRRangeTest's: its first), and where: the DeepSpeed JSON's scheduler or
    optimizer where it sets one, else ``--lr``. The LR HDET finds is said as a multiple of it."""
    config = ds_config or {}
    scheduled = scheduler_lr(config)
    if scheduled is not None:
        return scheduled
    optimizer = ((config.get("optimizer") or {}).get("params") or {}).get("lr")
    if isinstance(optimizer, (int, float)):  # WarmupCosineLR's peak too
        return float(optimizer), "the DeepSpeed JSON's lr"
    return args.lr, "--lr"
