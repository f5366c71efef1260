"""Prefill endpoint addresses: ``host:port`` parsing shared by headers and settings.

Accepted forms (protocol.md §2): ``host:port`` where host is a DNS name or an IPv4 address,
``[IPv6]:port``, each optionally behind a legacy ``http://`` prefix. Nothing else: no path, no user
info, no bare IPv6 without brackets, no port outside 1–65535.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_LEGACY_SCHEME = "http://"


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

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Its plain-HTTP URL; engine calls take ``Engines.prefill_url``, which follows
        ``SIDECAR_PREFILL_TLS``."""
        return f"http://{self}"


def parse_endpoint(text: str) -> Endpoint:
    """Parse one ``host:port``; raise ``ValueError`` with a reason a client can act on."""
    value = text.strip()
    if value[: len(_LEGACY_SCHEME)].lower() == _LEGACY_SCHEME:
        value = value[len(_LEGACY_SCHEME) :]
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


def parse_pool_entry(text: str) -> Endpoint:
    """A pool entry: ``host:port``, optionally ``#bootstrap_port`` (SGLang)."""
    address, sep, bootstrap = text.partition("#")
    endpoint = parse_endpoint(address)
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
