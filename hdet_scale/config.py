"""HDET configuration: dataclasses with strict loading and validation.

The defaults are the controller that found the LR best from either side in ``benchmarks/lr_finding.py``
(``tenth_rise_start2``, see benchmarks/results/lr_finding.md): a log spread, the scale-free ``log`` controller on
quarter-interval averaged weights from a tenth of the given LR, moving between 2% and 25% of the run, only upward
from 12% of it. ``HDETConfig.paper()`` gives the paper's settings. Every field carries the paper's symbol where
it has one (arXiv 2604.24708, section 3). A config is loaded from a JSON file (``--hdet_config PATH``), a mapping,
or built in code; unknown keys are errors (one an earlier version had is refused as removed), and ``validate()``
names the field, the allowed range and the value it got.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GRADIENT_MODES = ("global", "local")
CONTROLLER_MODES = ("scale", "paper", "log")
SPREADS = ("linear", "log")
MODE_DEFAULTS: dict[str, dict[str, float | None]] = {
    "log": {"beta": 0.5, "sigma": 1.0, "step_size": 2.5, "initial_scale": 0.1, "start": 0.02,
            "stop": 0.25, "rise_only_after": 0.43},
    "scale": {"beta": 0.9, "sigma": 0.1, "step_size": 0.5, "initial_scale": 1.0, "start": 0.05,
              "stop": None, "rise_only_after": 1.0},
    "paper": {"beta": 0.9, "sigma": 0.1, "step_size": 0.5, "initial_scale": 1.0, "start": 0.05,
              "stop": None, "rise_only_after": 1.0},
}
"""What ``beta``, ``sigma``, ``step_size``, ``initial_scale``, the start and stop and ``rise_only_after`` are when
left unset, per controller mode: ``log``'s from
benchmarks/lr_finding.py (its controller climbs from a tenth of the LR, so it starts early, inside a usual LR
warm-up), ``scale``'s and ``paper``'s the paper's (eqs. 4, 7) with the start at 5% of the run (the paper's
S_warm is a fixed 100,000 steps)."""
MIN_CONTROLLER_UPDATES = 4
"""Fewer controller updates than this (or than ``AutoLRConfig.updates_to_climb``) in its window are warned about."""
WINDOW_FIELDS = ("start", "stop")
"""The controller's start and stop: a step (an int), or a share of the run (a float) that ``HDETConfig.for_run``
turns into a step."""
MIN_RANGE_TEST_STEPS = 13
"""The fewest steps a range test may have: its pick leaves out its first 10 and its last step."""
DEFAULT_AVERAGE_WINDOW = 0.25
"""``average_window`` when unset, in ``log`` mode with a probe."""
REMOVED_SETTINGS: dict[str, tuple[str, ...]] = {
    "auto_lr": ("hold_average", "average_window_late", "displacement", "hypergradient", "progress_target",
                "bias_correction"),
}
"""Settings that earlier versions had and that left the library because they measured no better than the default
controller (benchmarks/README.md, "LR-finding variants tried"): a config naming one is refused with that reason,
not read as a misspelling."""
RENAMED_SETTINGS: dict[str, dict[str, str]] = {
    "auto_lr": {"warmup_steps": "start", "start_fraction": "start", "stop_steps": "stop", "stop_fraction": "stop"},
}
"""Settings of earlier versions now given under another name: a config naming one is refused with the new one."""


class HDETConfigError(ValueError):
    """A bad HDET setting: the message names the field, the allowed values and how to fix it."""


@dataclass
class AutoLRConfig:
    """The auto-LR controller (paper eqs. 4-9)."""

    enabled: bool = True
    """Move the base values from the replicas' relative losses. Off: spread and averaging only."""

    mode: str = "log"
    """``scale``: keep the base schedule's shape and move a multiplicative scale on it (any scheduler).
    ``paper``: after the warm-up the controller owns the base value and decays it geometrically to
    OneCycleLR's floor over the remaining syncs (eqs. 7-8, with eq. 8's sign fixed). ``log``: scale-free,
    in log space: the replicas' losses are z-scored (divided by their spread, so ``sigma`` is a temperature
    in units of that spread), the hypergradient is the weighted mean of log multipliers, and the scale moves
    by ``exp(lambda * v)``, at most ``max_log_step`` per sync either way: up and down alike."""

    start: int | float | None = None
    """When the controller starts updating (the spread applies from step 0): an optimizer step (an int; the
    paper's S_warm) or a share of the run (a float in [0, 1): 0.02 is after the first 2% of the steps, one setting
    for runs of any length). A share needs the run's length: train.py, the integrations and ``HDETOneCycleLR``
    know it; elsewhere pass ``total_steps`` when attaching (or call ``config.for_run(total_steps)``). null: 0.02 in
    ``log`` mode (its climb from a tenth of the LR needs the syncs), 0.05 in the others."""

    stop: int | float | None = None
    """When the controller stops and holds its values (the spread and the averaging go on): a step (an int) or a
    share of the run (a float in (0, 1]; 1.0: never hold). Once the schedule is past its first quarter or so the
    replicas' short-horizon losses favour lower values again (see benchmarks/results/lr_finding.md): holding keeps
    what the controller found. null: 0.25 in ``log`` mode, no stop in the others; not with ``paper`` mode, whose
    controller also carries eq. 8's decay. In ``log`` mode the controller only raises the LR over the last part of
    its window, whatever the stop (``rise_only_after``; 1 for a controller that moves both ways to the end)."""

    rise_only_after: float | None = None
    """The share of the controller's window (from its start to its stop) after which it only raises the LR's scale,
    in [0, 1] (1: never; 0: every update after the first): at the syncs after ``start + share x (stop - start)``
    the velocity is floored at 0, so the scale does not fall. The replicas' short-horizon scores lean above the
    best LR early in the run and below it from ~10-15% of it on (benchmarks/results/lr_finding.md): past that point
    a signal to lower the LR is what the bias gives even at the best LR, while one to raise it goes against the
    bias. The LR only (other explored values move both ways). Needs a stop; not with ``paper`` mode. null: the
    mode's default (``MODE_DEFAULTS``)."""

    beta: float | None = None
    """beta: momentum of the velocity (eq. 7), in [0, 1). null: the mode's default (``MODE_DEFAULTS``)."""

    sigma: float | None = None
    """sigma: softmax temperature on loss differences (eq. 4), > 0. Smaller trusts small differences more.
    null: 1.0 in ``log`` mode (in units of the losses' spread), the paper's 0.1 in the others."""

    step_size: float | None = None
    """lambda: how far one sync moves the base along the velocity (eq. 7), >= 0. null: 2.5 in ``log`` mode
    (at most ``max_log_step`` per sync anyway), the paper's 0.5 in the others."""

    scale_min: float = 0.1
    """Floor of the multiplicative scale in ``scale`` and ``log`` mode (relative to the base schedule), > 0. The
    lowest LR the controller can reach is ``scale_min`` times the one it was given: with the default 0.1 and
    ``initial_scale`` 0.1, a run cannot go below the LR it starts at, so a given LR more than 10x too high stays
    too high; lower it to reach further."""

    range_test: int = 0
    """Steps of the LR range test the run starts with, 0 (none) or at least 13 (``hdet_scale.range_test``): every
    replica trains at the same LR, growing exponentially from 1e-6 to 1 over these steps (other param groups keep
    their ratio to the first); the LR where the smoothed loss falls fastest is picked, every replica goes back to
    the weights it had before the test with a fresh optimizer state, and the run goes on with the spread's fastest
    replica at the picked LR (the base at the pick over the largest multiplier). The controller then moves from
    there, ``initial_scale`` unused and ``scale_min``/``scale_max`` relative to that start. The test's steps come
    before the run's (``HDETEnsemble.global_step`` stays 0; ``hdet_scale.train`` runs them before ``--steps``), and
    ``HDETScheduler`` holds the schedule meanwhile: loop ``while hdet.global_step < total_steps``. The schedule's
    peak LR is read from the optimizer (OneCycleLR's ``max_lr``, else the ``initial_lr`` torch's schedulers keep).
    Each rank holds a copy of its weights (its shards) during the test. Not with ``paper`` mode; not yet with
    DeepSpeed, the Trainer or Lightning, whose schedulers would run on."""

    initial_scale: float | None = None
    """``scale`` and ``log`` mode: the LR's scale from the first step (other explored values start at 1), in
    [scale_min, scale_max]. Below 1 the run starts under the LR it was given and the controller climbs: a too-high
    LR early does damage that no later LR undoes, a too-low one is climbed out of (see
    benchmarks/results/lr_finding.md). Needs the controller on; with one replica (no controller) the LR starts
    at 1 whatever this says. null: 0.1 in ``log`` mode with the controller on, else 1."""

    scale_max: float = 10.0
    """Ceiling of the multiplicative scale in ``scale`` and ``log`` mode, >= scale_min: the highest LR the
    controller can reach is ``scale_max`` times the one it was given (by default 10x, so a given LR more than 10x
    too low stays too low; raise it to reach further)."""

    max_log_step: float = 0.5
    """``log`` mode: the largest change of log(scale) at one sync (0.5: x1.65 or /1.65), > 0."""

    average_window: float | None = None
    """With a probe set: score each replica's weights averaged over the last ``average_window`` of the
    interval (e.g. 0.5: its second half) instead of its last iterate, in [0, 1). Averaging removes the
    oscillation that a higher LR adds to the last iterate (noise that hides its faster progress), the bias
    that makes a short-horizon score prefer too-low LRs. Costs one copy of this rank's shard, one in-place
    update per step inside the window, and at each sync an exchange of the weights and their mean one tensor at a
    time. 0: the last iterate. null: 0.25 with the ``log`` controller on and a probe set (a longer window leans
    to higher LRs, a shorter one to lower: benchmarks/results/lr_finding.md), else 0."""

    probe_weight: float = 1.0
    """With a probe set (``HDETEnsemble.set_probe``): the weight of the replicas' probe-batch losses in the
    controller's signal, in [0, 1]; the interval training losses get the rest. The probe scores every replica
    on the same held-out batch, so the signal carries no batch-to-batch noise. Without a probe: unused."""

    def filled(self) -> AutoLRConfig:
        """This config with every unset field at its default for the mode (``MODE_DEFAULTS``): what the controller
        runs with. The unset fields stay None in the config itself, so that a dict of overrides merged onto it
        (``resolve_config``) is read as given."""
        defaults = MODE_DEFAULTS.get(self.mode, MODE_DEFAULTS["scale"])  # an unknown mode: validate names it
        changes: dict[str, Any] = {}
        for name in ("beta", "sigma", "step_size", "rise_only_after"):
            if getattr(self, name) is None:
                changes[name] = defaults[name]
        if self.initial_scale is None:
            # after a range test the scale starts at its pick: 1 relative to it
            starts_below = self.enabled is True and not self.range_test
            changes["initial_scale"] = defaults["initial_scale"] if starts_below else 1.0
        for name in WINDOW_FIELDS:
            if getattr(self, name) is None:
                changes[name] = defaults[name]
        return dataclasses.replace(self, **changes) if changes else self

    def for_other_knobs(self) -> AutoLRConfig:
        """The controller of every explored value but the LR: only the LR follows the paper's mode (the others
        move a scale on their base value) and only the LR's scale is held from falling (``rise_only_after``)."""
        return dataclasses.replace(self, mode="scale" if self.mode == "paper" else self.mode, rise_only_after=1.0)

    def window(self, probing: bool) -> float:
        """The share of each interval whose weights the probe scores: ``average_window``, or where unset its
        default (``probing``: a probe is set)."""
        if self.average_window is not None:
            return self.average_window
        return DEFAULT_AVERAGE_WINDOW if probing and self.enabled and self.mode == "log" else 0.0

    def updates_to_climb(self) -> int:
        """How many controller updates the LR needs to climb from ``initial_scale`` to ``scale_max`` at the
        largest step, ``max_log_step`` a sync (``log`` mode: the reach of a too-low start), at least
        MIN_CONTROLLER_UPDATES. Other modes have no largest step: MIN_CONTROLLER_UPDATES."""
        lr = self.filled()
        if lr.mode != "log" or lr.initial_scale >= lr.scale_max:
            return MIN_CONTROLLER_UPDATES
        # less a hair: a climb of exactly n steps (log(100) / (log(100) / 14)) must not round up to n + 1
        climb = math.ceil(math.log(lr.scale_max / lr.initial_scale) / lr.max_log_step - 1e-9)
        return max(MIN_CONTROLLER_UPDATES, climb)

    def window_share(self, step: int) -> float | None:
        """How far ``step`` is into the controller's window, from ``start`` (an unresolved start counts as 0) to
        ``stop``, both steps as ``for_run`` resolves them: 0 at the start, 1 at the stop, below 0 before and above 1
        after; None without a stop. The one-sided phase (``rise_only_after``) is placed by this share."""
        if not _is_step(self.stop):
            return None
        start = self.start if _is_step(self.start) else 0
        return (step - start) / max(self.stop - start, 1)


