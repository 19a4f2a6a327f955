"""``HDETConfig.validate``'s rules as data: the range of every number, the choices of every name, and the settings
that cannot go together. Each failing rule raises one ``HDETConfigError`` naming the field and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

from hdet_scale.config_checks import (
    HDETConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_step_or_share,
    check_window_order,
)

GradientMode = Literal["global", "local"]
ControllerMode = Literal["scale", "paper", "log"]
Spread = Literal["linear", "log"]
ReplicaSizeName = Literal["auto", "node"]
GRADIENT_MODES: tuple[str, ...] = get_args(GradientMode)
CONTROLLER_MODES: tuple[str, ...] = get_args(ControllerMode)
SPREADS: tuple[str, ...] = get_args(Spread)
REPLICA_SIZE_NAMES: tuple[str, ...] = get_args(ReplicaSizeName)
MIN_RANGE_TEST_STEPS = 13
"""The fewest steps a range test may have: its pick leaves out its first 10 and its last step."""
KNOB_NAMES = ("weight_decay", "dropout", "attention_scale", "label_smoothing")
FORWARD_KNOBS = ("dropout", "attention_scale", "label_smoothing")
"""Explored values that act in the forward pass or the loss, not in the optimizer step: a replica's own value shapes
its weights only where it averages its gradients alone (``gradient_mode`` 'local')."""
PROBE_ONLY_KNOBS = ("dropout", "label_smoothing")
"""Explored values that a replica's training loss grows with whatever they are worth (dropout's noise, smoothed
targets): the controller compares them on the probe batch alone, where neither acts."""


class Range(NamedTuple):
    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False


NUMBER_RANGES: dict[str, Range] = {
    "bucket_mb": Range(0.0, low_open=True),
    "auto_lr.beta": Range(0.0, 1.0, high_open=True),
    "auto_lr.sigma": Range(0.0, low_open=True),
    "auto_lr.step_size": Range(0.0),
    "auto_lr.scale_min": Range(0.0, low_open=True),
    "auto_lr.probe_weight": Range(0.0, 1.0),
    "auto_lr.max_log_step": Range(0.0, low_open=True),
    "auto_lr.rise_only_after": Range(0.0, 1.0),
    "auto_lr.initial_scale": Range(0.0, low_open=True),
    "warm_init.nu": Range(0.0),
}
"""Every number's allowed range, checked on the values the run uses (a mode's defaults included)."""
OPTIONAL_NUMBER_RANGES: dict[str, Range] = {"auto_lr.average_window": Range(0.0, 1.0, high_open=True)}
"""Numbers that may also be null (their default then depends on the run)."""
CHOICES: dict[str, tuple[str, ...]] = {"spread": SPREADS, "gradient_mode": GRADIENT_MODES,
                                       "auto_lr.mode": CONTROLLER_MODES}
BOOLS = ("average_optimizer_state", "auto_lr.enabled", "warm_init.enabled")


class Conflict(NamedTuple):
    """Settings that cannot go together: ``applies(given, filled)`` on the auto-LR section as given and with the
    mode's defaults filled in; ``message(given, filled)`` names the fields and the fix."""

    applies: Callable[[Any, Any], bool]
    message: Callable[[Any, Any], str]


def _paper_or_off(lr: Any) -> bool:
    return lr.mode == "paper" or not lr.enabled


def _default_of(given: Any, lr: Any) -> str:
    """Where the initial scale comes from when the user did not give it."""
    if given.initial_scale is not None:
        return ""
    return " (the LR range test's pick)" if lr.range_test else f" (the '{lr.mode}' mode's default)"


