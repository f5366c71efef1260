"""What the engines say they hold: vLLM's KV-cache events.

``events`` holds the decoded events, the same for both of vLLM's encodings; the wire, the
subscriber and the exact prefix index build on it.
"""

from __future__ import annotations

from sidecar.extras import install_hint


def unavailable() -> str | None:
    """Why ``SIDECAR_KV_EVENTS=true`` cannot be honoured in this install (the wire's decoder,
    ``msgpack``, from the ``kvevents`` extra, is missing); None when it can."""
    try:
        import msgpack  # noqa: F401
    except ImportError:
        return (
            "SIDECAR_KV_EVENTS=true needs msgpack (the kvevents extra), which is not installed: "
            + install_hint("kvevents")
        )
    return None