@dataclass
class WarmInitConfig:
    """Warm noisy initialization (paper eq. 10)."""

    enabled: bool = False
    """Add per-replica Gaussian noise to the starting weights before the first fan-out."""

    nu: float = 0.01
    """nu: noise std relative to the RMS of all parameters, ||theta0|| / sqrt(d), >= 0."""


@dataclass
class KnobConfig:
    """One explored hyperparameter besides the LR (paper Remark 1)."""

    alpha: float | None = None
    """Its spread ratio (eq. 1), in [0, 1); null: the top-level ``alpha``."""

    base: float | None = None
    """``label_smoothing`` only: the base value. The others take theirs from the optimizer or the model."""


@dataclass
class ExploreConfig:
    """Hyperparameters explored besides the LR, each with its own spread, permutation and controller.

    ``weight_decay``: every param group's, explored per group (``weight_decay/<group>``) and applied inside
    ``optimizer.step()`` like the LR. ``dropout``: a factor on every dropout probability in the model
    (``nn.Dropout`` and transformers' dropout fields), clamped to [0, 1). ``attention_scale``: a factor on
    the softmax scale of every transformers attention module (a temperature). ``label_smoothing``: a value
    the loss reads with ``hdet.value("label_smoothing")``, in [0, 1)."""

    weight_decay: KnobConfig | None = None
    dropout: KnobConfig | None = None
    attention_scale: KnobConfig | None = None
    label_smoothing: KnobConfig | None = None

    def __post_init__(self) -> None:
        _nest(self, "explore.")


