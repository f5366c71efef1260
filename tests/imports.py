"""What a fresh interpreter imports to run a command: a light module stays light by test."""

from __future__ import annotations

import subprocess
import sys

IMPORT_TIMEOUT_S = 20.0
"""A second or two on the 2-core CI machine; generous under load."""


def imported(*args: str) -> set[str]:
    """Every module ``python -X importtime *args`` imports (dotted names, the interpreter's own
    start-up included); the command must succeed."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S,
        check=True,
    )
    # "import time:   self |   cumulative | <indent>name", after a header line naming the columns
    return {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
