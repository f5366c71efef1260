"""Listening (``sidecar.server.binding``): SIDECAR_HOST's addresses on both ports, both families
by default, IPv4 alone where IPv6 is disabled (made unavailable here by the socket factory the
sidecar is given, not by changing the machine). Every client connects to loopback."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.emulator import RunningEmulator
from sidecar.server.binding import SocketFactory
from sidecar.server.runner import CannotListen, RunningSidecar, start_sidecar
from tests.conftest import eventually, metric
from tests.test_tls import listener_settings, secret_with
from tests.tlsfiles import Pki

Start = Callable[..., Awaitable[RunningSidecar]]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


HAS_IPV6 = _has_ipv6_loopback()
needs_ipv6 = pytest.mark.skipif(not HAS_IPV6, reason="this machine has no ::1")


class NoBind(socket.socket):
    """A socket of a host where IPv6 is disabled by sysctl: created, but ``::`` cannot be
    bound."""

    def bind(self, address: Any) -> None:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")


def no_ipv6_kernel(family: int, kind: int) -> socket.socket:
    """A kernel without IPv6: no AF_INET6 socket at all."""
    if family == socket.AF_INET6:
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
    return socket.socket(family, kind)


def ipv6_disabled(family: int, kind: int) -> socket.socket:
    if family == socket.AF_INET6:
        return NoBind(family, kind)
    return socket.socket(family, kind)


@pytest.fixture
async def start(decode: RunningEmulator) -> AsyncIterator[Start]:
    """A sidecar in front of ``decode`` on free ports, SIDECAR_HOST at its default unless a
    keyword sets it; ``make_socket`` goes to ``start_sidecar``."""
    started: list[RunningSidecar] = []

    async def start(make_socket: SocketFactory = socket.socket, **overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "port": 0,
            "admin_port": 0,
            "decode_url": decode.url,
            "ready_interval_s": 0.05,
        }
        values.update(overrides)
        sidecar = await start_sidecar(Settings(**values), make_socket=make_socket)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()


async def answers(http: aiohttp.ClientSession, host: str, port: int, path: str = "/health") -> bool:
    """Whether ``host:port`` answers ``path`` with 200 (False: refused)."""
    url = f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"
    try:
        async with http.get(url) as response:
            await response.read()
            return response.status == 200
    except aiohttp.ClientConnectorError:
        return False


def ports(sidecar: RunningSidecar) -> tuple[int, int]:
    assert sidecar.admin_port is not None
    return sidecar.port, sidecar.admin_port


async def test_the_default_listens_on_ipv4_and_ipv6(
    http: aiohttp.ClientSession, start: Start
) -> None:
    """SIDECAR_HOST's default, 0.0.0.0,:: — before, 0.0.0.0 alone: an IPv6 client (the kubelet
    of an IPv6-primary cluster) was refused. Both ports, one port number on both families; the
    URL the runner reports stays one a local client can use."""
    assert Settings().host == ("0.0.0.0", "::")
    sidecar = await start()
    api, admin = ports(sidecar)
    assert sidecar.url == f"http://127.0.0.1:{api}"
    assert sidecar.listening == [f"0.0.0.0:{api}", f"[::]:{api}"]
    await eventually(lambda: answers(http, "127.0.0.1", api, "/ready"))
    for port in (api, admin):
        assert await answers(http, "127.0.0.1", port)
    if HAS_IPV6:  # the IPv6 half needs a ::1 on this machine
        for port in (api, admin):
            assert await answers(http, "::1", port)
        assert await answers(http, "::1", api, "/ready")


@needs_ipv6
async def test_a_list_binds_each_address(http: aiohttp.ClientSession, start: Start) -> None:
    """A comma list (before: getaddrinfo's "unknown error -2"), brackets allowed; what is not
    listed is not listened on."""
    sidecar = await start(host="127.0.0.1, [::1]")
    api, admin = ports(sidecar)
    assert sidecar.listening == [f"127.0.0.1:{api}", f"[::1]:{api}"]
    for port in (api, admin):
        assert await answers(http, "127.0.0.1", port)
        assert await answers(http, "::1", port)
        assert not await answers(http, "127.0.0.2", port)  # 0.0.0.0 would have taken it


@needs_ipv6
async def test_ipv6_alone_is_ipv6_only(http: aiohttp.ClientSession, start: Start) -> None:
    """Each address is bound as written: :: does not take IPv4 (0.0.0.0 does, in the default)."""
    sidecar = await start(host="::")
    api, _ = ports(sidecar)
    assert sidecar.url == f"http://[::1]:{api}"
    assert await answers(http, "::1", api)
    assert not await answers(http, "127.0.0.1", api)


@pytest.mark.parametrize("make_socket", [no_ipv6_kernel, ipv6_disabled])
async def test_where_ipv6_is_disabled_the_default_listens_on_ipv4(
    http: aiohttp.ClientSession,
    start: Start,
    caplog: pytest.LogCaptureFixture,
    make_socket: SocketFactory,
) -> None:
    """No AF_INET6 socket (a kernel without IPv6), or :: that cannot be bound
    (disable_ipv6=1): :: is skipped with one warning per port, the start goes on."""
    caplog.set_level(logging.WARNING, logger="sidecar.server.binding")
    sidecar = await start(make_socket)
    api, admin = ports(sidecar)
    assert sidecar.listening == [f"0.0.0.0:{api}"]
    for port in (api, admin):
        assert await answers(http, "127.0.0.1", port)
        if HAS_IPV6:
            assert not await answers(http, "::1", port)
    warnings = [r.getMessage() for r in caplog.records if "IPv6 is disabled" in r.getMessage()]
    assert warnings == [
        f"not listening on [::]:{api} (SIDECAR_PORT): IPv6 is disabled on this host "
        f"({_reason(make_socket)}); IPv4 only",
        f"not listening on [::]:{admin} (SIDECAR_ADMIN_PORT): IPv6 is disabled on this host "
        f"({_reason(make_socket)}); IPv4 only",
    ]


def _reason(make_socket: SocketFactory) -> str:
    code = errno.EAFNOSUPPORT if make_socket is no_ipv6_kernel else errno.EADDRNOTAVAIL
    return os.strerror(code).lower()


async def test_ipv6_alone_where_it_is_disabled_stops_the_start(start: Start) -> None:
    with pytest.raises(CannotListen) as raised:
        await start(ipv6_disabled, host="::")
    assert str(raised.value) == (
        "cannot listen on [::]:0 (SIDECAR_PORT): cannot assign requested address "
        "(IPv6 is disabled on this host: listen on 0.0.0.0)"
    )


async def test_an_address_in_use_stops_the_start_naming_it(start: Start) -> None:
    """The first address binds, the second cannot: the start fails naming it, and the first
    socket is closed again (its port free)."""
    with socket.socket() as taken:
        port = _bind_below_the_ephemeral_range(taken, "127.0.0.2")
        taken.listen()
        with pytest.raises(CannotListen) as raised:
            await start(host="127.0.0.1,127.0.0.2", port=port)
    assert str(raised.value) == (
        f"cannot listen on 127.0.0.2:{port} (SIDECAR_PORT): address already in use"
    )
    with socket.socket() as again:  # 127.0.0.1's socket was closed: the port is free
        again.bind(("127.0.0.1", port))


def _bind_below_the_ephemeral_range(sock: socket.socket, host: str) -> int:
    """A port below Linux's ephemeral range (32768 and up), free on ``host`` and on 127.0.0.1:
    no outgoing connection of another test takes it as its local port meanwhile, as one can take
    a port the kernel handed out."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port below the ephemeral range")


