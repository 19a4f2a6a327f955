"""HDET settings the tests share."""

from __future__ import annotations

from hdet_scale.config import AutoLRConfig, HDETConfig

LR_HELD_AT_GIVEN = {"mode": "scale", "start": 100_000, "range_test": 0}
"""``auto_lr`` for tests of the spread, the averaging and the state, not of the controller: the LR starts at the
value given (no range test) and the controller never moves it within a test's steps (no shares of a run, so no
``total_steps`` needed)."""


def lr_held_at_given() -> AutoLRConfig:
    """``LR_HELD_AT_GIVEN`` as a config."""
    return AutoLRConfig(**LR_HELD_AT_GIVEN)


ONE_FIELD_CHANGES = ({"range_test": 0}, {"mode": "scale"}, {"mode": "paper"})
"""``auto_lr`` changes a user makes to a written-out config, each of which changes the mode's defaults."""


def assert_resolves_like_the_defaults(written: dict) -> None:
    """``written`` (a settings dict a page or a shipped file writes out) resolves like an empty config, as it is
    and with each of ``ONE_FIELD_CHANGES`` made to it: it pins no value that a mode or a range test would change."""
    for change in ({}, *ONE_FIELD_CHANGES):
        shown = HDETConfig.from_dict({**written, "auto_lr": {**written.get("auto_lr", {}), **change}})
        empty = HDETConfig.from_dict({"auto_lr": change})
        for steps in (1500, 300_000):
            assert shown.for_run(steps).auto_lr == empty.for_run(steps).auto_lr, change
