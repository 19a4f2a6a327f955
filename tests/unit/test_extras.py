"""The optional extras: DDP and FSDP2 with torch alone, and a feature whose package is missing refused in one line
with its pip command. "Not installed" is a ``None`` entry in ``sys.modules``, which is what the import system and
``importlib.util.find_spec`` read as a module that cannot be imported.

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_extras_e2e.py.
"""

from __future__ import annotations

import pytest

from hdet_scale.extras import MissingExtra, require


def test_a_missing_package_names_the_feature_and_the_extra():
    with pytest.raises(MissingExtra, match=r"^--thing needs no_such_package_x, which is not installed: "
                                           r"pip install 'hdet_scale\[thing\]'$"):
        require("no_such_package_x", "thing", "--thing")
    require("torch", "never", "torch itself")  # installed: nothing happens