AUTO_LR_CONFLICTS: tuple[Conflict, ...] = (
    Conflict(lambda given, lr: lr.mode == "paper" and given.stop is not None,
             lambda given, lr: "auto_lr.stop works in 'scale' and 'log' mode; the paper's controller also decays the "
                               "LR (eq. 8): remove it or choose another mode"),
    Conflict(lambda given, lr: 0 < lr.range_test < MIN_RANGE_TEST_STEPS,
             lambda given, lr: f"auto_lr.range_test={lr.range_test}: a range test needs at least "
                               f"{MIN_RANGE_TEST_STEPS} steps (100 is usual); 0 turns it off"),
    Conflict(lambda given, lr: lr.range_test and lr.mode == "paper",
             lambda given, lr: "auto_lr.range_test picks the LR, and the paper's controller owns it (eq. 8): set "
                               "auto_lr.range_test to 0 or choose another mode"),
    Conflict(lambda given, lr: lr.range_test and given.initial_scale not in (None, 1.0),
             lambda given, lr: f"auto_lr.initial_scale={given.initial_scale} and the LR range test "
                               f"(auto_lr.range_test={lr.range_test}) both set where the LR starts: remove "
                               "initial_scale (the test picks the LR), or set range_test to 0 for the controller to "
                               "start from it"),
    Conflict(lambda given, lr: given.initial_scale not in (None, 1.0) and _paper_or_off(given),
             lambda given, lr: f"auto_lr.initial_scale={given.initial_scale} needs the controller on in 'scale' or "
                               "'log' mode (else the LR would stay at that scale): set it to 1 or turn auto_lr on"),
    Conflict(lambda given, lr: lr.rise_only_after < 1.0 and lr.mode == "paper",
             lambda given, lr: f"auto_lr.rise_only_after={lr.rise_only_after} works in 'scale' and 'log' mode; the "
                               "paper's controller keeps eq. 7 as printed: set it to 1 (off) or choose another mode"),
    Conflict(lambda given, lr: lr.rise_only_after < 1.0 and lr.stop is None,
             lambda given, lr: f"auto_lr.rise_only_after={lr.rise_only_after} is a share of the controller's window "
                               "up to its stop: give auto_lr.stop, or set it to 1 (off)"),
    Conflict(lambda given, lr: not lr.scale_min <= lr.initial_scale <= lr.scale_max,
             lambda given, lr: f"auto_lr.scale_min={lr.scale_min} and auto_lr.scale_max={lr.scale_max} must bracket "
                               f"auto_lr.initial_scale={lr.initial_scale:g}{_default_of(given, lr)}, where the "
                               "controller starts (1: the base schedule): lower scale_min or raise scale_max"),
)
"""Checked in this order, after the types and ranges of the fields they read."""


def validate(config: Any, filled_auto_lr: Any) -> None:
    """Raises HDETConfigError naming the first bad field of ``config`` (an ``HDETConfig``); ``filled_auto_lr`` is
    its auto-LR section with the mode's defaults filled in, the values the controller runs with."""
    given = config.auto_lr
    sections = {"": config, "auto_lr": filled_auto_lr, "warm_init": config.warm_init}

    def value(path: str) -> Any:
        section, _, name = path.rpartition(".")
        return getattr(sections[section], name)

    for path in BOOLS:
        check_bool(path, value(path))
    for path, choices in CHOICES.items():
        check_choice(path, value(path), choices)
    _check_layout(config)  # after the choices: a misspelt spread is named as such, not as the alpha it would allow
    if config.metrics_path is not None and not (isinstance(config.metrics_path, str) and config.metrics_path):
        raise HDETConfigError(f"metrics_path must be a file path string or null (no metrics file), got "
                              f"{config.metrics_path!r}")
    for name, options in (("start", {"high_open": True}), ("stop", {"low_open": True})):
        if getattr(given, name) is not None:
            check_step_or_share(f"auto_lr.{name}", getattr(given, name), **options)
    if isinstance(filled_auto_lr.start, float) and filled_auto_lr.moves_any(config.explore.any_given):
        check_window_order(filled_auto_lr.start, filled_auto_lr.stop)  # steps are checked for the run (for_run)
    if given.range_test is not None:
        check_int("auto_lr.range_test", given.range_test, low=0, also=" (its steps, 100 is usual; 0: no test)")
    for path, allowed in NUMBER_RANGES.items():
        check_number(path, value(path), **allowed._asdict())
    for path, allowed in OPTIONAL_NUMBER_RANGES.items():
        if value(path) is not None:
            check_number(path, value(path), **allowed._asdict())
    check_number("auto_lr.scale_max", filled_auto_lr.scale_max, low=filled_auto_lr.scale_min,
                 hint="scale_max must be at least auto_lr.scale_min")
    for conflict in AUTO_LR_CONFLICTS:
        if conflict.applies(given, filled_auto_lr):
            raise HDETConfigError(conflict.message(given, filled_auto_lr))
    lr = filled_auto_lr
    if config.alpha == 0 and lr.moves_lr and lr.initial_scale != 1.0 and lr.scale_min < lr.scale_max:
        raise HDETConfigError(  # a scale held on purpose (scale_min = scale_max) is the user's to choose
            "alpha=0 leaves the auto-LR controller no spread of LRs to compare, so it would never move the LR from "
            f"auto_lr.initial_scale={lr.initial_scale:g}{_default_of(given, lr)} times the given LR for the whole "
            "run: set alpha > 0, or auto_lr.initial_scale to 1 (the given LR)")
    _check_explored(config)
    _check_scale_steps(config, lr)
    _check_forward_knobs(config, lr)


