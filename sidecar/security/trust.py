"""Which prefill targets a request header may name (SSRF protection).

A header any client can set must not make the sidecar call an arbitrary host. A target is allowed
when it is a member of the known prefill pool (same host string and port, or a resolved address of
a member), lies in ``SIDECAR_PREFILL_ALLOWED_CIDRS``, or has a name in
``SIDECAR_PREFILL_ALLOWED_HOSTS``, or has an address of a pod the InferencePool of
``SIDECAR_INFERENCE_POOL`` selects (``sidecar.security.poolwatch``; until that pool is first listed,
it allows nothing). A host name checked through its addresses is pinned to the
address that passed, so a DNS answer that changes between check and call (rebinding) cannot
redirect the call. With no pool and no allowlist (pure gateway mode, llm-d's default) every target
is allowed, and the start-up log says so once.

Whatever the lists say, a target that is this sidecar itself — its API port on a loopback
address, on one of the pod's own addresses, or on its host name — is refused with 400: the
prefill leg would come back in as a new request (prefill headers stripped) and be computed by the
local engine without staging KV, and the request would then fall back and compute its prompt a
second time.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Protocol

from sidecar.caches import BoundedCache
from sidecar.discovery import Resolver, system_resolver
from sidecar.errors import BadRequest, Forbidden
from sidecar.fleet.endpoints import Endpoint

logger = logging.getLogger("sidecar.security.trust")

IPAddress = IPv4Address | IPv6Address
_CACHE_SIZE = 1024
_CACHE_TTL_S = 30.0


class AddressAllowlist(Protocol):
    """Addresses allowed from elsewhere (``sidecar.security.poolwatch.InferencePoolWatch``)."""

    @property
    def name(self) -> str:
        """What it is, for messages."""
        ...

    @property
    def synced(self) -> bool:
        """Whether it knows its addresses yet: before, it allows nothing."""
        ...

    @property
    def reason(self) -> str:
        """Why it is not synced."""
        ...

    def allows(self, address: IPAddress) -> bool: ...


class PrefillGuard:
    def __init__(
        self,
        *,
        cidrs: tuple[IPv4Network | IPv6Network, ...],
        hosts: tuple[str, ...],
        pool: Callable[[], Iterable[Endpoint]],
        pool_configured: bool,
        allowlist: AddressAllowlist | None = None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._cidrs = cidrs
        self._hosts = frozenset(h.lower().rstrip(".") for h in hosts)
        self._pool = pool
        self._allowlist = allowlist
        self.enforced = bool(cidrs or hosts or pool_configured or allowlist is not None)
        self._resolver = resolver
        self._cache: BoundedCache[str, tuple[float, tuple[IPAddress, ...]]] = BoundedCache(
            _CACHE_SIZE
        )
        self._own_ports: frozenset[int] = frozenset()
        self._own_names: frozenset[str] = frozenset()
        self._own_addresses: frozenset[IPAddress] = frozenset()

    def listening(self, *ports: int, names: Iterable[str], addresses: Iterable[str]) -> None:
        """The sidecar serves its API on ``ports`` (SIDECAR_PORT, and the decode ranks' with
        SIDECAR_RANK_PORTS); ``names`` and ``addresses`` are the pod's own (host name, listen
        address, the host name's addresses)."""
        self._own_ports = frozenset(ports)
        self._own_names = frozenset(n.lower().rstrip(".") for n in names if n) | {"localhost"}
        self._own_addresses = frozenset(a for a in (_ip(x) for x in addresses) if a is not None)

    async def _is_self(self, target: Endpoint) -> bool:
        if target.port not in self._own_ports:
            return False
        host = target.host.rstrip(".")
        literal = _ip(host)
        if literal is not None:
            return self._own_address(literal)
        if host in self._own_names:
            return True
        return any(self._own_address(a) for a in await self._lookup(host, target.port))

    def _own_address(self, address: IPAddress) -> bool:
        if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        return address.is_loopback or address.is_unspecified or address in self._own_addresses

    def warn_if_open(self) -> None:
        if not self.enforced:
            logger.warning(
                "no prefill pool and no SIDECAR_PREFILL_ALLOWED_CIDRS/HOSTS: any prefill target "
                "a request header names will be called. Run behind a gateway that strips "
                "client-supplied x-prefiller-host-port / x-gateway-prefill-endpoints headers."
            )

    async def check(self, target: Endpoint) -> Endpoint:
        """``target`` (possibly pinned to a checked address); ``Forbidden`` when not allowed,
        ``BadRequest`` when it is this sidecar."""
        if await self._is_self(target):
            raise BadRequest(f"prefill target {target} is this sidecar itself")
        if not self.enforced:
            return target
        members = set(self._pool())
        if target in members or target.host.rstrip(".") in self._hosts:
            return target
        # Pool members that are names are resolved too, so "a resolved IP of a member" matches.
        for member in members:
            if _ip(member.host) is None:
                await self._lookup(member.host, member.port)
        literal = _ip(target.host)
        if literal is not None:
            if self._address_allowed(literal, target.port, members):
                return target
            raise self._forbidden(target)
        addresses = await self._lookup(target.host, target.port)
        allowed = [a for a in addresses if self._address_allowed(a, target.port, members)]
        if addresses and len(allowed) == len(addresses):
            return Endpoint(str(allowed[0]), target.port, tls_name=target.host.rstrip("."))
        raise self._forbidden(target)

    def _forbidden(self, target: Endpoint) -> Forbidden:
        if self._allowlist is None:
            return Forbidden(
                f"prefill target {target} is not allowed: not in the prefill pool, "
                "SIDECAR_PREFILL_ALLOWED_CIDRS or SIDECAR_PREFILL_ALLOWED_HOSTS"
            )
        if not self._allowlist.synced:
            return Forbidden(
                f"prefill target {target} is not allowed: {self._allowlist.reason} (until "
                "then it allows no target), and it is not in the prefill pool, "
                "SIDECAR_PREFILL_ALLOWED_CIDRS or SIDECAR_PREFILL_ALLOWED_HOSTS"
            )
        return Forbidden(
            f"prefill target {target} is not allowed: not a pod of {self._allowlist.name}, "
            "nor in the prefill pool, SIDECAR_PREFILL_ALLOWED_CIDRS or "
            "SIDECAR_PREFILL_ALLOWED_HOSTS"
        )

    def _address_allowed(self, address: IPAddress, port: int, members: set[Endpoint]) -> bool:
        if any(address in network for network in self._cidrs):
            return True
        if self._allowlist is not None and self._allowlist.allows(_unmapped(address)):
            return True
        return Endpoint(str(address), port) in members or any(
            self._cached_member_address(member, address) for member in members
        )

    def _cached_member_address(self, member: Endpoint, address: IPAddress) -> bool:
        entry = self._cache.get(f"{member.host}:{member.port}")
        return entry is not None and address in entry[1]

    async def _lookup(self, host: str, port: int) -> tuple[IPAddress, ...]:
        key = f"{host}:{port}"
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < _CACHE_TTL_S:
            return cached[1]
        try:
            found = tuple(
                address
                for address in (_ip(a) for a in await self._resolver(host, port))
                if address is not None
            )
        except OSError:
            found = ()
        self._cache.put(key, (now, found))
        return found


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _unmapped(address: IPAddress) -> IPAddress:
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
