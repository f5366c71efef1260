"""The SSE cached_tokens rewriter, at every possible chunk split."""

from __future__ import annotations

import orjson

from sidecar.connectors.usage import CachedTokensPatch
from sidecar.relay import _EventRewriter, _patch_json

USAGE_EVENT = (
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":40}}}\n\n'
)
STREAM = b'data: {"choices":[{"text":" a"}]}\n\n' + USAGE_EVENT + b"data: [DONE]\n\n"


def _run(rewriter: _EventRewriter, parts: list[bytes]) -> bytes:
    return b"".join(rewriter.feed(part) for part in parts) + rewriter.rest()


def test_every_split_rewrites_once() -> None:
    expected = STREAM.replace(USAGE_EVENT, _rewritten(USAGE_EVENT, 16))
    for cut in range(1, len(STREAM)):
        out = _run(_EventRewriter(CachedTokensPatch(16)), [STREAM[:cut], STREAM[cut:]])
        assert out == expected, cut


def test_byte_by_byte() -> None:
    out = _run(
        _EventRewriter(CachedTokensPatch(0)), [STREAM[i : i + 1] for i in range(len(STREAM))]
    )
    assert out == STREAM.replace(USAGE_EVENT, _rewritten(USAGE_EVENT, 0))


def test_events_without_the_field_are_untouched() -> None:
    stream = b'data: {"choices":[],"usage":{"prompt_tokens":4,"prompt_tokens_details":null}}\n\n'
    assert _run(_EventRewriter(CachedTokensPatch(16)), [stream]) == stream


def test_complete_events_are_not_held_back() -> None:
    rewriter = _EventRewriter(CachedTokensPatch(16))
    first = b'data: {"choices":[{"text":" a"}]}\n\n'
    assert rewriter.feed(first + b"data: {") == first
    assert rewriter.rest() == b"data: {"


def test_json_body() -> None:
    body = b'{"usage": {"prompt_tokens_details": {"cached_tokens": 99}}}'
    assert orjson.loads(_patch_json(body, CachedTokensPatch(7)))["usage"][
        "prompt_tokens_details"
    ] == {"cached_tokens": 7}
    untouched = b'{"usage": {"prompt_tokens_details": null}}'
    assert _patch_json(untouched, CachedTokensPatch(7)) is untouched


def _rewritten(event: bytes, cached: int) -> bytes:
    payload = orjson.loads(event[len(b"data: ") : -2])
    payload["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
    return b"data: " + orjson.dumps(payload) + b"\n\n"
