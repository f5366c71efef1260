"""host:port parsing for gateway headers and the static pool."""

from __future__ import annotations

import re

import pytest

from sidecar.fleet.endpoints import Endpoint, parse_endpoint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefill-0.prefill.ns.svc:8000", Endpoint("prefill-0.prefill.ns.svc", 8000)),
        ("127.0.2.3:8000", Endpoint("127.0.2.3", 8000)),
        ("[fd00::1]:8000", Endpoint("fd00::1", 8000)),
        ("http://127.0.2.3:8000", Endpoint("127.0.2.3", 8000)),
        ("HTTP://Prefill:1", Endpoint("prefill", 1)),
        ("  localhost:65535 ", Endpoint("localhost", 65535)),
        ("host.:80", Endpoint("host.", 80)),
    ],
)
def test_valid(text: str, expected: Endpoint) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "http://",
        "127.0.2.3",
        "prefill",
        "prefill:",
        ":8000",
        "prefill:0",
        "prefill:65536",
        "prefill:80a",
        "prefill:-1",
        "fd00::1:8000",
        "[fd00::1]",
        "[fd00::1]8000",
        "[not-ipv6]:8000",
        "300.1.2.3:8000",
        "1.2.3:8000",
        "bad_host:8000",
        "-bad.host:8000",
        "host/path:8000",
        "127.0.2.3:8000/v1",
        "user@host:8000",
        "https://127.0.2.3:8000",
        "a" * 64 + ".example:80",
    ],
)
def test_invalid(text: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_endpoint(text)


def test_str_and_url_bracket_ipv6() -> None:
    endpoint = parse_endpoint("[::1]:8100")
    assert str(endpoint) == "[::1]:8100"
    assert endpoint.url == "http://[::1]:8100"
    assert str(parse_endpoint("127.0.0.2:8100")) == "127.0.0.2:8100"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("https://127.0.2.3:8000", "https:// is not accepted here: give host:port"),
        ("127.0.2.3:8000/v1", "without a path (/v1)"),
        ("http://127.0.2.3:8000/v1/chat/completions", "without a path (/v1/chat/completions)"),
        ("grpc://127.0.2.3:8000", "not a URL of scheme grpc"),
    ],
)
def test_a_scheme_or_a_path_is_refused_as_such(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(f"{text!r}: ")) as caught:
        parse_endpoint(text)
    assert says in str(caught.value)


def test_a_trailing_slash_and_an_allowed_scheme_are_only_prefixes() -> None:
    assert parse_endpoint("127.0.2.3:8000/") == Endpoint("127.0.2.3", 8000)
    tls = frozenset({"http", "https"})
    assert parse_endpoint("HTTPS://Prefill:1/", schemes=tls) == Endpoint("prefill", 1)
