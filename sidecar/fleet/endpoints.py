"""Prefill endpoint addresses: ``host:port`` parsing shared by headers and settings.

Accepted forms (protocol.md §2): ``host:port`` where host is a DNS name or an IPv4 address,
``[IPv6]:port``, each optionally behind a legacy ``http://`` prefix (and, where the caller allows
it, ``https://``: a pool entry when ``SIDECAR_PREFILL_TLS`` is on). Nothing else: no path, no user
info, no bare IPv6 without brackets, no port outside 1–65535. A refusal says which of these it
was, not what a parser tripped on next (a path is not "a port that is not a number").
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[0-9]{1,5}$")
PLAIN_SCHEMES = frozenset({"http"})
"""What ``parse_endpoint`` accepts before ``://`` by default: the legacy ``http://`` prefix."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An engine's address. ``host`` holds an IPv6 literal without brackets.

    ``bootstrap_port``: where an SGLang prefill server takes KV rendezvous, when a pool entry
    names it (``host:port#bootstrap_port``); not part of the address (equality, ``str``).
    ``tls_name``: the host name a target was given before it was pinned to one of its
    addresses (``sidecar.security.trust``), which its TLS certificate is verified against; not part
    of the address either.
    """

    host: str
    port: int
    bootstrap_port: int | None = field(default=None, compare=False)
    tls_name: str | None = field(default=None, compare=False)

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    _text: str = field(init=False, repr=False, compare=False)
    """``str`` of it, made once: the request path asks for it several times."""

    def __post_init__(self) -> None:
        text = f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"
        object.__setattr__(self, "_text", text)

    def __str__(self) -> str:
        return self._text

    @property
    def url(self) -> str:
        """Its plain-HTTP URL; engine calls take ``Engines.prefill_url``, which follows
        ``SIDECAR_PREFILL_TLS``."""
        return f"http://{self}"


def split_scheme(text: str) -> tuple[str | None, str]:
    """The scheme before ``://`` (lower-case; None when there is none) and the rest, stripped."""
    value = text.strip()
    scheme, sep, rest = value.partition("://")
    return (scheme.lower(), rest) if sep else (None, value)


def parse_endpoint(text: str, *, schemes: frozenset[str] = PLAIN_SCHEMES) -> Endpoint:
    """Parse one ``host:port``, optionally behind one of ``schemes`` + ``://``; raise
    ``ValueError`` with a reason a client can act on."""
    scheme, value = split_scheme(text)
    if scheme is not None and scheme not in schemes:
        if scheme == "https":
            raise ValueError(
                f"{text!r}: https:// is not accepted here: give host:port "
                "(SIDECAR_PREFILL_TLS=true calls every prefill engine over HTTPS)"
            )
        raise ValueError(f"{text!r}: expected host:port, not a URL of scheme {scheme}")
    query = value.find("?")
    if query >= 0 and "/" not in value[:query]:
        raise ValueError(
            f"{text!r}: a prefill address is host:port, with no query string ({value[query:]})"
        )
    slash = value.find("/")
    if slash >= 0:
        path = value[slash:]
        if path != "/":  # a trailing slash says nothing
            raise ValueError(
                f"{text!r}: a prefill address is host:port, without a path ({path}): each "
                "request goes to the client's own path (/v1/...) there"
            )
        value = value[:slash]
    if not value:
        raise ValueError("empty address")
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1 : close + 2] != ":":
            raise ValueError(f"{text!r}: expected [IPv6]:port")
        host, port_text = value[1:close], value[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r}: missing port")
        if not valid_host(host):
            raise ValueError(f"{text!r}: {host!r} is not a valid host name or IPv4 address")
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be a number from 1 to 65535")
    return Endpoint(host=host.lower(), port=int(port_text))


def parse_pool_entry(text: str, *, schemes: frozenset[str] = PLAIN_SCHEMES) -> Endpoint:
    """A pool entry: ``host:port``, optionally ``#bootstrap_port`` (SGLang)."""
    address, sep, bootstrap = text.partition("#")
    endpoint = parse_endpoint(address, schemes=schemes)
    if not sep:
        return endpoint
    if not _PORT.match(bootstrap.strip()) or not 1 <= int(bootstrap) <= 65535:
        raise ValueError(f"{text!r}: the bootstrap port after '#' must be a number from 1 to 65535")
    return Endpoint(endpoint.host, endpoint.port, int(bootstrap))


def valid_host(host: str) -> bool:
    """A DNS name or an IPv4 address (what may stand before ``:port`` without brackets)."""
    if not host or len(host) > 253:
        return False
    if all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return all(_LABEL.match(label) for label in host.removesuffix(".").split("."))
