"""``usage.prompt_tokens_details.cached_tokens``: read from a prefill answer, rewritten in a
decode answer.

A decode engine that pulled the KV reports the whole prompt as cached; the prefill's figure is
the truthful one (llm-d #916). OpenAI-compatible engines put it in the same place, so every
connector that moves KV uses this walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CACHED_TOKENS = "cached_tokens"


def _details(answer: Any) -> dict[str, Any] | None:
    """The ``prompt_tokens_details`` object of an answer, if it has one."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return details if isinstance(details, dict) else None


def cached_tokens(answer: Any) -> int | None:
    details = _details(answer)
    value = details.get(CACHED_TOKENS) if details is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_tokens(answer: Any) -> int | None:
    """``usage.prompt_tokens``: the prompt's tokens as the engine counted them."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class CachedTokensPatch:
    """Sets ``cached_tokens`` where the decode engine reported it (never adds the field)."""

    value: int
    marker: bytes = b'"cached_tokens"'

    def apply(self, answer: Any) -> bool:
        details = _details(answer)
        if details is None or CACHED_TOKENS not in details:
            return False
        details[CACHED_TOKENS] = self.value
        return True
