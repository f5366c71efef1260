"""The emulator's one error type and the one renderer, in the shape vLLM's OpenAI server uses.

Every error the emulator answers, whatever raised it, has the body::

    {"error": {"message": str, "type": "<Name>Error", "param": null, "code": <status>}}

The type name is derived from the HTTP status phrase (404 -> ``NotFoundError``,
503 -> ``ServiceUnavailableError``), which matches vLLM for the statuses it uses.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web


class EmulatorError(Exception):
    """A request failed with an HTTP status and a message the client will read."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_type(status: int) -> str:
    """The vLLM-style error type for a status, e.g. 400 -> ``BadRequestError``."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word for word in phrase.replace("-", " ").split() if word.isalnum())
    return name if name.endswith("Error") else f"{name}Error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type(status), "param": None, "code": status}
    }


def error_response(status: int, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(error_body(status, message)),
        content_type="application/json",
    )
