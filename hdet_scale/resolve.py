"""From what the user gave to the config a run uses, once, at the front door (train.py, an engine's attach, an
integration): loaded and validated, the replica size a number for this world, the controller's start and stop
steps of this run, and the run refused in one line where it could not learn anything."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hdet_scale.adapter import EngineAdapter
from hdet_scale.config import MODE_DEFAULTS, WINDOW_FIELDS, HDETConfig
from hdet_scale.config_checks import HDETConfigError
from hdet_scale.controller import MIN_CONTROLLER_UPDATES, PaperDecay, controller_updates, updates_to_climb
from hdet_scale.topology import ReplicaTopology, check_world_size, with_replica_size


def resolve(config: HDETConfig, *, world_size: int | None = None, auto: str = "rank",
            total_steps: int | None = None) -> HDETConfig:
    """``config`` (valid: it was checked when made) with ``ranks_per_replica`` a number (``auto``: ``"rank"`` for
    unsharded engines, ``"node"`` for sharded ones, see ``topology.with_replica_size``), checked against
    ``world_size`` where given, and with the controller's unset fields filled (its start and stop as steps where
    ``total_steps`` is given). Resolving a resolved config again returns the same object."""
    if world_size is not None:
        check_world_size(config, world_size, auto=auto)
    config = with_replica_size(config, auto=auto, world_size=world_size)
    return config.for_run(total_steps) if total_steps is not None else filled(config)


def filled(config: HDETConfig) -> HDETConfig:
    """``config`` with its controller's unset fields at their mode's defaults (``AutoLRConfig.filled``)."""
    lr = config.auto_lr.filled()
    return config if lr is config.auto_lr else dataclasses.replace(config, auto_lr=lr)


def stuck_start_error(config: HDETConfig, num_replicas: int) -> HDETConfigError | None:
    """The error to raise when the controller would run (on, 2+ replicas, ``for_run`` applied) but no sync falls
    between its start and stop while it starts away from the given LR (``initial_scale`` != 1): the whole run would
    train at ``initial_scale`` times that LR."""
    lr = config.auto_lr
    if (not lr.enabled or num_replicas < 2 or lr.range_test or lr.initial_scale in (None, 1.0)
            or controller_updates(config) != 0):
        return None
    reachable = lr.stop >= max(lr.start, 1)
    fix = f"set sync_interval to {lr.stop} or less, or " if reachable else "set "
    return HDETConfigError(
        f"sync_interval={config.sync_interval} puts no sync between the auto-LR controller's start (step "
        f"{lr.start}) and stop (step {lr.stop}): it would never move from auto_lr.initial_scale="
        f"{lr.initial_scale:g}, and the whole run would train at {lr.initial_scale:g} x the given LR; {fix}"
        "auto_lr.initial_scale to 1")


def run_length_error(config: HDETConfig, num_replicas: int, fix: str, *,
                     explores_others: bool = False) -> HDETConfigError | None:
    """The error to raise when the controller would run (2+ replicas, on for the LR or for another value explored:
    in ``config.explore`` or ``explores_others``) and its start or stop is still a share of a run whose length is
    unknown (``for_run`` not applied); ``fix`` says how to give the length."""
    lr = config.auto_lr.filled()
    moves = lr.moves_any(explores_others or config.explore.any_given)
    for name in WINDOW_FIELDS:
        if moves and num_replicas > 1 and isinstance(getattr(lr, name), float):
            what = "the LR" if lr.moves_lr else "the explored values"
            return HDETConfigError(f"auto_lr.{name}={getattr(lr, name)} is a share of the run, and the "
                                   f"controller moving {what} needs the run's length for it: {fix}, or give "
                                   f"auto_lr.{name} as a step (an int)")
    return None


def add_hdet_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--hdet_config PATH`` to a user's parser (next to ``deepspeed.add_config_arguments``)."""
    group = parser.add_argument_group("HDET")
    group.add_argument("--hdet_config", type=str, default=None, metavar="PATH",
                       help="JSON file of HDET settings (spread, sync interval, controller, replica layout)")
    return parser


def load_config(source: HDETConfig | Mapping[str, Any] | str | os.PathLike[str] | argparse.Namespace | None,
                *, world_size: int | None = None) -> HDETConfig:
    """A validated config from a config object, a mapping, a JSON path, parsed args or None (defaults).

    With ``world_size`` (or a WORLD_SIZE variable set by the launcher) the replica layout is checked too,
    so a bad layout fails before any process group exists.
    """
    if isinstance(source, argparse.Namespace):
        source = getattr(source, "hdet_config", None)
    if source is None:
        config = HDETConfig()
    elif isinstance(source, HDETConfig):
        config = source
    elif isinstance(source, Mapping):
        config = HDETConfig.from_dict(source)
    elif isinstance(source, (str, os.PathLike)):
        config = HDETConfig.from_json(source)
    else:
        raise HDETConfigError(
            f"hdet_config must be an HDETConfig, a dict, a JSON path or None, got {type(source).__name__}"
        )
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size is not None:
        check_world_size(config, world_size)
    return config