@dataclass
class HDETConfig:
    """Everything HDET needs besides the model, optimizer and schedule."""

    alpha: float = 0.5
    """alpha: spread ratio of the LR multipliers (eq. 1), in [0, 1) (``spread="log"``: any alpha >= 0). 0 is plain
    data parallel. The paper's: 1/9 with a linear spread."""

    spread: str = "log"
    """How the multipliers spread around 1: ``linear``, eq. 1's [1 - alpha, 1 + alpha] (arithmetic mean 1);
    ``log``, evenly in log space over [1/(1 + alpha), 1 + alpha] (geometric mean 1: as far up as down)."""

    sync_interval: int = 1000
    """T: optimizer steps between parameter averages (eq. 3), >= 1."""

    ranks_per_replica: int | str = "auto"
    """Ranks that form one replica (they shard or replicate one model together): a number >= 1 that divides
    the world size, ``"node"`` (the launcher's ranks per node, LOCAL_WORLD_SIZE or LOCAL_SIZE), or ``"auto"``:
    1 for unsharded engines (DDP, DeepSpeed ZeRO-0: the paper's setting, every rank a replica) and a node
    for sharded ones (FSDP2, ZeRO-1/2/3), but on a single node half of it (two replicas; for an odd number
    of ranks the largest divisor that gives two or more), never one replica where the world allows two."""

    gradient_mode: str = "global"
    """``global``: gradients averaged over all ranks every step (paper eq. 2). ``local``: averaged only
    inside a replica; replicas meet only at syncs (local SGD with an LR spread)."""

    seed: int = 0
    """Seed of HDET's own generators (permutations, warm-init noise); the global RNG is never touched."""

    bucket_mb: float = 25.0
    """Size in MiB of the flat fp32 buckets used to average parameters, > 0."""

    average_optimizer_state: bool = False
    """Also average the optimizer's floating-point state (e.g. Adam's moments) at each sync. Off by default,
    as in the paper: in ``global`` mode the replicas see the same gradients, so Adam's moments agree anyway;
    in ``local`` mode each replica's moments track its own gradients, and averaging them trades that for
    replicas that restart each interval from one state."""

    metrics_path: str | None = None
    """JSON-lines file written by global rank 0, one line per sync; None disables it."""

    auto_lr: AutoLRConfig = field(default_factory=AutoLRConfig)
    warm_init: WarmInitConfig = field(default_factory=WarmInitConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)

    def __post_init__(self) -> None:
        _nest(self, "")

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> HDETConfig:
        """Builds and validates a config from a (possibly nested) mapping; unknown keys are errors."""
        config = _build(cls, values, prefix="")
        config.validate()
        return config

    @classmethod
    def paper(cls, **changes: Any) -> HDETConfig:
        """The paper's settings (section 4): alpha 1/9 on a linear spread, T = 1000, the ``paper`` controller
        from step 100,000 with sigma 0.1 and lambda 0.5; ``changes`` replace top-level fields."""
        return dataclasses.replace(cls(alpha=1.0 / 9.0, spread="linear", sync_interval=1000,
                                       auto_lr=AutoLRConfig(mode="paper", start=100_000)), **changes)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> HDETConfig:
        """Loads and validates a config from a JSON file."""
        path = Path(path)
        if not path.is_file():
            raise HDETConfigError(f"hdet_config: no such file '{path}'; pass the path of an HDET JSON file")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise HDETConfigError(f"hdet_config: '{path}' is not valid JSON ({error})") from error
        if not isinstance(values, dict):
            raise HDETConfigError(f"hdet_config: '{path}' must hold a JSON object of HDET settings")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable nested dict that ``from_dict`` turns back into an equal config."""
        return dataclasses.asdict(self)

    # -------------------------------------------------------------------------------------- validation
    def validate(self, world_size: int | None = None) -> None:
        """Raises HDETConfigError naming the first bad field; with ``world_size`` also checks the layout."""
        if self.spread == "log":  # multipliers in [1/(1 + alpha), 1 + alpha]: positive for any alpha
            _check_number("alpha", self.alpha, low=0.0)
        else:
            _check_number("alpha", self.alpha, low=0.0, high=1.0, high_open=True,
                          hint="alpha >= 1 makes the lowest multiplier 1 - alpha <= 0; spread 'log' allows it")
        _check_int("sync_interval", self.sync_interval, low=1)
        _check_choice("spread", self.spread, SPREADS)
        if self.ranks_per_replica not in REPLICA_SIZE_NAMES:
            _check_int("ranks_per_replica", self.ranks_per_replica, low=1,
                       also=" or one of " + ", ".join(repr(name) for name in REPLICA_SIZE_NAMES))
        _check_choice("gradient_mode", self.gradient_mode, GRADIENT_MODES)
        _check_int("seed", self.seed, low=0)
        _check_number("bucket_mb", self.bucket_mb, low=0.0, low_open=True)
        _check_bool("average_optimizer_state", self.average_optimizer_state)
        if self.metrics_path is not None and not isinstance(self.metrics_path, str):
            raise HDETConfigError(f"metrics_path must be a file path string or null, got {self.metrics_path!r}")
        lr = self.auto_lr
        _check_bool("auto_lr.enabled", lr.enabled)
        _check_choice("auto_lr.mode", lr.mode, CONTROLLER_MODES)
        if lr.start is not None:
            _check_step_or_share("auto_lr.start", lr.start, high_open=True)
        if lr.stop is not None:
            _check_step_or_share("auto_lr.stop", lr.stop, low_open=True)
        if lr.mode == "paper" and lr.stop is not None:
            raise HDETConfigError("auto_lr.stop works in 'scale' and 'log' mode; the paper's controller also decays "
                                  "the LR (eq. 8): remove it or choose another mode")
        _check_int("auto_lr.range_test", lr.range_test, low=0)
        if 0 < lr.range_test < MIN_RANGE_TEST_STEPS:
            raise HDETConfigError(f"auto_lr.range_test={lr.range_test}: a range test needs at least "
                                  f"{MIN_RANGE_TEST_STEPS} steps (100 is usual); 0 turns it off")
        if lr.range_test and (lr.mode == "paper" or not lr.enabled):
            raise HDETConfigError("auto_lr.range_test sets the scale the controller starts from: it needs the "
                                  "controller on in 'scale' or 'log' mode; set it to 0 or turn auto_lr on")
        if lr.range_test and lr.initial_scale not in (None, 1.0):
            raise HDETConfigError(f"auto_lr.initial_scale={lr.initial_scale} and auto_lr.range_test both set where "
                                  "the LR starts: remove initial_scale (the test picks the start)")
        if lr.initial_scale is not None and lr.initial_scale != 1.0 and (lr.mode == "paper" or not lr.enabled):
            raise HDETConfigError(f"auto_lr.initial_scale={lr.initial_scale} needs the controller on in 'scale' or "
                                  "'log' mode (else the LR would stay at that scale): set it to 1 or turn auto_lr on")
        lr = lr.filled()  # the values the controller runs with, the mode's defaults included
        _check_number("auto_lr.beta", lr.beta, low=0.0, high=1.0, high_open=True)
        _check_number("auto_lr.sigma", lr.sigma, low=0.0, low_open=True)
        _check_number("auto_lr.step_size", lr.step_size, low=0.0)
        _check_number("auto_lr.scale_min", lr.scale_min, low=0.0, low_open=True)
        _check_number("auto_lr.probe_weight", lr.probe_weight, low=0.0, high=1.0)
        _check_number("auto_lr.max_log_step", lr.max_log_step, low=0.0, low_open=True)
        if lr.average_window is not None:
            _check_number("auto_lr.average_window", lr.average_window, low=0.0, high=1.0, high_open=True)
        _check_number("auto_lr.rise_only_after", lr.rise_only_after, low=0.0, high=1.0)
        if lr.rise_only_after < 1.0 and lr.mode == "paper":
            raise HDETConfigError(f"auto_lr.rise_only_after={lr.rise_only_after} works in 'scale' and 'log' mode; "
                                  "the paper's controller keeps eq. 7 as printed: set it to 1 (off) or choose "
                                  "another mode")
        if lr.rise_only_after < 1.0 and lr.stop is None:
            raise HDETConfigError(f"auto_lr.rise_only_after={lr.rise_only_after} is a share of the controller's "
                                  "window up to its stop: give auto_lr.stop, or set it to 1 "
                                  "(off)")
        _check_number("auto_lr.scale_max", lr.scale_max, low=lr.scale_min,
                      hint="scale_max must be at least auto_lr.scale_min")
        _check_number("auto_lr.initial_scale", lr.initial_scale, low=0.0, low_open=True)
        if not lr.scale_min <= lr.initial_scale <= lr.scale_max:
            given = "" if self.auto_lr.initial_scale is not None else f" (the '{lr.mode}' mode's default)"
            raise HDETConfigError(
                f"auto_lr.scale_min={lr.scale_min} and auto_lr.scale_max={lr.scale_max} must bracket "
                f"auto_lr.initial_scale={lr.initial_scale:g}{given} (where the controller starts; 1: the base "
                "schedule)"
            )
        for name in ("weight_decay", "dropout", "attention_scale", "label_smoothing"):
            knob = getattr(self.explore, name)
            if knob is None:
                continue
            if knob.alpha is not None:
                _check_number(f"explore.{name}.alpha", knob.alpha, low=0.0, high=1.0, high_open=True)
            if name == "label_smoothing":
                if knob.base is None:
                    raise HDETConfigError("explore.label_smoothing.base is required: the label smoothing to start "
                                          "from, in [0, 1)")
                _check_number("explore.label_smoothing.base", knob.base, low=0.0, high=1.0, high_open=True)
            elif knob.base is not None:
                raise HDETConfigError(f"explore.{name}.base is not used: {name} takes its base value from the "
                                      "optimizer or the model; remove it")
        _check_bool("warm_init.enabled", self.warm_init.enabled)
        _check_number("warm_init.nu", self.warm_init.nu, low=0.0)
        if world_size is not None:
            self.validate_world_size(world_size)

    def validate_world_size(self, world_size: int, *, auto: str = "rank") -> None:
        """Checks that ``world_size`` ranks split evenly into replicas (``auto`` as in ``resolved``)."""
        per_replica = self.resolved(auto=auto, world_size=world_size).ranks_per_replica
        if world_size < 1 or world_size % per_replica != 0:
            source = "" if per_replica == self.ranks_per_replica else f" (from '{self.ranks_per_replica}')"
            raise HDETConfigError(
                f"ranks_per_replica={per_replica}{source} does not divide the world size {world_size}; "
                "set ranks_per_replica to a divisor of the number of ranks (e.g. the GPUs per node)"
            )

    def num_replicas(self, world_size: int, *, auto: str = "rank") -> int:
        """How many replicas ``world_size`` ranks form under this config."""
        self.validate_world_size(world_size, auto=auto)
        return world_size // self.resolved(auto=auto, world_size=world_size).ranks_per_replica

    def for_run(self, total_steps: int) -> HDETConfig:
        """This config for a run of ``total_steps`` optimizer steps: ``auto_lr.start`` and ``stop`` given as shares
        of the run become steps (rounded), the unset controller fields their mode's defaults
        (``AutoLRConfig.filled``)."""
        lr = self.auto_lr.filled()
        shares = [name for name in WINDOW_FIELDS if isinstance(getattr(lr, name), float)]
        if not shares:
            return self if lr is self.auto_lr else dataclasses.replace(self, auto_lr=lr)
        _check_int("total_steps (the run's length, for auto_lr." + "/".join(shares) + " given as a share of it)",
                   total_steps, low=1)
        changes = {name: round(getattr(lr, name) * total_steps) for name in shares}
        return dataclasses.replace(self, auto_lr=dataclasses.replace(lr, **changes))

    def controller_updates(self) -> int | None:
        """How many syncs the controller updates at: those from ``auto_lr.start`` to ``stop`` inclusive, in steps
        (``for_run`` applied); None where it has no stop."""
        lr = self.auto_lr
        if lr.stop is None:
            return None
        first = -(-max(lr.start, 1) // self.sync_interval) * self.sync_interval
        return len(range(first, lr.stop + 1, self.sync_interval))

    def stuck_start_error(self, num_replicas: int) -> HDETConfigError | None:
        """The error to raise when the controller would run (on, 2+ replicas, ``for_run`` applied) but no sync
        falls between its start and stop while it starts away from the given LR (``initial_scale`` != 1): the
        whole run would train at ``initial_scale`` times that LR."""
        lr = self.auto_lr
        if (not lr.enabled or num_replicas < 2 or lr.range_test or lr.initial_scale in (None, 1.0)
                or self.controller_updates() != 0):
            return None
        reachable = lr.stop >= max(lr.start, 1)
        fix = f"set sync_interval to {lr.stop} or less, or " if reachable else "set "
        return HDETConfigError(
            f"sync_interval={self.sync_interval} puts no sync between the auto-LR controller's start (step "
            f"{lr.start}) and stop (step {lr.stop}): it would never move from auto_lr.initial_scale="
            f"{lr.initial_scale:g}, and the whole run would train at {lr.initial_scale:g} x the given LR; {fix}"
            "auto_lr.initial_scale to 1")

    def run_length_error(self, num_replicas: int, fix: str) -> HDETConfigError | None:
        """The error to raise when the controller would run (on, 2+ replicas) and its start or stop is still a
        share of a run whose length is unknown (``for_run`` not applied); ``fix`` says how to give the length."""
        lr = self.auto_lr.filled()
        for name in WINDOW_FIELDS:
            if lr.enabled and num_replicas > 1 and isinstance(getattr(lr, name), float):
                return HDETConfigError(f"auto_lr.{name}={getattr(lr, name)} is a share of the run and needs its "
                                       f"length: {fix}, or give auto_lr.{name} as a step (an int)")
        return None

    def resolved(self, *, auto: str = "rank", world_size: int | None = None) -> HDETConfig:
        """This config with ``ranks_per_replica`` as a number: ``"node"`` read from the launcher's
        LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (deepspeed); ``"auto"`` as ``auto`` says: ``"rank"``, 1;
        ``"node"``, a node, except where that would leave one replica (every rank on one node): then the largest
        replica that still gives two or more (half of the world size when it is even), so a first run on one
        machine explores too. ``world_size`` defaults to the launcher's WORLD_SIZE. Engines call this once; the
        result is what they lay the replicas out by."""
        value = self.ranks_per_replica
        if value == "auto":
            if auto not in ("rank", "node"):
                raise ValueError(f"auto must be 'rank' or 'node', got {auto!r}")
            value = 1 if auto == "rank" else _node_but_two_replicas(world_size)
        if value == "node":
            value = ranks_per_node()
        return self if value == self.ranks_per_replica else dataclasses.replace(self, ranks_per_replica=value)


ROUND_SYNC_INTERVALS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)
"""The sync intervals ``sync_interval_for_run`` picks from: round numbers, so that checkpoint and evaluation
intervals can be multiples of them, up to the library's default."""
MEASURED_CONTROLLER_UPDATES = 14
"""The controller updates in the default window of benchmarks/lr_finding.py's default setting (T = 25, 1,500 steps),
where the defaults were measured: ``updates_to_climb`` (10) and four more."""


