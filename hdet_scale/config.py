"""HDET's settings: frozen dataclasses, checked when made (``docs/configuration.md`` says what each does and why).

The defaults are those measured best in ``benchmarks/lr_finding_matrix.py``: an LR range test at the start of the
run, after which every replica trains at 0.7 times the LR it picked, where the LR holds (no spread: nothing would
read it); with ``auto_lr.range_test`` 0 the scale-free ``log`` controller moves the LR instead, reading a log
spread. ``HDETConfig.paper()`` gives the
paper's settings; fields carry the paper's symbols (arXiv 2604.24708, section 3). Unknown keys are errors (one an
earlier version had is refused as removed or renamed), and a config that breaks a rule is never made: the
``HDETConfigError`` names the field, the allowed range and the value. A config cannot change once made (a changed
copy, ``dataclasses.replace``, is checked again), so one checked at the front door is the one every part reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdet_scale import config_rules
from hdet_scale.config_checks import HDETConfigError, check_int, check_window_order
from hdet_scale.config_rules import ControllerMode, GradientMode, ReplicaSizeName, Spread

__all__ = ["AutoLRConfig", "ExploreConfig", "HDETConfig", "HDETConfigError", "KnobConfig", "WarmInitConfig"]

MODE_DEFAULTS: dict[str, dict[str, float | None]] = {
    "log": {"beta": 0.5, "sigma": 1.0, "step_size": 2.5, "initial_scale": 0.1, "start": 0.02,
            "stop": 0.25, "rise_only_after": 0.43},
    "scale": {"beta": 0.9, "sigma": 0.1, "step_size": 0.5, "initial_scale": 1.0, "start": 0.05,
              "stop": None, "rise_only_after": 1.0},
    "paper": {"beta": 0.9, "sigma": 0.1, "step_size": 0.5, "initial_scale": 1.0, "start": 0.05,
              "stop": None, "rise_only_after": 1.0},
}
"""The unset controller fields per mode: ``log``'s from benchmarks/lr_finding.py (its climb from a tenth of the LR
starts early, inside a usual LR warm-up), ``scale``'s and ``paper``'s the paper's (eqs. 4, 7) with the start at 5%
of the run (the paper's S_warm is a fixed 100,000 steps)."""
WINDOW_FIELDS = ("start", "stop")
"""The controller's start and stop: a step (an int), or a share of the run (a float) that ``HDETConfig.for_run``
turns into a step."""
DEFAULT_RANGE_TEST_STEPS = 100
"""``range_test`` when unset (outside ``paper`` mode): the steps Lightning's and fastai's LR finders take."""
DEFAULT_ALPHA = 0.5
"""``alpha`` when unset, for the values a controller moves."""
DEFAULT_AVERAGE_WINDOW = 0.25
"""``average_window`` when unset, in ``log`` mode with a probe."""
REMOVED_SETTINGS: dict[str, tuple[str, ...]] = {
    "auto_lr": ("hold_average", "average_window_late", "displacement", "hypergradient", "progress_target",
                "bias_correction"),
}
"""Settings of earlier versions that measured no better than the default controller (benchmarks/README.md): a
config naming one is refused with that reason, not read as a misspelling."""
RENAMED_SETTINGS: dict[str, dict[str, str]] = {
    "auto_lr": {"warmup_steps": "start", "start_fraction": "start", "stop_steps": "stop", "stop_fraction": "stop"},
}
"""Settings of earlier versions now given under another name: a config naming one is refused with the new one."""


@dataclass(frozen=True)
class AutoLRConfig:
    """The auto-LR controller (paper eqs. 4-9). A field left null takes its mode's default (``MODE_DEFAULTS``)."""

    enabled: bool = True
    """Move the base values from the replicas' relative losses. Off: spread and averaging only."""

    mode: ControllerMode = "log"
    """``log`` (scale-free: z-scored losses, a step in log space, at most ``max_log_step`` a sync), ``scale`` (a
    multiplicative scale on the base schedule, eqs. 4-7) or ``paper`` (eqs. 7-8: after the start the controller
    owns the base value and decays it to OneCycleLR's floor)."""

    start: int | float | None = None
    """When the controller starts updating (the spread applies from step 0): a step (an int; the paper's S_warm)
    or a share of the run (a float in [0, 1)). A share needs the run's length (``total_steps``)."""

    stop: int | float | None = None
    """When the controller stops and holds its values (the spread and averaging go on): a step or a share of the
    run in (0, 1] (1.0: never). Not with ``paper`` mode, whose controller also decays the LR."""

    rise_only_after: float | None = None
    """The share of the controller's window (start to stop) after which it only raises the LR, in [0, 1] (1:
    never). Needs a stop; not with ``paper`` mode."""

    beta: float | None = None
    """beta: momentum of the velocity (eq. 7), in [0, 1)."""

    sigma: float | None = None
    """sigma: softmax temperature on loss differences (eq. 4), > 0 (``log`` mode: in units of their spread)."""

    step_size: float | None = None
    """lambda: how far one sync moves the base along the velocity (eq. 7), >= 0."""

    scale_min: float = 0.1
    """Floor of the scale (``scale`` and ``log`` mode), relative to the base schedule; at it, the controller's
    velocity pointing lower is dropped."""

    range_test: int | None = None
    """Steps of the LR range test the run starts with, 0 (none) or at least 13 (``hdet_scale.range_test``): the run
    then trains with the replicas' mean LR at 0.7 times the picked LR (``MEAN_LR_OVER_PICK``), where it holds
    (the controller moves only the other explored values). Its steps come before the run's. Unset: 100, and 0 in
    ``paper`` mode or with the controller off."""

    initial_scale: float | None = None
    """The LR's scale from the first step (``scale`` and ``log`` mode), in [scale_min, scale_max]; needs the
    controller on and no range test. Unset: 0.1 in ``log`` mode with the controller on and no range test (it
    climbs from there), else 1."""

    scale_max: float = 10.0
    """Ceiling of the scale (``scale`` and ``log`` mode), >= scale_min; at it, the velocity pointing higher is
    dropped."""

    max_log_step: float = 0.5
    """``log`` mode: the largest change of log(scale) at one sync (0.5: x1.65 or /1.65), > 0."""

    average_window: float | None = None
    """With a probe set: score each replica's weights averaged over this last share of the interval, in [0, 1)
    (0: the last iterate). Unset: 0.25 in ``log`` mode with the controller on and a probe set, else 0."""

    probe_weight: float = 1.0
    """With a probe set: the weight of the probe-batch losses in the controller's signal, in [0, 1]; the interval
    training losses get the rest."""

    def filled(self) -> AutoLRConfig:
        """This config with every unset field at its mode's default: what the controller runs with. The config
        itself keeps them None, so a dict of overrides merged onto it is read as given."""
        defaults = MODE_DEFAULTS.get(self.mode, MODE_DEFAULTS["scale"])  # an unknown mode: validate names it
        changes: dict[str, Any] = {name: defaults[name] for name in ("beta", "sigma", "step_size", "rise_only_after",
                                                                     *WINDOW_FIELDS) if getattr(self, name) is None}
        if self.range_test is None:
            # the controller off leaves the LR given ("spread and averaging only") unless a test is asked for
            changes["range_test"] = 0 if self.mode == "paper" or not self.enabled else DEFAULT_RANGE_TEST_STEPS
        if self.initial_scale is None:  # after a range test the scale starts at its pick: 1 relative to it
            starts_below = self.enabled is True and not changes.get("range_test", self.range_test)
            changes["initial_scale"] = defaults["initial_scale"] if starts_below else 1.0
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def moves_lr(self) -> bool:
        """Whether the controller moves the LR: it is on and no range test picked the LR (``filled`` applied)."""
        return self.enabled is True and not self.range_test

    def moves_any(self, explores_others: bool) -> bool:
        """Whether the controller moves some value: the LR (``moves_lr``), or, where it is on, the other explored
        values (``explores_others``: there are some)."""
        return self.moves_lr or (self.enabled is True and explores_others)

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


@dataclass(frozen=True)
class WarmInitConfig:
    """Warm noisy initialization (paper eq. 10)."""

    enabled: bool = False
    """Add per-replica Gaussian noise to the starting weights before the first fan-out."""

    nu: float = 0.01
    """nu: noise std relative to the RMS of all parameters, ||theta0|| / sqrt(d), >= 0."""


@dataclass(frozen=True)
class KnobConfig:
    """One explored hyperparameter besides the LR (paper Remark 1)."""

    alpha: float | None = None
    """Its spread ratio (eq. 1), above 0 (below 1 on a linear spread); null: the top-level ``alpha``
    (``DEFAULT_ALPHA`` where that is unset)."""

    base: float | None = None
    """``label_smoothing`` only: the base value. The others take theirs from the optimizer or the model."""


@dataclass(frozen=True)
class ExploreConfig:
    """Hyperparameters explored besides the LR, each with its own spread, permutation and controller:
    ``weight_decay`` (per param group, applied inside ``optimizer.step()``), ``dropout`` (a factor on every dropout
    probability), ``attention_scale`` (a factor on transformers attention's softmax scale) and ``label_smoothing``
    (a value the loss reads with ``hdet.value("label_smoothing")``)."""

    weight_decay: KnobConfig | None = None
    dropout: KnobConfig | None = None
    attention_scale: KnobConfig | None = None
    label_smoothing: KnobConfig | None = None

    def __post_init__(self) -> None:
        _nest(self, "explore.")

    @property
    def any_given(self) -> bool:
        """Whether some value besides the LR is explored here."""
        return bool(self.given(config_rules.KNOB_NAMES))

    def given(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` explored here, in their order."""
        return [name for name in names if getattr(self, name) is not None]


@dataclass(frozen=True)
class HDETConfig:
    """Everything HDET needs besides the model, optimizer and schedule."""

    alpha: float | None = None
    """alpha: spread ratio of the explored values' multipliers (eq. 1), in [0, 1) (``spread="log"``: any alpha >=
    0); 0: every replica at the same value (with the controller off, plain data parallel). Unset: no spread for an
    LR that the LR range test picks (``auto_lr.range_test``, the default): nothing reads that LR's spread, and at
    the same mean LR a spread costs held-out loss; else 0.5 (``DEFAULT_ALPHA``), for the values a controller moves
    and for every value with the controller off. The paper's: 1/9 with a linear spread."""

    spread: Spread = "log"
    """``linear``: eq. 1's [1 - alpha, 1 + alpha] (arithmetic mean 1); ``log``: evenly in log space over
    [1/(1 + alpha), 1 + alpha] (geometric mean 1: as far up as down)."""

    sync_interval: int = 1000
    """T: optimizer steps between parameter averages (eq. 3), >= 1."""

    ranks_per_replica: int | ReplicaSizeName = "auto"
    """Ranks that form one replica: a divisor of the world size, ``"node"`` (the launcher's ranks per node) or
    ``"auto"`` (1 for DDP and ZeRO-0, a node for sharded engines, half a single node)."""

    gradient_mode: GradientMode = "global"
    """``global``: gradients averaged over all ranks every step (eq. 2). ``local``: only inside a replica; replicas
    meet only at syncs (local SGD with an LR spread)."""

    seed: int = 0
    """Seed of HDET's own generators (permutations, warm-init noise); the global RNG is never touched."""

    bucket_mb: float = 25.0
    """Size in MiB of the flat fp32 buckets used to average parameters, > 0."""

    average_optimizer_state: bool = False
    """Also average the optimizer's floating-point state (e.g. Adam's moments) at each sync."""

    metrics_path: str | None = None
    """JSON-lines file written by global rank 0, one line per sync; None disables it."""

    auto_lr: AutoLRConfig = field(default_factory=AutoLRConfig)
    warm_init: WarmInitConfig = field(default_factory=WarmInitConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)

    def __post_init__(self) -> None:
        _nest(self, "")
        self.validate()  # frozen and checked once: a config that exists is valid, and stays as it was checked

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> HDETConfig:
        """Builds (and so validates) a config from a (possibly nested) mapping; unknown keys are errors."""
        return _build(cls, values, prefix="")

    @classmethod
    def paper(cls, **changes: Any) -> HDETConfig:
        """The paper's settings (section 4): alpha 1/9 on a linear spread, T = 1000, the ``paper`` controller
        from step 100,000 with sigma 0.1 and lambda 0.5; ``changes`` on top, as ``changed`` takes them
        (``paper(auto_lr={"start": 5000})`` keeps the paper's controller)."""
        return cls(alpha=1.0 / 9.0, spread="linear", sync_interval=1000,
                   auto_lr=AutoLRConfig(mode="paper", start=100_000)).changed(**changes)

    def changed(self, **changes: Any) -> HDETConfig:
        """This config with ``changes`` on top (validated): a section given as a mapping changes the fields it names
        (``auto_lr={"start": 5000}``), one given as its dataclass (``AutoLRConfig(...)``) replaces the section, any
        other value replaces its field."""
        merged = self.to_dict()
        for key, value in changes.items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                merged[key] = dataclasses.asdict(value)
            elif isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        return type(self).from_dict(merged)

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

    def spread_alpha(self, *, lr: bool) -> float:
        """The spread ratio of the LR's multipliers (``lr``) or of another explored value's without its own:
        ``alpha``, or where unset its default (see ``alpha``)."""
        if self.alpha is not None:
            return self.alpha
        return 0.0 if lr and self.auto_lr.filled().range_test else DEFAULT_ALPHA

    def validate(self) -> None:
        """Raises HDETConfigError naming the first bad field (``hdet_scale.config_rules``); run when a config is
        made. The replica layout against a world size is ``hdet_scale.resolve``'s."""
        config_rules.validate(self, self.auto_lr.filled())

    def for_run(self, total_steps: int) -> HDETConfig:
        """This config for a run of ``total_steps`` optimizer steps: ``auto_lr.start`` and ``stop`` given as shares
        of the run become steps (rounded), the unset controller fields their mode's defaults."""
        lr = self.auto_lr.filled()
        shares = [name for name in WINDOW_FIELDS if isinstance(getattr(lr, name), float)]
        if shares:
            check_int("total_steps (the run's length, for auto_lr." + "/".join(shares) + " given as a share of it)",
                      total_steps, low=1)
        run_lr = dataclasses.replace(lr, **{name: round(getattr(lr, name) * total_steps) for name in shares})
        # a start past the run's end keeps the controller off, as does a controller with nothing to move: no window
        if run_lr.start < total_steps and run_lr.moves_any(self.explore.any_given):
            check_window_order(run_lr.start, run_lr.stop, given=(lr.start, lr.stop) if shares else None)
        if not shares:
            return self if lr is self.auto_lr else dataclasses.replace(self, auto_lr=lr)
        return dataclasses.replace(self, auto_lr=run_lr)


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(values, Mapping):
        section = prefix.rstrip(".") or "hdet config"
        example = ' ({}: its defaults; or e.g. {"alpha": 0.5})' if cls is KnobConfig else ""
        raise HDETConfigError(f"{section} must be a JSON object{example}, got {values!r}")
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
            raise HDETConfigError(_unknown_setting(cls, key, prefix, sorted(fields)))
        nested = _NESTED.get(cls, {}).get(key)
        kwargs[key] = _build(nested, value, prefix=f"{prefix}{key}.") if nested and value is not None else value
    return cls(**kwargs)


def _unknown_setting(cls: type, key: str, prefix: str, known: list[str]) -> str:
    """The error for ``key``, not a setting of ``cls``: where it belongs when it is a section's setting written flat
    (``"auto_lr.range_test"``, or ``"range_test"`` at the top), else the closest known name."""
    sections = _NESTED.get(cls, {})
    head, _, rest = key.partition(".")
    owner = next((name for name, section in sections.items() if dataclasses.is_dataclass(section)
                  and key in {field.name for field in dataclasses.fields(section)}), None)
    if rest and head in sections:
        hint = f": settings of '{prefix}{head}' go inside it, {{\"{head}\": {{\"{rest}\": ...}}}}"
    elif owner is not None:
        hint = f": it is a setting of '{prefix}{owner}', written {{\"{owner}\": {{\"{key}\": ...}}}}"
    else:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    where = f" of '{prefix.rstrip('.')}'" if prefix else ""
    return f"unknown HDET setting '{prefix}{key}'{hint}. Known settings{where}: {', '.join(known)}"


def _nest(config: Any, prefix: str) -> None:
    """Turns the sections of ``config`` given as mappings (``HDETConfig(auto_lr={...})``) into their dataclasses,
    checked as ``from_dict`` checks them; anything else that is not the section's class is refused."""
    for key, section in _NESTED[type(config)].items():
        value = getattr(config, key)
        if isinstance(value, Mapping):
            object.__setattr__(config, key, _build(section, value, prefix=f"{prefix}{key}."))  # still being made
        elif value is None and type(config) is HDETConfig:  # only a knob under explore may be null (not explored)
            raise HDETConfigError(f"{prefix}{key} must be a mapping of settings, got null: leave it out for its "
                                  "defaults")
        elif value is not None and not isinstance(value, section):
            raise HDETConfigError(f"{prefix}{key} must be a mapping of settings or an instance of {section.__name__}, "
                                  f"got {value!r}")


_NESTED: dict[type, dict[str, type]] = {
    HDETConfig: {"auto_lr": AutoLRConfig, "warm_init": WarmInitConfig, "explore": ExploreConfig},
    ExploreConfig: {name: KnobConfig for name in config_rules.KNOB_NAMES},
}