def single_replica_warning(config: HDETConfig, topology: ReplicaTopology, *, explores: bool) -> str | None:
    """What a run loses when it has one replica while HDET is set to explore (the controller on, or ``explores``:
    some value spread); None otherwise."""
    if topology.num_replicas > 1 or not (config.auto_lr.enabled or explores):
        return None
    trains_as = ("no spread, no averaging and no controller: after the LR range test it trains as plain data "
                 "parallel" if config.auto_lr.range_test else
                 "no spread, no averaging and no auto-LR, it trains as plain data parallel")
    return (f"HDET has ONE replica ({topology.world_size} rank(s), ranks_per_replica={topology.ranks_per_replica}): "
            f"{trains_as}. Give it 2 replicas or more: a "
            "ranks_per_replica that divides the world size into 2+ parts (e.g. half a node), or more nodes")


def few_updates_warning(config: HDETConfig, num_replicas: int) -> str | None:
    """What the controller cannot do when fewer syncs fall between its start and its stop (``for_run`` applied)
    than it needs to climb its whole range (``controller.updates_to_climb``, at least 4); else None."""
    cfg, interval = config.auto_lr, config.sync_interval
    if not cfg.moves_lr or num_replicas == 1:  # no climb (its start may be an unplaced share)
        return None
    updates, needed = controller_updates(config), updates_to_climb(cfg)
    if updates is None or updates >= needed:
        return None
    climb_sets_it = needed > MIN_CONTROLLER_UPDATES  # else the bare minimum of updates does
    reach = (f"; climbing from auto_lr.initial_scale={cfg.initial_scale:g} to scale_max={cfg.scale_max:g} at "
             f"max_log_step={cfg.max_log_step:g} a sync takes {needed}, so a too-low LR may not climb all the way"
             if climb_sets_it else "")
    interval_for_enough = (cfg.stop - cfg.start) // needed
    fix = (f"set sync_interval to {interval_for_enough} or less for {needed}" if interval_for_enough >= 1 else
           f"the window is shorter than {needed} steps: train longer, or widen it (auto_lr.start, stop)"
           + (", or narrow the climb (auto_lr.initial_scale, scale_max, max_log_step)" if climb_sets_it else ""))
    return (f"the auto-LR controller moves only between steps {cfg.start} and {cfg.stop}, where "
            f"sync_interval={interval} gives it {updates} update(s){reach}: {fix}")


def late_start_warning(config: HDETConfig, num_replicas: int, total_steps: int | None, *,
                       explores_others: bool) -> str | None:
    """What a controller set to move a value does when it starts at or past the end of a run of ``total_steps``
    (``for_run`` applied): nothing; else None."""
    cfg = config.auto_lr
    if total_steps is None or num_replicas == 1 or not cfg.moves_any(explores_others) or cfg.start < total_steps:
        return None
    return (f"the auto-LR controller starts at step {cfg.start} (auto_lr.start) and this run has {total_steps} "
            "steps: it never moves a value, and the run trains at the values it was given; set auto_lr.start below "
            f"{total_steps} (or as a share of the run, e.g. 0.02), or auto_lr.enabled to false")


CONTROLLER_ONLY_FIELDS = ("mode", "beta", "sigma", "step_size", "rise_only_after", "scale_min", "scale_max",
                          "max_log_step", "average_window", "probe_weight")
"""The auto-LR fields that act on nothing but the controller's moves (``start`` and ``stop`` are left out: once a run
places them, given and default look alike)."""
READ_WITHOUT_THE_CONTROLLER = ("average_window",)
"""Of ``CONTROLLER_ONLY_FIELDS``, those a run reads where the controller moves nothing: a probe's scores (in the
metrics) come from the weights averaged over ``average_window``."""


def _given_fields(lr: Any, names: Sequence[str]) -> list[str]:
    """Those of the auto-LR ``names`` that ``lr`` (its mode's defaults filled in) holds away from their defaults:
    given by the user."""
    mode_defaults = MODE_DEFAULTS.get(lr.mode, {})
    field_defaults = {field.name: field.default for field in dataclasses.fields(lr)}
    return [f"auto_lr.{name}" for name in names if getattr(lr, name) != mode_defaults.get(name, field_defaults[name])]


