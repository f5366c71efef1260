"""The one canonical form of a request's path, applied before routing (docs/behavior.md, "Bad
input"), and the engines' generation routes it protects.

A path the engine would route to a generation endpoint must reach it through the pipeline (which
owns the KV fields) or not at all. The engines' servers (uvicorn and Starlette, for vLLM and
SGLang) decode every percent-escape before routing, ``%2F`` included, so ``/v1%2Fcompletions``
is ``/v1/completions`` to them; the HTTP client re-normalises paths too (yarl resolves dot
segments). So every request is routed on one spelling, and that spelling is what an engine is
sent (``HttpClient.send`` builds its URL encoded, untouched):

1. an absolute-form target (``http://host/x``) stands for its path (``/x``); any other target
   that does not start with ``/`` is refused;
2. a percent-escape of an unreserved character (``A-Z a-z 0-9 - . _ ~``) is decoded; any other
   escape is kept, in upper case; ``%2F`` and ``%5C`` (an encoded slash or backslash, any case),
   an escaped control character (``%00``-``%1F``, ``%7F``) and a malformed escape are refused,
   as is a raw backslash;
3. repeated slashes are merged;
4. dot segments (``.``, ``..``, and their encoded forms after step 2) are resolved (RFC 3986
   §5.2.4; ``..`` never climbs above ``/``);
5. an engine generation route spelled with a trailing slash (Starlette redirects it to the
   route) is that route.

The query string is kept as it came. Refusals are 400 in the engine's error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from sidecar.errors import BadRequest, error_response
from sidecar.headers import request_id_from
from sidecar.observability.metrics import ROUTES

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

GUARDED_ROUTES = frozenset(
    {
        # vLLM: the Responses API reads kv_transfer_params (vllm-project/vllm#37424,
        # vllm/entrypoints/openai/responses/protocol.py); the tokens-in generate API
        # (vllm/entrypoints/serve/disagg/protocol.py, GenerateRequest.kv_transfer_params, and
        # sampling_params.extra_args, which vllm/v1/request.py reads kv_transfer_params from);
        # the batched chat route (ChatCompletionRequest); the Anthropic Messages route
        # (vllm/entrypoints/anthropic/, turned into a chat request); SageMaker's /invocations,
        # which dispatches to the chat and completion handlers by the body's shape.
        "/v1/responses",
        "/inference/v1/generate",
        "/v1/chat/completions/batch",
        "/v1/messages",
        "/invocations",
        # SGLang (python/sglang/srt/entrypoints/http_server.py): /generate (POST and PUT;
        # GenerateReqInput.bootstrap_host/port/room/pair_key), /invocations (a chat request),
        # /vertex_generate (its "parameters" spread into a GenerateReqInput; the route is
        # AIP_PREDICT_ROUTE when that is set: add nothing else there), /v1/responses.
        "/generate",
        "/vertex_generate",
    }
)
"""Engine routes that generate and read client KV fields but that the pipeline does not serve:
passthrough checks their bodies (``sidecar.passthrough``)."""

GENERATION_ROUTES = frozenset(ROUTES) | GUARDED_ROUTES
"""Every engine generation route: a trailing slash on one of these is dropped."""

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset("0123456789abcdefABCDEF")
_REFUSED_ESCAPES = {0x2F: "an encoded slash (%2F)", 0x5C: "an encoded backslash (%5C)"}
_ABSOLUTE = ("http://", "https://")
_CANONICAL = web.RequestKey("canonical", bool)
"""Marks a request already re-dispatched on its canonical path."""


def is_plain(target: str) -> bool:
    """Whether ``target`` is canonical at a glance: no escape, no backslash, no repeated slash,
    no dot segment, no trailing slash — what almost every request looks like, checked with a few
    substring scans."""
    return not (
        "%" in target
        or "//" in target
        or "/." in target
        or "\\" in target
        or target.endswith("/")
        or "/?" in target
        or not target.startswith("/")
    )


def canonical_target(target: str) -> str:
    """The canonical form of a request target (path and query); raises ``BadRequest`` for a
    refused spelling. Idempotent: ``canonical_target(canonical_target(t)) ==
    canonical_target(t)``."""
    path, mark, query = target.partition("?")
    if path[:8].lower().startswith(_ABSOLUTE):
        authority_and_path = path.split("://", 1)[1]
        slash = authority_and_path.find("/")
        path = authority_and_path[slash:] if slash >= 0 else "/"
    if not path.startswith("/"):
        raise BadRequest("the request target must be a path starting with '/'")
    if "%" in path:
        path = _decode_unreserved(path)
    if "\\" in path:
        raise BadRequest("the request path must not contain a backslash")
    while "//" in path:
        path = path.replace("//", "/")
    if "/." in path:
        path = _without_dot_segments(path)
    if len(path) > 1 and path.endswith("/") and path[:-1] in GENERATION_ROUTES:
        path = path[:-1]
    return path + mark + query


def _decode_unreserved(path: str) -> str:
    pieces = path.split("%")
    out = [pieces[0]]
    for piece in pieces[1:]:
        digits = piece[:2]
        if len(digits) < 2 or not _HEX.issuperset(digits):
            raise BadRequest("the request path has a malformed percent-escape")
        byte = int(digits, 16)
        refused = _REFUSED_ESCAPES.get(byte)
        if refused is not None:
            raise BadRequest(f"the request path must not contain {refused}")
        if byte < 0x20 or byte == 0x7F:
            raise BadRequest("the request path must not contain an encoded control character")
        char = chr(byte)
        out.append(char if char in _UNRESERVED else "%" + digits.upper())
        out.append(piece[2:])
    return "".join(out)


def _without_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 on a path without repeated slashes: ``/a/./b/../c`` is ``/a/c``, and a
    path ending in a dot segment ends with a slash (``/a/b/..`` is ``/a/``)."""
    kept: list[str] = []
    segments = path.split("/")[1:]
    for segment in segments:
        if segment == ".":
            continue
        if segment == "..":
            if kept:
                kept.pop()
            continue
        kept.append(segment)
    if segments[-1] in (".", ".."):
        kept.append("")
    return "/" + "/".join(kept)


@web.middleware
def canonical_paths(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
    """Route every request on its canonical target; answer 400 for a refused spelling.

    A target already canonical goes on at the cost of ``is_plain``. Another is served as a
    request for its canonical target: aiohttp routes before any middleware runs, so the request
    is handed back to the application's dispatcher (routing, then every middleware) once.

    A plain function, not a coroutine, for a canonical target: aiohttp awaits what it returns,
    the handler's own awaitable, so no frame of this middleware stays for a stream's life."""
    if is_plain(request.raw_path) or _CANONICAL in request:
        return handler(request)
    return _route_canonical(request, handler)


async def _route_canonical(request: web.Request, handler: Handler) -> web.StreamResponse:
    target = request.raw_path
    try:
        canonical = canonical_target(target)
    except BadRequest as exc:
        return error_response(exc, request_id_from(request.headers))
    if canonical == target:
        return await handler(request)
    if hdrs.EXPECT in request.headers:
        # aiohttp already answered it (100 Continue) when it routed the request the first time.
        headers = CIMultiDict(request.headers)
        del headers[hdrs.EXPECT]
        again = request.clone(rel_url=URL(canonical, encoded=True), headers=headers)
    else:
        again = request.clone(rel_url=URL(canonical, encoded=True))
    again[_CANONICAL] = True
    # aiohttp has no public way to route a request again: Application._handle is the
    # dispatcher its server calls for every request.
    return await request.app._handle(again)
