"""System programs the tests need (``redis-server``, ``prometheus``, ``chromium``, ...).

On a developer's machine a missing one skips the tests that need it, with the package to
install. Under CI (``CI`` set; ``.ci/run`` sets it and installs every one of them) it fails them:
a CI run never passes by skipping.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def missing(what: str) -> NoReturn:
    """``what`` is not available: fail under CI, else skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must install it: .ci/run)", pytrace=False)
    pytest.skip(f"{what} (.ci/run installs it)")


def program(name: str, package: str) -> str:
    """The path of ``name``, from the Debian package ``package``."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (apt-get install {package})")
    return path