def unread_settings_warnings(config: HDETConfig, num_replicas: int, *, explores_others: bool,
                             lr_spread: bool) -> list[str]:
    """What the controller's settings do in a run whose controller moves nothing, or whose mode does not read one
    of them: nothing, said with the fix (empty where each is read). ``config`` has its mode's defaults filled in
    (``for_run``), so a field that differs from them was given; ``explores_others``: a value besides the LR is
    explored; ``lr_spread``: the replicas' LRs differ. With one replica ``single_replica_warning`` says it all."""
    cfg = config.auto_lr
    if num_replicas == 1:
        return []
    unread = [name for name in CONTROLLER_ONLY_FIELDS if name not in READ_WITHOUT_THE_CONTROLLER]
    if not cfg.enabled:
        given = _given_fields(cfg, unread)
        return [f"{', '.join(given)} set for the auto-LR controller, which is off (auto_lr.enabled is false): they do "
                "nothing in this run; remove them, or set auto_lr.enabled to true"] if given else []
    if not cfg.moves_any(explores_others):
        given = _given_fields(cfg, unread)
        return [f"{', '.join(given)} set for the auto-LR controller, which moves nothing in this run: the LR range "
                f"test (auto_lr.range_test={cfg.range_test}; it runs unless set to 0) picks the LR, which then holds, "
                "and no other value is explored (explore, add_knob). Set auto_lr.range_test to 0 for the controller "
                "to move the LR, or remove them"] if given else []
    warnings = []
    if (cfg.moves_lr and not lr_spread and not explores_others and cfg.mode != "paper"
            and cfg.scale_min < cfg.scale_max):  # paper mode decays the LR still (eq. 8); a pinned scale is meant
        warnings.append(
            f"alpha={config.spread_alpha(lr=True):g} gives every replica the same LR, so the auto-LR controller has "
            "no losses to compare and no other value is explored: it moves nothing in this run, and the LR stays the "
            "one given. Set alpha above 0 for the controller to move the LR, or auto_lr.enabled to false")
    if cfg.mode != "log" and _given_fields(cfg, ("max_log_step",)):
        warnings.append(f"auto_lr.max_log_step={cfg.max_log_step:g} is read in 'log' mode only, and auto_lr.mode is "
                        f"'{cfg.mode}': it does nothing in this run; remove it, or set auto_lr.mode to 'log'")
    return warnings


def check_attachable(config: HDETConfig, adapter: EngineAdapter, topology: ReplicaTopology,
                      paper_decay: Sequence[PaperDecay] | None, *, fresh_start: bool) -> None:
    """Refuses, before an ensemble attaches (and changes any weight), a topology, optimizer or setting it cannot
    work with (a window needing the run's length, a controller that could not leave its start, a paper mode
    without its floors, an LR range test from a first LR of 0); ``fresh_start``: no checkpoint's state goes on."""
    if topology.ranks_per_replica != config.ranks_per_replica:
        raise ValueError(
            f"the topology has {topology.ranks_per_replica} ranks per replica but the config says "
            f"ranks_per_replica={config.ranks_per_replica}; build both from the same config"
        )
    if getattr(adapter.optimizer, "_hdet_attached", False):
        raise ValueError("this optimizer already has HDET attached; call close() on the other ensemble first")
    error = run_length_error(config, topology.num_replicas, "pass total_steps= when attaching (train.py, the "
                             "integrations and HDETOneCycleLR do)")
    if error is not None:
        raise error
    error = stuck_start_error(config, topology.num_replicas)
    if error is not None:
        raise error
    num_groups = len(adapter.optimizer.param_groups)
    if config.auto_lr.enabled and config.auto_lr.mode == "paper" and paper_decay is None:
        raise ValueError(
            "auto_lr.mode='paper' needs the base schedule's floor and length: use HDETOneCycleLR, pass "
            "paper_decay=[PaperDecay(total_steps, floor), ...] (one per param group), or use mode 'scale'"
        )
    if paper_decay is not None and len(paper_decay) != num_groups:
        raise ValueError(f"paper_decay has {len(paper_decay)} entries for {num_groups} param groups")
    first_lr = adapter.peak_lrs()[0] if config.auto_lr.range_test and fresh_start else None
    if first_lr is not None and not first_lr > 0:
        raise HDETConfigError(f"auto_lr.range_test ramps the first param group's LR and keeps the others' ratio to "
                              f"it, and that group's LR is {first_lr}: build the optimizer with its peak LR "
                              "(a warm-up from 0 by a torch scheduler keeps it), or set auto_lr.range_test to 0")
