"""What the scheduler keeps of a prompt: held as long as its stream, so held at its own size."""

from __future__ import annotations

import tracemalloc
from typing import Any

from sidecar.scheduling.prompts import prompt_text


def _held_per_prompt(body: dict[str, Any], copies: int = 200) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        held = [prompt_text(body) for _ in range(copies)]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(held) == copies
    return grown / copies


def test_a_chat_prompts_text_is_held_at_its_own_size() -> None:
    """orjson hands back its growth buffer (4 KiB for a few hundred bytes of JSON): the text
    kept per stream is copied to its own size."""
    body = {"messages": [{"role": "user", "content": "x" * 200}]}
    size = len(prompt_text(body))
    assert _held_per_prompt(body) < 2 * size + 256


def test_a_token_id_prompts_text_is_held_at_its_own_size() -> None:
    body = {"prompt": list(range(500))}
    size = len(prompt_text(body))
    assert _held_per_prompt(body) < 2 * size + 256