def sync_interval_for_run(total_steps: int) -> int:
    """The sync interval for a run of ``total_steps`` with the default controller: the largest of
    ``ROUND_SYNC_INTERVALS`` whose window (2% to 25% of the run) holds ``MEASURED_CONTROLLER_UPDATES`` updates, 1
    where none does (a run that short is warned about at start). 5 for 300 steps, 25 for 1,500, 1000 from about
    60,000."""
    for interval in reversed(ROUND_SYNC_INTERVALS):
        if HDETConfig(sync_interval=interval).for_run(total_steps).controller_updates() >= MEASURED_CONTROLLER_UPDATES:
            return interval
    return 1


def _node_but_two_replicas(world_size: int | None) -> int:
    """A node's ranks, or where the whole world is one node, the largest divisor of the world size that leaves
    two replicas or more (the world size over its smallest prime factor; 1 for one rank)."""
    per_node = ranks_per_node()
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size is None or world_size // per_node >= 2 or world_size % per_node:
        return per_node
    smallest_factor = next((f for f in range(2, math.isqrt(world_size) + 1) if world_size % f == 0), world_size)
    return world_size // smallest_factor


REPLICA_SIZE_NAMES = ("auto", "node")


def ranks_per_node() -> int:
    """The launcher's ranks on this node: LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (deepspeed launcher)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) >= 1:
            return int(os.environ[name])
    raise HDETConfigError(
        "ranks_per_replica='node' needs the ranks per node from the launcher (LOCAL_WORLD_SIZE under torchrun, "
        "LOCAL_SIZE under the deepspeed launcher), and neither is set; set ranks_per_replica to a number"
    )


def add_hdet_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--hdet_config PATH`` to a user's parser (next to ``deepspeed.add_config_arguments``)."""
    group = parser.add_argument_group("HDET")
    group.add_argument("--hdet_config", type=str, default=None, metavar="PATH",
                       help="JSON file of HDET settings (spread, sync interval, controller, replica layout)")
    return parser


