"""A gate on loopback: a TCP relay in front of a target whose listener can be held shut, so that a
new connection to it hangs in ``connect`` as it does toward a host that cannot accept (its listen
queue full, SYNs lost), while the connections already open keep flowing.

Held, the gate stops accepting and shrinks its listen queue to one connection, which a connection of
its own fills: the kernel then drops every new SYN, and the connecting side sends it again 1 s
later, then at intervals its kernel sets (on Linux 6.x, with ``tcp_syn_linear_timeouts``, every
second for the first four). Opened again, it accepts what waits and relays it; a SYN sent again
after that is answered.

    async with Gate("127.0.0.1", engine_port) as gate:
        ...  # connect to gate.url instead of the engine's own URL
        await gate.hold()  # new connections hang from here
        await gate.open()  # and are taken again from here
"""

from __future__ import annotations

import asyncio
import socket
from types import TracebackType
from typing import Self

from devkit.slowlink import SlowLink
from sidecar.tasks import stop_task

OPEN_BACKLOG = 128
FILLER_CONNECT_S = 0.2
"""The filler's connect, on loopback, completes at once when the queue has room."""


class Gate:
    def __init__(self, host: str, port: int) -> None:
        self._link = SlowLink(host, port, 0.0)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._filler: socket.socket | None = None
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=OPEN_BACKLOG)
        self._listener.setblocking(False)
        self._accepting = asyncio.create_task(self._accept())
        return self

    async def hold(self) -> None:
        """From now on a new connection hangs in ``connect``; open ones are untouched."""
        assert self._listener is not None, "start() first"
        await self._stop_accepting()
        self._listener.listen(0)  # room for one waiting connection: the filler's
        loop = asyncio.get_running_loop()
        while self._filler is None:
            # A connection that came before the filler's would take its place: relayed, as
            # one that came before the hold, and the filler tries again. On loopback a connect
            # to a queue with room completes at once.
            self._take_waiting()
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                async with asyncio.timeout(FILLER_CONNECT_S):
                    await loop.sock_connect(filler, ("127.0.0.1", self.port))
            except TimeoutError:
                filler.close()
                continue
            self._filler = filler

    async def open(self) -> None:
        """Accept again: what waits in the queue, and every connection after it."""
        assert self._listener is not None, "start() first"
        self._listener.listen(OPEN_BACKLOG)
        if self._filler is not None:
            self._filler.close()  # accepted below, and closed at once by its relay
            self._filler = None
        if self._accepting is None:
            self._accepting = asyncio.create_task(self._accept())

    async def stop(self) -> None:
        await self._stop_accepting()
        if self._filler is not None:
            self._filler.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _stop_accepting(self) -> None:
        if self._accepting is not None:
            await stop_task(self._accepting)
            self._accepting = None

    def _take_waiting(self) -> None:
        """Relay every connection waiting in the queue, without waiting for one."""
        assert self._listener is not None
        while True:
            try:
                connection, _ = self._listener.accept()
            except BlockingIOError:
                return
            self._relay(connection)

    async def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            self._relay(connection)

    def _relay(self, connection: socket.socket) -> None:
        async def relay() -> None:
            try:
                reader, writer = await asyncio.open_connection(sock=connection)
            except BaseException:
                connection.close()
                raise
            await self._link.relay(reader, writer)

        task = asyncio.create_task(relay())
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)