@needs_ipv6
async def test_one_connection_cap_over_every_address(
    http: aiohttp.ClientSession, start: Start
) -> None:
    """The listener's connection book covers all its sockets: connections on both families count
    against one SIDECAR_MAX_CONNECTIONS."""
    sidecar = await start(host="127.0.0.1,::1")
    api, _ = ports(sidecar)
    gauge = 'pd_sidecar_client_connections{listener="api"}'
    async with contextlib.AsyncExitStack() as stack:
        for host in ("127.0.0.1", "::1"):
            await stack.enter_async_context(_connection(host, api))

        async def both_counted() -> bool:
            return await metric(http, sidecar.admin_url, gauge) == 2

        await eventually(both_counted)


@contextlib.asynccontextmanager
async def _connection(host: str, port: int) -> AsyncIterator[tuple[Any, Any]]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@needs_ipv6
async def test_tls_serves_on_every_address(
    http: aiohttp.ClientSession, start: Start, tmp_path: Path
) -> None:
    """SIDECAR_TLS_*: HTTPS on each socket of both ports, none of them plain."""
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("127.0.0.1", "::1")
    secret = secret_with(tmp_path / "secret", cert)
    sidecar = await start(host="127.0.0.1,::1", **listener_settings(secret))
    api, admin = ports(sidecar)
    assert sidecar.url == f"https://127.0.0.1:{api}"
    connector = aiohttp.TCPConnector(ssl=pki.client_context())
    async with aiohttp.ClientSession(connector=connector) as trusting:
        for url in (
            f"https://{host}:{port}" for host in ("127.0.0.1", "[::1]") for port in (api, admin)
        ):
            async with trusting.get(url + "/health") as response:
                assert response.status == 200
            with pytest.raises(aiohttp.ClientError):  # plain HTTP on it is no request
                async with http.get(url.replace("https://", "http://") + "/health"):
                    pass


async def test_a_host_name_binds_what_it_resolves_to(
    http: aiohttp.ClientSession, start: Start
) -> None:
    infos = await asyncio.get_running_loop().getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)
    resolved = {str(info[4][0]) for info in infos}
    sidecar = await start(host="localhost")
    api, _ = ports(sidecar)
    assert sorted(sidecar.listening) == sorted(
        f"[{address}]:{api}" if ":" in address else f"{address}:{api}" for address in resolved
    )
    for address in resolved:
        assert await answers(http, address, api)