def check_spread_alpha(name: str, alpha: Any, spread: str, *, explored: bool = False) -> None:
    """Raises HDETConfigError unless ``alpha`` (the setting ``name``) gives ``spread`` positive multipliers; an
    ``explored`` value's alpha must also be above 0, or nothing would be explored."""
    high = None if spread == "log" else 1.0  # log: multipliers in [1/(1 + alpha), 1 + alpha], positive for any alpha
    hint = "" if high is None else "alpha >= 1 makes the lowest multiplier 1 - alpha <= 0; spread 'log' allows it"
    if explored and alpha == 0:
        hint = "0 explores nothing: give a spread above 0, or explore it no more"
    elif isinstance(alpha, (int, float)) and alpha < 0:
        hint = "a spread ratio is never negative"
    check_number(name, alpha, low=0.0, low_open=explored, high=high, high_open=True, hint=hint)


def _check_layout(config: Any) -> None:
    """The spread's ratio, the sync interval, the replica size and the seed."""
    if config.alpha is not None:  # unset: its defaults are in range
        check_spread_alpha("alpha", config.alpha, config.spread)
    check_int("sync_interval", config.sync_interval, low=1)
    if config.ranks_per_replica not in REPLICA_SIZE_NAMES:
        check_int("ranks_per_replica", config.ranks_per_replica, low=1,
                  also=" or one of " + ", ".join(repr(name) for name in REPLICA_SIZE_NAMES))
    check_int("seed", config.seed, low=0)


def _check_explored(config: Any) -> None:
    """Each explored value's spread ratio (its own, or the top-level ``alpha`` it takes) and base: label smoothing
    needs one, the others read theirs."""
    for name in KNOB_NAMES:
        knob = getattr(config.explore, name)
        if knob is None:
            continue
        if knob.alpha is not None:
            check_spread_alpha(f"explore.{name}.alpha", knob.alpha, config.spread, explored=True)
        elif config.alpha == 0:
            raise HDETConfigError(f"explore.{name} takes alpha=0 from the top-level alpha, which explores nothing: "
                                  f"give explore.{name}.alpha > 0, or remove explore.{name}")
        if name == "label_smoothing":
            if knob.base is None:
                raise HDETConfigError("explore.label_smoothing.base is required: the label smoothing to start "
                                      "from, in (0, 1)")
            check_number("explore.label_smoothing.base", knob.base, low=0.0, high=1.0, low_open=True, high_open=True,
                         hint="the replicas explore multiples of it, and every multiple of 0 is 0")
        elif knob.base is not None:
            raise HDETConfigError(f"explore.{name}.base is not used: {name} takes its base value from the "
                                  "optimizer or the model; remove it")


