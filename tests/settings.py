"""HDET settings the tests share."""

from __future__ import annotations

from hdet_scale.config import AutoLRConfig

LR_HELD_AT_GIVEN = {"mode": "scale", "start": 100_000, "range_test": 0}
"""``auto_lr`` for tests of the spread, the averaging and the state, not of the controller: the LR starts at the
value given (no range test) and the controller never moves it within a test's steps (no shares of a run, so no
``total_steps`` needed)."""


def lr_held_at_given() -> AutoLRConfig:
    """``LR_HELD_AT_GIVEN`` as a config."""
    return AutoLRConfig(**LR_HELD_AT_GIVEN)
