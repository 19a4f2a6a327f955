"""Scalar hyperparameters HDET explores besides the LR (paper Remark 1): where each one lives and how it is set.

A knob has a base value (from the optimizer, the model or the config), bounds, and a way to give this
replica its own value. The ensemble owns the spread, the permutation and the controller of every knob; a
knob only answers "what is the base now" and "set this replica's value".

* Optimizer knobs (``lr``, ``weight_decay`` of a param group) are applied for the duration of
  ``optimizer.step()`` only, like the LR (schedulers write the base value every step).
* Model knobs (``dropout``, ``attention_scale``) are factors on each module's own configured value, applied
  at every re-assignment (start and every sync).
* Value knobs (``label_smoothing``, user knobs) hold a value the training code reads back (a getter) or
  push it through a user setter.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hdet_scale.config import ExploreConfig, HDETConfigError
from hdet_scale.config_rules import KNOB_NAMES


@dataclass(frozen=True)
class Bounds:
    """Where a knob's values may lie; values outside are clamped (an open end stays a hair inside)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def clamp(self, value: float) -> float:
        low = math.nextafter(self.low, math.inf) if self.low_open else self.low
        high = math.nextafter(self.high, -math.inf) if self.high_open else self.high
        return min(max(value, low), high)


POSITIVE = Bounds(low=0.0, low_open=True)
NON_NEGATIVE = Bounds(low=0.0)
PROBABILITY = Bounds(low=0.0, high=1.0, high_open=True)


class Knob:
    """One explored scalar. ``step_scoped`` knobs are set by the optimizer hooks (``group_index``, ``key``);
    the others by ``apply``."""

    step_scoped = False

    def __init__(self, name: str, bounds: Bounds, alpha: float | None = None) -> None:
        self.name = name
        self.bounds = bounds
        self.alpha = alpha
        """Spread ratio of this knob (eq. 1); None: the config's ``alpha``."""

    @property
    def is_lr(self) -> bool:
        """Whether this knob is a param group's LR."""
        return False

    def scheduled(self) -> float:
        """The base value now (before the controller's scale and the replica's multiplier)."""
        raise NotImplementedError

    def apply(self, value: float) -> None:
        """Gives this replica ``value`` (called at the start and after every sync)."""


class OptimizerGroupKnob(Knob):
    """``optimizer.param_groups[group_index][key]`` (``lr``, ``weight_decay``), set inside ``step()`` only."""

    step_scoped = True

    def __init__(self, name: str, optimizer: torch.optim.Optimizer, group_index: int, key: str, bounds: Bounds,
                 alpha: float | None = None) -> None:
        super().__init__(name, bounds, alpha)
        if key not in optimizer.param_groups[group_index]:
            raise HDETConfigError(f"cannot explore '{key}': param group {group_index} of "
                                  f"{type(optimizer).__name__} has no '{key}'")
        self.optimizer = optimizer
        self.group_index = group_index
        self.key = key

    @property
    def is_lr(self) -> bool:
        return self.key == "lr"

    def scheduled(self) -> float:
        return float(self.optimizer.param_groups[self.group_index][self.key])


_WRITTEN: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[float, float]]] = weakref.WeakKeyDictionary()
"""Per module, each attribute a ``ModuleFactorKnob`` set: the value it set a factor of, and the value it wrote. Kept
for the module's life, across ensembles: a later fit's ensemble (the Trainer's, Lightning's) finds the value the
found factor of an earlier one was written on, not that factor times it."""


def _unfactored(module: nn.Module, attribute: str) -> float:
    """The value of ``module.attribute`` a factor applies to: the one a knob last wrote a factor of, where the
    attribute still holds what it wrote; else the attribute's own (never set by a knob, or set by the user's code
    since, a dropout schedule)."""
    current = float(getattr(module, attribute))
    original, written = _WRITTEN.get(module, {}).get(attribute, (current, math.nan))
    return original if written == current else current


class ModuleFactorKnob(Knob):
    """A factor on module attributes (base 1): each ``(module, attribute)`` gets ``original * factor``,
    clamped to ``value_bounds``. For dropout probabilities and attention softmax scales. ``original`` is the value
    the attribute held when a knob first set it, or the one the user's code gave it since (``_unfactored``)."""

    def __init__(self, name: str, targets: list[tuple[nn.Module, str]], value_bounds: Bounds,
                 alpha: float | None = None) -> None:
        super().__init__(name, POSITIVE, alpha)
        self.targets = targets
        self.value_bounds = value_bounds

    def scheduled(self) -> float:
        return 1.0

    def apply(self, value: float) -> None:
        for module, attribute in self.targets:
            original = _unfactored(module, attribute)
            setattr(module, attribute, self.value_bounds.clamp(original * value))
            _WRITTEN.setdefault(module, {})[attribute] = (original, float(getattr(module, attribute)))


class ValueKnob(Knob):
    """A value the training code reads (``current``) or that a user ``setter`` receives; its base is fixed."""

    def __init__(self, name: str, base: float, bounds: Bounds, alpha: float | None = None,
                 setter: Callable[[float], None] | None = None) -> None:
        super().__init__(name, bounds, alpha)
        if not math.isfinite(base) or bounds.clamp(base) != base:
            raise HDETConfigError(f"the base value of '{name}' is {base}, outside its bounds {bounds}")
        self.base = base
        self.current = base
        self._setter = setter

    def scheduled(self) -> float:
        return self.base

    def apply(self, value: float) -> None:
        self.current = value
        if self._setter is not None:
            self._setter(value)