def largest_fall(alpha: float, spread: str) -> float:
    """The most a ``scale``-mode velocity can fall below 0 (eqs. 5-7 over the mean multiplier: ``v`` is a momentum
    average of ``sum_r w_r rho_r / mean rho - 1``, at least ``rho_min / mean rho - 1``): ``alpha`` on a linear
    spread (eq. 1: ``rho_min = 1 - alpha``, mean 1), ``1 - 2 / ((1 + alpha)^2 + 1)`` on a log spread, whose two
    replicas at ``(1 + alpha)^-1`` and ``1 + alpha`` put the lowest furthest below the mean."""
    if spread == "log":
        return 1.0 - 2.0 / ((1.0 + alpha) ** 2 + 1.0)
    return alpha


def _check_scale_steps(config: Any, lr: Any) -> None:
    """Every value moved in ``scale`` mode (the LR in that mode; the others there and in ``paper`` mode) passes
    ``check_scale_step``."""
    moved = [("alpha", config.spread_alpha(lr=True))] if lr.mode == "scale" and lr.moves_lr else []
    for name in config.explore.given(KNOB_NAMES):
        knob = getattr(config.explore, name)
        moved.append((f"explore.{name}.alpha" if knob.alpha is not None else "alpha",
                      knob.alpha if knob.alpha is not None else config.spread_alpha(lr=False)))
    for field, alpha in moved:
        check_scale_step(lr, alpha, config.spread, field)


def check_scale_step(lr: Any, alpha: float, spread: str, field: str) -> None:
    """Raises unless ``step_size * largest_fall <= 1`` for a value of spread ratio ``alpha`` (the setting ``field``)
    that the auto-LR section ``lr`` (its mode's defaults filled in) moves by a scale, as it moves every value but the
    LR where it is on in ``scale`` or ``paper`` mode: else one sync in which the lowest replica wins multiplies the
    scale by ``1 + step_size * v < 0``, which the floor turns into a jump to ``scale_min``."""
    if not lr.enabled or lr.mode == "log":
        return
    fall = largest_fall(alpha, spread)
    if lr.step_size * fall > 1.0:
        raise HDETConfigError(
            f"auto_lr.step_size={lr.step_size:g} with {field}={alpha:g} (spread '{spread}') lets one sync "
            f"in which the lowest replica wins multiply the value's scale by 1 - {lr.step_size:g} x {fall:.3g} < 0 "
            f"('{lr.mode}' mode moves it by 1 + step_size x velocity): keep auto_lr.step_size at most "
            f"{1.0 / fall:.3g}, lower the spread, or use mode 'log'")


def _check_forward_knobs(config: Any, lr: Any) -> None:
    """``FORWARD_KNOBS`` explored in ``local`` gradient mode only; ``PROBE_ONLY_KNOBS`` moved by the controller on the
    probe alone (``auto_lr.probe_weight`` 1)."""
    explored = config.explore.given(FORWARD_KNOBS)
    if explored and config.gradient_mode != "local":
        name = explored[0]
        raise HDETConfigError(
            f"explore.{name} needs \"gradient_mode\": \"local\": in '{config.gradient_mode}' mode every replica steps "
            f"with the mean gradient of all replicas, so its own {name.replace('_', ' ')} does not shape its weights "
            "and no loss can tell the values apart; set gradient_mode to 'local' (each replica averages its gradients "
            f"alone, and the replicas meet at each sync), or remove explore.{name}")
    scored = config.explore.given(PROBE_ONLY_KNOBS)
    if scored and lr.enabled and lr.probe_weight != 1.0:
        raise HDETConfigError(
            f"explore.{scored[0]} is scored on the probe batch alone (a replica's training loss rises with its own "
            f"{scored[0].replace('_', ' ')}, whatever it is worth): set auto_lr.probe_weight to 1, not "
            f"{lr.probe_weight:g}")