def load_config(source: HDETConfig | Mapping[str, Any] | str | os.PathLike[str] | argparse.Namespace | None,
                *, world_size: int | None = None) -> HDETConfig:
    """Resolves a config from a config object, a mapping, a JSON path, parsed args or None (defaults).

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
    config.validate(world_size=world_size)
    return config


# ------------------------------------------------------------------------------------------ helpers
def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(values, Mapping):
        raise HDETConfigError(f"{prefix.rstrip('.') or 'hdet config'} must be a JSON object, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        renamed = RENAMED_SETTINGS.get(prefix.rstrip("."), {}).get(key)
        if renamed is not None:
            raise HDETConfigError(f"HDET setting '{prefix}{key}' is now '{prefix}{renamed}' (a step as an int, a share "
                                  "of the run as a float): rename it")
        if key in REMOVED_SETTINGS.get(prefix.rstrip("."), ()):
            raise HDETConfigError(f"HDET setting '{prefix}{key}' was removed (it measured no better than the default "
                                  "controller, see benchmarks/README.md): delete it from the config")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            suggestion = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise HDETConfigError(
                f"unknown HDET setting '{prefix}{key}'{suggestion} Known settings: {', '.join(sorted(fields))}"
            )
        nested = _NESTED.get(cls, {}).get(key)
        kwargs[key] = _build(nested, value, prefix=f"{prefix}{key}.") if nested and value is not None else value
    return cls(**kwargs)


def _nest(config: Any, prefix: str) -> None:
    """Turns the sections of ``config`` given as mappings (``HDETConfig(auto_lr={...})``) into their dataclasses,
    checked as ``from_dict`` checks them; anything else that is not the section's class is refused."""
    for key, section in _NESTED[type(config)].items():
        value = getattr(config, key)
        if isinstance(value, Mapping):
            setattr(config, key, _build(section, value, prefix=f"{prefix}{key}."))
        elif value is not None and not isinstance(value, section):
            raise HDETConfigError(f"{prefix}{key} must be a mapping of settings or an instance of {section.__name__}, "
                                  f"got {value!r}")