# ------------------------------------------------------------------------------- finding model knobs
def is_dropout_attribute(name: str) -> bool:
    """Whether a module's float attribute ``name`` holds a dropout probability it uses directly, as transformers
    modules name them (``attention_dropout``, ``activation_dropout``, ``hidden_dropout_prob``, ``resid_pdrop``...)."""
    return "dropout" in name or name.endswith("pdrop")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is compiled: ``torch.compile(module)``'s wrapper, ``module.compile()`` called, or a
    LightningModule Lightning unwrapped from ``torch.compile`` (its ``_compiler_ctx``)."""
    return (hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
            or getattr(module, "_compiler_ctx", None) is not None)


def dropout_targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every ``nn.Dropout``'s ``p`` and every float dropout attribute (``is_dropout_attribute``) of other modules,
    with a non-zero value."""
    targets = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            targets.append((module, "p"))
            continue
        targets += [(module, attribute) for attribute, value in vars(module).items()
                    if type(value) is float and is_dropout_attribute(attribute)]
    return [(module, attribute) for module, attribute in targets if getattr(module, attribute) > 0]


def attention_scale_targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The softmax scale of every transformers attention module (its float ``scaling`` attribute)."""
    return [(module, "scaling") for module in model.modules()
            if isinstance(getattr(module, "scaling", None), float)]


def fold_attention_scale(model: nn.Module, state: dict[str, torch.Tensor], modules: list[nn.Module],
                         factor: float) -> list[str]:
    """Multiplies ``factor`` on the softmax scale of the attention ``modules`` into ``state``, ``model``'s full state
    dict, for an export whose config rebuilds each module's own scale: into the query's norm weight where the
    module normalizes its queries (``q_norm``: the norm would undo a factor before it), else into its query
    projection (``q_proj``; the rotary embedding after it is linear). Returns the names of the modules it could
    fold into neither (their queries are computed another way, e.g. in one projection with the keys)."""
    chosen = {id(module) for module in modules}
    unfolded = []
    for name, module in model.named_modules():
        if id(module) not in chosen or factor == 1.0:
            continue
        prefix = f"{name}." if name else ""
        keys = [f"{prefix}q_norm.weight"] if f"{prefix}q_norm.weight" in state else [
            key for key in (f"{prefix}q_proj.weight", f"{prefix}q_proj.bias") if key in state]
        if not keys:
            unfolded.append(name)
        for key in keys:
            state[key] = state[key] * factor
    return unfolded


# ------------------------------------------------------------------------------------- from the config
def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Each param group's name (its ``name`` entry, else its index); unique."""
    names = [str(group.get("name", index)) for index, group in enumerate(optimizer.param_groups)]
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer param group names must be unique, got {names}")
    return names


def lr_knobs(optimizer: torch.optim.Optimizer, alpha: float | None = None) -> list[Knob]:
    """One LR knob per param group, named ``lr/<group>``. Its values are > 0 wherever the schedule's are (the
    controller's scale never reaches 0); a schedule's own 0 (e.g. a warm-up's first step) stays 0."""
    return [OptimizerGroupKnob(f"lr/{name}", optimizer, index, "lr", NON_NEGATIVE, alpha)
            for index, name in enumerate(group_names(optimizer))]


def is_configured_name(name: str) -> bool:
    """Whether ``name`` is one the optimizer or ``HDETConfig.explore`` gives (``lr/<group>``, ``dropout``...),
    not one of ``add_knob``'s."""
    return name.startswith(("lr/", "weight_decay/")) or name in KNOB_NAMES


def configured_knobs(explore: ExploreConfig, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> list[Knob]:
    """The knobs ``explore`` asks for besides the LR; a clear error where one cannot apply."""
    knobs: list[Knob] = []
    if explore.weight_decay is not None:
        # a group without weight decay (the no-decay group of norms and biases) has none to explore: every
        # multiple of 0 is 0
        decayed = [(index, name) for index, name in enumerate(group_names(optimizer))
                   if optimizer.param_groups[index].get("weight_decay", 0.0) != 0]
        if not decayed:
            raise HDETConfigError("explore.weight_decay cannot apply: every param group's weight decay is 0; give "
                                  "the optimizer a weight decay, or remove explore.weight_decay")
        knobs += [OptimizerGroupKnob(f"weight_decay/{name}", optimizer, index, "weight_decay", NON_NEGATIVE,
                                     explore.weight_decay.alpha) for index, name in decayed]
    for name, find, value_bounds in (("dropout", dropout_targets, PROBABILITY),
                                     ("attention_scale", attention_scale_targets, POSITIVE)):
        setting = getattr(explore, name)
        if setting is None:
            continue
        if model is None:
            raise HDETConfigError(f"explore.{name} needs the model: pass it when attaching HDET")
        if any(is_compiled(module) for module in model.modules()):
            raise HDETConfigError(f"explore.{name} sets module attributes at every sync, and torch.compile guards on "
                                  "them: every sync would recompile, and past torch._dynamo's recompile limit the "
                                  f"model would run uncompiled; explore it on a model that is not compiled, or remove "
                                  f"explore.{name}")
        targets = find(model)
        if not targets:
            what = ("no nn.Dropout or dropout field with a non-zero probability" if name == "dropout"
                    else "no attention module with a float `scaling` attribute (the transformers softmax scale)")
            raise HDETConfigError(f"explore.{name} cannot apply to {type(model).__name__}: it has {what}; "
                                  f"remove explore.{name}")
        knobs.append(ModuleFactorKnob(name, targets, value_bounds, setting.alpha))
    if explore.label_smoothing is not None:
        knobs.append(ValueKnob("label_smoothing", explore.label_smoothing.base, PROBABILITY,
                               explore.label_smoothing.alpha))
    return knobs
