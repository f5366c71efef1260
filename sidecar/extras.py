"""The optional extras (``pyproject.toml``) and how a missing one is installed.

A hint never names a package to fetch from an index: ``pd-sidecar`` is not published on PyPI, so
``pip install 'pd-sidecar[kvevents]'`` would install whatever someone registered under that name.
What works is the image, which has every extra, or the checkout the sidecar was installed from.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to get ``extra``: the image, or the source checkout."""
    return f"the image has it; from a checkout of the source: pip install '.[{extra}]'"