_NESTED: dict[type, dict[str, type]] = {
    HDETConfig: {"auto_lr": AutoLRConfig, "warm_init": WarmInitConfig, "explore": ExploreConfig},
    ExploreConfig: {name: KnobConfig for name in ("weight_decay", "dropout", "attention_scale", "label_smoothing")},
}


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HDETConfigError(f"{name} must be true or false, got {value!r}")


def _check_int(name: str, value: Any, *, low: int, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HDETConfigError(f"{name} must be an integer >= {low}{also}, got {value!r}")
    if value < low:
        raise HDETConfigError(f"{name} must be an integer >= {low}{also}, got {value}")


def _is_step(value: Any) -> bool:
    """A controller time given as a step (an int), not a share of the run (a float) nor unset."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_step_or_share(name: str, value: Any, *, low_open: bool = False, high_open: bool = False) -> None:
    """A step (an int >= 0) or a share of the run (a float in [0, 1], ends as given)."""
    if isinstance(value, float):
        _check_number(name, value, low=0.0, high=1.0, low_open=low_open, high_open=high_open,
                      hint="a float is a share of the run; give a step as an int")
    else:
        _check_int(name, value, low=0, also=" (a step) or a float in [0, 1] (a share of the run)")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise HDETConfigError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def _check_number(name: str, value: Any, *, low: float, high: float | None = None,
                  low_open: bool = False, high_open: bool = False, hint: str = "") -> None:
    lo = f"{'(' if low_open else '['}{low}"
    hi = f"{high}{')' if high_open else ']'}" if high is not None else "inf)"
    allowed = f"{name} must be a number in {lo}, {hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HDETConfigError(f"{allowed}, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise HDETConfigError(f"{allowed}, got {value}" + (f" ({hint})" if hint else ""))
