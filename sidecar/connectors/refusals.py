"""A prefill leg's refusal, told in the client's terms.

The prefill leg of ``nixl``, ``nixl-push`` and ``shared-storage`` is not the client's request: it
asks for one token (``max_tokens`` 1). An engine that refuses it for the context length counts
that token — vLLM: "This model's maximum context length is 32768 tokens. However, you requested
40001 tokens (40000 in the messages, 1 in the completion)" — and relayed as it is, the client
would read about a completion it never asked for. The refusal is right (a prompt that leaves no
room for one token leaves none for the client's), its figures are the leg's: the client gets the
same sentence with its own ``max_tokens``, in vLLM's wording, and the log and the request's
record keep the engine's own.

Any other refusal goes to the client as the engine wrote it: it is about the client's prompt,
model or fields, which the leg carries unchanged.
"""

from __future__ import annotations

import logging
import re

import orjson

from sidecar.connectors.exchange import Body, Exchange, Refused
from sidecar.errors import error_body

logger = logging.getLogger("sidecar.connectors.refusals")

_LIMIT = re.compile(r"maximum context length is (\d+) tokens")
_PROMPT = (
    # vLLM up to 0.10: "(40000 in the messages, 1 in the completion)"
    re.compile(r"\((\d+) in the (?:messages|prompt)"),
    # Later vLLM: "... your request has 40000 input tokens ..."
    re.compile(r"(\d+) input tokens"),
)


def in_client_terms(refused: Refused, ex: Exchange) -> Refused:
    """``refused`` (a one-token prefill leg's refusal) as the client's own request would have
    been refused; itself when it is not about the context length."""
    error = _error(refused.body)
    said = error.get("message") if error is not None else None
    limit = _LIMIT.search(said) if isinstance(said, str) else None
    if error is None or not isinstance(said, str) or limit is None:
        return refused
    prompt = next((int(m.group(1)) for p in _PROMPT if (m := p.search(said)) is not None), None)
    message = _context_message(int(limit.group(1)), prompt, completion_tokens(ex.body, ex.route))
    logger.info(
        "request %s: the prefill engine refused the prefill leg (%s); the client is told in its "
        "request's own figures",
        ex.request_id,
        said,
        extra={"request_id": ex.request_id},
    )
    kind = error.get("type")
    return Refused(
        refused.status,
        error_body(refused.status, kind if isinstance(kind, str) else "BadRequestError", message),
        "application/json",
        f"{refused.error}: {said}",
    )


def completion_tokens(body: Body, route: str) -> int | None:
    """The completion the client asked for at most (None: it set no limit), as vLLM reads it:
    on chat ``max_completion_tokens`` before the older ``max_tokens``."""
    names = ("max_completion_tokens", "max_tokens") if route == "chat_completions" else ()
    for name in names or ("max_tokens",):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _context_message(limit: int, prompt: int | None, completion: int | None) -> str:
    """vLLM's sentence with the client's figures. A one-token leg is refused only when the
    prompt alone fills the context, so whatever the client asked for, there is no room."""
    head = f"This model's maximum context length is {limit} tokens. However, "
    if prompt is not None and completion is not None:
        return (
            f"{head}you requested {prompt + completion} tokens ({prompt} in the messages, "
            f"{completion} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    if prompt is not None:
        return (
            f"{head}your request has {prompt} input tokens, which leave no room for a "
            "completion. Please reduce the length of the messages."
        )
    return f"{head}your messages leave no room for a completion. Please reduce their length."


def _error(raw: bytes) -> dict[str, object] | None:
    """The engine's ``error`` object (``sidecar.errors.is_error_body`` held for it)."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    return error if isinstance(error, dict) else None
