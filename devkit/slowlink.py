"""A slow link on loopback: a TCP relay that holds every byte sent towards its target for a fixed
time before passing it on, as a long network path would; answers come back at once.

Put in front of an engine, it widens the time between a proxy sending a request and the engine
seeing it by exactly the delay, whatever the machine's load: a test that needs a client to leave
inside that window can then leave inside it on any machine, instead of racing a window a fast
engine makes a few milliseconds wide.

    async with SlowLink("127.0.0.1", engine_port, delay_s=1.0) as link:
        ...  # connect to link.url instead of the engine's own URL

Bytes keep their order; each chunk is delivered ``delay_s`` after it arrived (later only behind an
earlier chunk). A connection whose first bytes ``undelayed`` accepts is relayed at once instead: a
client's health polls, on connections of their own, then see the target as it is. A side that closes
closes the other once what it sent has been delivered. What a connection may hold in flight is
bounded (``max_pending_chunks``): past it, reading pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

CHUNK = 64 * 1024


class SlowLink:
    def __init__(
        self,
        host: str,
        port: int,
        delay_s: float,
        *,
        max_pending_chunks: int = 256,
        undelayed: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._target = (host, port)
        self.delay_s = delay_s
        self._undelayed = undelayed
        self._max_pending = max_pending_chunks
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self.relay, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Relay one connection to the target until either side closes: the listener's
        callback, and open to a caller that accepts connections itself (``devkit.gate``)."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            target_r, target_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.close()
            self._connections.discard(task)
            return
        except BaseException:  # stop() while connecting
            client_w.close()
            self._connections.discard(task)
            raise
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._delayed(client_r, target_w))
                group.create_task(_copy(target_r, client_w))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # a side reset the connection: both are closed below
        except* asyncio.CancelledError:
            # stop(): end quietly. (Python 3.11's start_server callback calls exception() on
            # the handler's task, which raises again for a task that ended cancelled.)
            pass
        finally:
            for writer in (client_w, target_w):
                writer.close()
            self._connections.discard(task)

    async def _delayed(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Towards the target: every chunk held until ``delay_s`` after it arrived (none, on a
        connection whose first chunk ``undelayed`` accepts)."""
        delay_s: float | None = None
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self._max_pending)

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if not chunk:  # the sender closed: so does the link, after what it sent
                    with contextlib.suppress(OSError):
                        sink.write_eof()
                    return
                sink.write(chunk)
                await sink.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while True:
                chunk = await source.read(CHUNK)
                if delay_s is None:
                    spared = self._undelayed is not None and self._undelayed(chunk)
                    delay_s = 0.0 if spared else self.delay_s
                await queue.put((time.monotonic() + delay_s, chunk))
                if not chunk:
                    break
            await delivering
        finally:
            delivering.cancel()
            await asyncio.gather(delivering, return_exceptions=True)


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Towards the client: at once. The target closing ends the connection."""
    while chunk := await source.read(CHUNK):
        sink.write(chunk)
        await sink.drain()
    raise ConnectionResetError("the target closed")  # ends the other direction too
