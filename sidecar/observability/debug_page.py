"""The ``/debug/requests`` page: one HTML document, its script and its stylesheet.

The three files live in ``sidecar/static/`` (package data) and are read once, when the app is
built. No external asset, no build step: the page works in an air-gapped cluster. The script and
the stylesheet are served as same-origin files rather than inline, so the Content-Security-Policy
needs no nonce or hash: ``script-src 'self'`` and ``style-src 'self'``, nothing else may load, and
Trusted Types are required, so the browser itself refuses any HTML string the script might assign
(the page builds its DOM from text nodes only; request ids and errors come from clients).

Which representation ``/debug/requests`` answers is content negotiation (``prefers_html``): a
browser, which asks for ``text/html`` ahead of anything else, gets the page; ``curl`` (``*/*``),
scripts without an ``Accept`` header and ``Accept: application/json`` get the JSON as before.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
        "require-trusted-types-for 'script'; trusted-types 'none'"
    ),
    # Always the running sidecar's own page and data, never a cached copy from an older version.
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

ASSETS = {
    "debug.js": "text/javascript",
    "debug.css": "text/css",
}
"""The files the document loads, under ``/debug/ui/<name>``, with their media types."""

DOCUMENT = "debug.html"


class DebugPage:
    """The page's files, read from the package once."""

    def __init__(self) -> None:
        static = resources.files("sidecar").joinpath("static")
        self._document = static.joinpath(DOCUMENT).read_bytes()
        self._assets = {name: static.joinpath(name).read_bytes() for name in ASSETS}

    def document(self) -> web.Response:
        return _response(self._document, "text/html")

    def asset(self, name: str) -> web.Response | None:
        """The named script or stylesheet; None for any other name."""
        body = self._assets.get(name)
        return None if body is None else _response(body, ASSETS[name])


def _response(body: bytes, media_type: str) -> web.Response:
    response = web.Response(body=body, content_type=media_type, charset="utf-8")
    response.headers.update(PAGE_HEADERS)
    return response


def prefers_html(accept: str | None) -> bool:
    """Whether an ``Accept`` header ranks ``text/html`` strictly above ``application/json``.

    Ties go to JSON: no header, ``*/*`` and ``application/json, text/html`` all keep the JSON
    API; a browser's ``text/html,...,*/*;q=0.8`` gets the page. Each type's quality comes from
    the most specific range naming it (``text/html`` over ``text/*`` over ``*/*``, RFC 9110
    §12.5.1); media type parameters other than ``q`` are ignored.
    """
    if not accept:
        return False
    ranges = [_media_range(part) for part in accept.split(",") if part.strip()]
    return _quality(ranges, "text", "html") > _quality(ranges, "application", "json")


def _media_range(text: str) -> tuple[str, float]:
    media, *params = text.split(";")
    quality = 1.0
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                quality = min(max(float(value.strip()), 0.0), 1.0)
            except ValueError:
                quality = 0.0  # a malformed weight never wins a tie
    return media.strip().lower(), quality


def _quality(ranges: list[tuple[str, float]], kind: str, subtype: str) -> float:
    best_specificity, best_quality = -1, 0.0
    names = {f"{kind}/{subtype}": 2, f"{kind}/*": 1, "*/*": 0}
    for media, quality in ranges:
        specificity = names.get(media, -1)
        if specificity > best_specificity:
            best_specificity, best_quality = specificity, quality
    return best_quality
