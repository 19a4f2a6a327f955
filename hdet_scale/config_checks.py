"""The checks an HDET setting goes through: each names the field, the allowed values and the value it got."""

from __future__ import annotations

import math
from typing import Any


class HDETConfigError(ValueError):
    """A bad HDET setting: the message names the field, the allowed values and how to fix it."""


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HDETConfigError(f"{name} must be true or false, got {value!r}")


def check_int(name: str, value: Any, *, low: int, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HDETConfigError(f"{name} must be an integer >= {low}{also}, got {value!r}")
    if value < low:
        raise HDETConfigError(f"{name} must be an integer >= {low}{also}, got {value}")


def is_step(value: Any) -> bool:
    """A controller time given as a step (an int), not a share of the run (a float) nor unset."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_step_or_share(name: str, value: Any, *, low_open: bool = False, high_open: bool = False) -> None:
    """A step (an int >= 0) or a share of the run (a float in [0, 1], ends as given)."""
    if isinstance(value, float):
        check_number(name, value, low=0.0, high=1.0, low_open=low_open, high_open=high_open,
                     hint="a float is a share of the run; give a step as an int")
    else:
        shares = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        check_int(name, value, low=0, also=f" (a step) or a float in {shares} (a share of the run)")


def check_window_order(start: Any, stop: Any, *, given: tuple[Any, Any] | None = None) -> None:
    """Raises HDETConfigError when the controller's ``stop`` comes before its ``start`` (both steps, or both shares
    of the run); ``given`` is what the config said where these are its steps for a run."""
    if start is None or stop is None or is_step(start) != is_step(stop) or stop >= start:
        return
    said = given or (start, stop)
    steps = f" (step {stop} before step {start})" if given else ""
    raise HDETConfigError(
        f"auto_lr.stop={said[1]!r} comes before auto_lr.start={said[0]!r}{steps}: an int is a step and a float a "
        "share of the run (1.0: its end); set the stop after the start")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise HDETConfigError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def check_number(name: str, value: Any, *, low: float, high: float | None = None,
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
