"""The listening sockets of one port: every address of ``SIDECAR_HOST``, bound as written.

The default, ``0.0.0.0,::``, listens on both families, as a Go server on ``:8000`` does, so the
kubelet's probes reach the pod on an IPv6-primary cluster as on an IPv4 one. Each address gets a
socket of its own (``::`` with ``IPV6_V6ONLY``, as asyncio sets it, so that IPv4 clients keep
IPv4 addresses on the ``0.0.0.0`` socket instead of IPv4-mapped ones). A host name stands for
every address it resolves to.

Where IPv6 is disabled (the kernel has no IPv6: the socket cannot be created; or
``net.ipv6.conf.all.disable_ipv6=1``: ``::`` cannot be bound), ``::`` is skipped with one
warning, as long as another address of the list is bound. Any other address that cannot be
bound stops the start (``CannotListen``), the socket already bound closed again.

Port 0 (tests, the demo) picks a free port for the first address, and the others get the same.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable, Sequence
from ipaddress import ip_address

logger = logging.getLogger("sidecar.server.binding")

SocketFactory = Callable[[int, int], socket.socket]
"""``socket.socket(family, type)``, or a stand-in: a test makes IPv6 unavailable with one."""

IPV6_ANY = "::"
FREE_PORT_ATTEMPTS = 8
"""Port 0 with several addresses: a free port found for the first may be taken on another
family; so many tries with a new one."""
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})


class CannotListen(Exception):
    """A port the sidecar cannot bind (in use, not permitted); its message is one log line."""


async def bind(
    hosts: Sequence[str],
    port: int,
    variable: str,
    *,
    make_socket: SocketFactory = socket.socket,
) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address of ``hosts`` on ``port``, the same
    port on each (0: a free one). ``variable`` names the port's setting in error messages."""
    addresses = [(host, info) for host in hosts for info in await _resolve(host, port, variable)]
    for _ in range(FREE_PORT_ATTEMPTS if port == 0 else 1):
        try:
            return _bind_all(addresses, port, variable, make_socket)
        except _PortTaken:
            continue  # the free port of the first address is in use on another
    raise CannotListen(
        f"cannot listen on {', '.join(hosts)} ({variable}): no free port on every address"
    )


def display(host: str, port: int) -> str:
    """``host:port``, IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reachable(sockets: Sequence[socket.socket]) -> tuple[str, int]:
    """An address of these sockets a local client can connect to (``0.0.0.0`` and ``::``
    stand for their loopback), IPv4 first, and the port."""
    first = min(sockets, key=lambda sock: sock.family != socket.AF_INET)
    host, port = first.getsockname()[:2]
    return {"0.0.0.0": "127.0.0.1", IPV6_ANY: "::1"}.get(host, host), port


Resolved = tuple[int, tuple[object, ...]]
"""(address family, socket address) as ``getaddrinfo`` gives them."""


class _PortTaken(Exception):
    pass


async def _resolve(host: str, port: int, variable: str) -> list[Resolved]:
    flags = socket.AI_PASSIVE
    if _is_literal(host):
        flags |= socket.AI_NUMERICHOST  # no look-up, and no thread for one
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=flags
        )
    except socket.gaierror as exc:
        # getaddrinfo's errors are not errno values: os.strerror(-2) says "unknown error -2".
        raise CannotListen(
            f"cannot listen on {display(host, port)} (SIDECAR_HOST): the name {host} did not "
            f"resolve ({exc.strerror or exc})"
        ) from exc
    found: list[Resolved] = []
    for family, _, _, _, address in infos:
        if (family, address) not in found:
            found.append((family, address))
    return found


def _bind_all(
    addresses: Sequence[tuple[str, Resolved]],
    port: int,
    variable: str,
    make_socket: SocketFactory,
) -> list[socket.socket]:
    bound: list[socket.socket] = []
    skipped: list[tuple[str, OSError]] = []
    try:
        for host, (family, address) in addresses:
            at = port or (bound[0].getsockname()[1] if bound else 0)
            try:
                bound.append(_bind_one(family, (address[0], at, *address[2:]), make_socket))
            except OSError as exc:
                if port == 0 and bound and exc.errno == errno.EADDRINUSE:
                    raise _PortTaken from exc
                if host == IPV6_ANY and exc.errno in _NO_IPV6:
                    skipped.append((host, exc))
                    continue
                raise CannotListen(
                    f"cannot listen on {display(str(address[0]), at)} ({variable}): {_reason(exc)}"
                ) from exc
        if not bound:
            host, error = skipped[0]
            raise CannotListen(
                f"cannot listen on {display(host, port)} ({variable}): {_reason(error)} "
                "(IPv6 is disabled on this host: listen on 0.0.0.0)"
            ) from error
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    for host, error in skipped:
        logger.warning(
            "not listening on %s (%s): IPv6 is disabled on this host (%s); IPv4 only",
            display(host, bound[0].getsockname()[1]),
            variable,
            _reason(error),
        )
    return bound


def _bind_one(
    family: int, address: tuple[object, ...], make_socket: SocketFactory
) -> socket.socket:
    sock = make_socket(family, socket.SOCK_STREAM)
    try:
        # What asyncio's create_server sets: a restarted sidecar binds at once, past TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # IPv4 has 0.0.0.0
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _is_literal(host: str) -> bool:
    try:
        ip_address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)
