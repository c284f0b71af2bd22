"""What the test command (``bash tests/setup.sh && python3 -m pytest -q -n 4 --dist loadgroup``) installs is required, not
optional: a test that needs one of those programs fails with one line naming it, never skips (a skip would
let CI stay green with the feature untested). Python packages of the ``test`` extra are plain imports for
the same reason."""

from __future__ import annotations

import shutil

import pytest


def program(name: str) -> str:
    """The path of the installed program ``name`` (e.g. ``"promtool"``); fails the calling test with one
    line when it is not on ``PATH`` (``bash tests/setup.sh`` installs it, Debian package ``prometheus``)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: bash tests/setup.sh installs it (Debian package prometheus)",
            pytrace=False,
        )
    return path
