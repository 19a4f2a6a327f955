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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

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

    def past_probability(self, factor: float) -> str | None:
        """Where the knob is a probability: what ``factor`` times its value would set at 1 or more, in words (a
        dropout that drops every unit once clamped below 1); None where nothing, or where it is no probability."""
        return None

    def highest_base(self) -> float:
        """The base at which some value the knob sets reaches the top of its bounds: a base above it would be
        clamped there, training at less than it says."""
        return self.bounds.high

    def state(self) -> dict[str, Any]:
        """What HDET's state keeps of the knob itself, for a resume: what it read from the model when it was made,
        which a resumed model no longer holds ({}: nothing)."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Takes back ``state()``'s (one of an earlier version may lack entries)."""


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


OWN_VALUE = "_hdet_own_{}"
"""The module attribute that keeps an attribute's value from before any knob set it (``ModuleFactorKnob``)."""


class ModuleFactorKnob(Knob):
    """A factor on module attributes (base 1): each ``(module, attribute)`` gets ``original * factor``,
    clamped to ``value_bounds``. For dropout probabilities and attention softmax scales. ``original`` is the value
    the attribute held when the knob was made, one the user's code gave it since (a dropout schedule), or the one
    a resumed state names (``load_state``: the attribute then holds a value an earlier run's factor was applied to).
    """

    def __init__(self, name: str, targets: list[tuple[nn.Module, str]], value_bounds: Bounds,
                 alpha: float | None = None) -> None:
        super().__init__(name, POSITIVE, alpha)
        # (module, attribute, the value a factor applies to, the value last written; NaN: none yet)
        self.targets = [(module, attribute, float(getattr(module, attribute)), math.nan)
                        for module, attribute in targets]
        self.value_bounds = value_bounds
        for module, attribute in targets:  # kept on the module, through later runs on it and copies of it
            module.__dict__.setdefault(OWN_VALUE.format(attribute), float(getattr(module, attribute)))

    def own_factors(self, value: float) -> list[tuple[nn.Module, float]]:
        """Each target module and what its attribute is at ``value`` over the module's own (``OWN_VALUE``: before
        any knob set it), the factor an export whose config rebuilds the own value must carry."""
        return [(module, self.value_bounds.clamp(original * value) / module.__dict__[OWN_VALUE.format(attribute)])
                for module, attribute, original, _ in self.targets]

    def scheduled(self) -> float:
        return 1.0

    def past_probability(self, factor: float) -> str | None:
        if self.value_bounds is not PROBABILITY:
            return None
        return next((f"{type(module).__name__}.{attribute} = {original:g} x {factor:.3g} = {original * factor:.3g}"
                     for module, attribute, original, _ in self.targets if original * factor >= 1), None)

    def highest_base(self) -> float:
        return min((self.value_bounds.high / original for _, _, original, _ in self.targets if original > 0),
                   default=math.inf)

    def apply(self, value: float) -> None:
        applied = []
        for module, attribute, original, written in self.targets:
            current = float(getattr(module, attribute))
            if current != written and not math.isnan(written):  # set by the user's code since
                original = current
            setattr(module, attribute, self.value_bounds.clamp(original * value))
            applied.append((module, attribute, original, float(getattr(module, attribute))))
        self.targets = applied

    def state(self) -> dict[str, Any]:
        return {"originals": [original for _, _, original, _ in self.targets]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        originals = state.get("originals")
        if originals is None:  # a state of an earlier version
            return
        if len(originals) != len(self.targets):
            raise ValueError(f"the HDET state's '{self.name}' was of {len(originals)} module attributes, and this "
                             f"model has {len(self.targets)}: resume it into the model it was saved from")
        self.targets = [(module, attribute, float(original), math.nan)
                        for (module, attribute, _, _), original in zip(self.targets, originals, strict=True)]


class ValueKnob(Knob):
    """A value the training code reads (``current``) or that a user ``setter`` receives; its base is fixed: the
    config's, or one read from the model (``from_model``, ``add_knob``'s getter), which HDET's state keeps."""

    def __init__(self, name: str, base: float, bounds: Bounds, alpha: float | None = None,
                 setter: Callable[[float], None] | None = None, *, from_model: bool = False) -> None:
        super().__init__(name, bounds, alpha)
        if not math.isfinite(base) or bounds.clamp(base) != base:
            raise HDETConfigError(f"the base value of '{name}' is {base}, outside its bounds {bounds}")
        self.base = base
        self.current = base
        self._setter = setter
        self._from_model = from_model

    def state(self) -> dict[str, Any]:
        return {"base": self.base} if self._from_model else {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if self._from_model and "base" in state:
            self.base = float(state["base"])

    def scheduled(self) -> float:
        return self.base

    def past_probability(self, factor: float) -> str | None:
        value = self.base * factor
        return f"a {self.name.replace('_', ' ')} of {value:.3g}" if self.bounds is PROBABILITY and value >= 1 else None

    def apply(self, value: float) -> None:
        self.current = value
        if self._setter is not None:
            self._setter(value)


# ------------------------------------------------------------------------------- finding model knobs
def is_dropout_attribute(name: str) -> bool:
    """Whether a module's float attribute ``name`` holds a dropout probability it uses directly, as transformers
    modules name them (``attention_dropout``, ``activation_dropout``, ``hidden_dropout_prob``, ``resid_pdrop``...)."""
    return ("dropout" in name or name.endswith("pdrop")) and not name.startswith(OWN_VALUE.format(""))


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


QUERY_NORMS = ("q_norm", "q_layernorm", "query_layernorm", "q_layer_norm")
"""The names transformers attention modules give the norm of their queries, applied after the query projection."""
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""Module names that wrappers (activation checkpointing, torch.compile, FSDP1) add and a state dict leaves out."""


def fold_attention_scale(model: nn.Module, state: dict[str, torch.Tensor],
                         factors: list[tuple[nn.Module, float]]) -> list[str]:
    """Multiplies each attention module's ``factors`` entry (its softmax scale over the one its config rebuilds)
    into ``state``, ``model``'s full state dict, for an export: into the parameters of the query's norm where the
    module normalizes its queries after projecting them (where the norm's output, checked here, scales with them),
    else into its query projection (``q_proj``; the rotary embedding after it is linear). Returns the names of the
    modules it could fold into neither (queries projected with the keys, a norm shared with them or whose output a
    factor on its weights does not scale)."""
    by_module = {id(module): factor for module, factor in factors}
    unfolded = []
    for name, module in model.named_modules(remove_duplicate=False):
        factor = by_module.get(id(module), 1.0)
        if factor == 1.0:
            continue
        prefix = ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)
        prefix = f"{prefix}." if prefix else ""
        children = dict(module.named_children())
        norm = next((child for child in QUERY_NORMS if child in children), None)
        if norm is not None:
            keys = [f"{prefix}{norm}.{parameter}" for parameter, _ in children[norm].named_parameters()]
            if not (keys and all(key in state for key in keys) and _scales_with_its_parameters(
                    children[norm], {key.rsplit(".", 1)[1]: state[key] for key in keys}, factor)):
                keys = []
        elif "qk_norm" in children:  # one norm for the queries and the keys
            keys = []
        else:
            keys = [f"{prefix}q_proj.{parameter}" for parameter in ("weight", "bias") if f"{prefix}q_proj.{parameter}"
                    in state]
        if not keys:
            unfolded.append(name)
        for key in keys:
            state[key] = state[key] * factor
    return unfolded


def _scales_with_its_parameters(norm: nn.Module, parameters: dict[str, torch.Tensor], factor: float) -> bool:
    """Whether ``norm`` with ``parameters`` times ``factor`` gives ``factor`` times its output (an RMSNorm or a
    LayerNorm whose output is weight * normalized + bias; not one computing (1 + weight) * normalized). In fp32
    (bf16 would round the product), through ``forward`` alone: an engine's hooks on the module (ZeRO-3's gather
    and trace) must not run for this."""
    exact = {key: value.float() for key, value in parameters.items()}
    inputs = torch.randn(3, next(iter(exact.values())).shape[-1], generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            with _reparametrize_module(norm, exact):
                given = norm.forward(inputs)
            with _reparametrize_module(norm, {key: value * factor for key, value in exact.items()}):
                scaled = norm.forward(inputs)
    except Exception:  # a norm of another shape (one per head): not one to fold into
        return False
    return torch.allclose(scaled.float(), given.float() * factor, rtol=1e-4, atol=1e-6)


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
