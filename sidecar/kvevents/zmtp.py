"""A bounded ZMTP 3.x client: the subscriber's connections to an engine's PUB and replay ROUTER.

libzmq bounds each frame (``ZMQ_MAXMSGSIZE``) but not the frames of a message, and assembles a
whole multipart message before it delivers any of it: one message of 200 frames of 2 MiB costs
400 MiB, and no libzmq option bounds that. This reader checks each frame's header against
:class:`Limits` before it reads the body — the frame's size, the frames of the message so far,
the message's bytes so far — and ends the connection on the first one over: nothing over the
bounds is ever read, let alone held.

What it speaks, from the specifications (rfc.zeromq.org 23/ZMTP, ZMTP 3.0, and 37/ZMTP, 3.1):

- the 64-byte greeting: signature ``FF 00*8 7F``, version 3.1, mechanism ``NULL`` (padded to
  20 bytes), as-server 0, 31 bytes of filler. The peer's must be version 3.x or later and NULL:
  CURVE and PLAIN are not supported (an engine's events are not authenticated anyway, which is
  why every message is checked as hostile);
- commands (flag ``0x04``): ``READY`` with ``Socket-Type`` (and an empty ``Identity`` for a
  DEALER: the ROUTER names it), the peer's checked against ours (a SUB talks to a PUB or XPUB,
  a DEALER to a ROUTER or DEALER); ``ERROR`` ends the connection;
- a subscription: ZMTP 3.1's ``SUBSCRIBE`` command to a 3.1 peer, ZMTP 3.0's message of the
  topic prefixed with ``0x01`` to a 3.0 one (the peer's greeting says which);
- frames: flags ``MORE`` 0x01, ``LONG`` 0x02 (an 8-byte size, network order, instead of one
  byte), ``COMMAND`` 0x04, the other bits zero;
- heartbeats, ZMTP 3.1: a ``PING`` (TTL 0: the peer keeps its own timeouts) every
  ``heartbeat_s``, and a connection that brings nothing for ``3 * heartbeat_s`` while read is
  lost; a peer's ``PING`` is answered with a ``PONG`` echoing its context. A 3.0 peer knows no
  heartbeats: no ``PING`` is sent, and only TCP tells that it went away.

Memory, per connection: the stream's buffer (``_READ_CHUNK``, asyncio pauses the socket past
twice that), the message being read (at most ``max_message_bytes``, and for a moment a second
copy of a long frame, assembled from its chunks), the messages read and not
taken yet (``max_queued``, the high-water mark: the reader stops reading the socket, and the
rest waits in the kernel's buffers and on the peer's side), and what is written but not sent
(``MAX_WRITE_BUFFER``: a peer that does not read its PONGs is ended).

No I/O happens outside this module for the subscriber's sockets: :func:`connect` opens a
connection, :class:`Connection` reads it in a task of its own and hands messages over.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import deque
from dataclasses import dataclass
from typing import Final

SIGNATURE: Final = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING_BYTES: Final = 64
MECHANISM_NULL: Final = b"NULL".ljust(20, b"\x00")
VERSION: Final = (3, 1)

FLAG_MORE: Final = 0x01
FLAG_LONG: Final = 0x02
FLAG_COMMAND: Final = 0x04
_FLAGS_KNOWN: Final = FLAG_MORE | FLAG_LONG | FLAG_COMMAND

_PEERS: Final = {b"SUB": (b"PUB", b"XPUB"), b"DEALER": (b"ROUTER", b"DEALER")}
"""The peer socket types each of ours may talk to (ZMTP's socket-type compatibility)."""

MAX_COMMAND_BYTES: Final = 16 * 1024
"""A command's body at most: a READY's properties (a socket type, an identity of at most 255
bytes, whatever metadata a peer adds), a PING's 18 bytes, an ERROR's reason."""
MAX_WRITE_BUFFER: Final = 64 * 1024
"""What may wait to be sent to a peer: more, and the peer is not reading (its PONGs pile up)."""
_READ_CHUNK: Final = 64 * 1024
"""The stream's buffer limit, and the most of a frame's body read at once."""
_PING_TTL: Final = 0
_MAX_PING_CONTEXT: Final = 16
_CLOSE_S: Final = 1.0
"""How long ``close`` waits for the reader to see the end of its stream."""


class ZmtpError(Exception):
    """The connection ended: closed, lost, refused, or the peer broke the protocol or a bound."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection reads at most: each checked on a frame's header, before its body."""

    max_frame_bytes: int
    """One frame's body."""
    max_frames: int
    """Frames in one message."""
    max_message_bytes: int
    """One message's frames' bodies in all."""
    max_queued: int = 4
    """Messages read and not taken yet: past it, the socket is not read."""

    def held_bytes(self) -> int:
        """The most a connection holds in messages: queued, one being read (and the copy of a
        frame being assembled), the stream's buffer."""
        return (
            (self.max_queued + 1) * self.max_message_bytes + self.max_frame_bytes + 2 * _READ_CHUNK
        )


def greeting(minor: int = VERSION[1]) -> bytes:
    """Our greeting: signature, version 3.``minor``, NULL, as-server 0, filler."""
    data = SIGNATURE + bytes((VERSION[0], minor)) + MECHANISM_NULL + b"\x00" + b"\x00" * 31
    assert len(data) == GREETING_BYTES
    return data


def frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One frame: flags, a 1- or 8-byte size, the body."""
    flags = (FLAG_MORE if more else 0) | (FLAG_COMMAND if command else 0)
    if len(body) <= 255:
        return bytes((flags, len(body))) + body
    return bytes((flags | FLAG_LONG,)) + struct.pack(">Q", len(body)) + body


def command(name: bytes, data: bytes = b"") -> bytes:
    """A command frame: the name's length, the name, its data."""
    return frame(bytes((len(name),)) + name + data, command=True)


_PING: Final = command(b"PING", struct.pack(">H", _PING_TTL))


def ready_command(socket_type: bytes, identity: bytes | None = None) -> bytes:
    """A READY command with ``Socket-Type`` (and ``Identity``)."""
    properties = [(b"Socket-Type", socket_type)]
    if identity is not None:
        properties.append((b"Identity", identity))
    data = b"".join(
        bytes((len(name),)) + name + struct.pack(">I", len(value)) + value
        for name, value in properties
    )
    return command(b"READY", data)


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """A READY's properties; raises :class:`ZmtpError` when they do not add up."""
    properties: dict[bytes, bytes] = {}
    at = 0
    while at < len(data):
        size = data[at]
        name = data[at + 1 : at + 1 + size]
        at += 1 + size
        if len(name) != size or at + 4 > len(data):
            raise ZmtpError("a malformed READY")
        (length,) = struct.unpack_from(">I", data, at)
        at += 4
        if at + length > len(data):
            raise ZmtpError("a malformed READY")
        properties[name.lower()] = data[at : at + length]
        at += length
    return properties


def split_command(body: bytes) -> tuple[bytes, bytes]:
    """A command's name and data."""
    if not body or len(body) < 1 + body[0]:
        raise ZmtpError("a malformed command")
    return body[1 : 1 + body[0]], body[1 + body[0] :]


class Connection:
    """One ZMTP connection, read by a task of its own into a queue of ``limits.max_queued``
    messages; :meth:`take` hands them over, :meth:`send` writes one. ``ready`` is set whenever
    a message is queued or the connection ends (it may be shared by several connections: its
    waiter clears it, then looks at each)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        limits: Limits,
        peer_minor: int,
        heartbeat_s: float,
        ready: asyncio.Event,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.limits = limits
        self.peer_minor = peer_minor
        self._heartbeat_s = heartbeat_s
        self._ready = ready
        self._queue: deque[list[bytes]] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self.error: ZmtpError | None = None
        """Why the connection ended (None: open)."""
        self.bytes_read = 0
        """Bytes read from the socket since the greeting's end, frames' headers included."""
        self.messages_read = 0
        self.pings_sent = 0
        self._reading: asyncio.Task[None] | None = asyncio.create_task(
            self._read_forever(), name="zmtp read"
        )
        self._ping_at: asyncio.TimerHandle | None = None
        if peer_minor >= 1 and heartbeat_s > 0:
            self._ping_at = asyncio.get_running_loop().call_later(heartbeat_s, self._ping)

    @property
    def ready(self) -> asyncio.Event:
        """Set when a message is queued or the connection ends (maybe shared)."""
        return self._ready

    @property
    def pending(self) -> bool:
        """Whether :meth:`take` has something to say: a message, or the end."""
        return bool(self._queue) or self.error is not None

    def take(self) -> list[bytes] | None:
        """The oldest message read (None: none yet); raises :class:`ZmtpError` once the
        connection ended (what it had queued is dropped: the caller resets anyway)."""
        if self.error is not None:
            raise ZmtpError(str(self.error))
        if not self._queue:
            return None
        message = self._queue.popleft()
        self._room.set()
        return message

    async def wait(self) -> None:
        """Until :attr:`pending`."""
        while not self.pending:
            self._ready.clear()
            await self._ready.wait()

    def send(self, frames: list[bytes]) -> None:
        """Write a message (its frames); raises :class:`ZmtpError` if the connection ended."""
        if self.error is not None:
            raise ZmtpError(str(self.error))
        data = b"".join(frame(body, more=i < len(frames) - 1) for i, body in enumerate(frames))
        self._write(data)

    async def close(self) -> None:
        """End the connection at once (nothing unsent is kept: ZMQ's linger 0)."""
        self._end(ZmtpError("closed"))
        # The reader ends on its own, at the end of the stream the abort brings. Cancelling it
        # would keep what it was reading: the cancelled task keeps its CancelledError, whose
        # traceback's frames hold the frame being read and the timeout that refers back to the
        # task, a cycle only the garbage collector's rare full passes free.
        reading, self._reading = self._reading, None
        if reading is not None:
            await asyncio.wait({reading}, timeout=_CLOSE_S)
            if not reading.done():  # never seen; a bound on close's wait all the same
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)

    # -- internals -------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self._writer.transport.get_write_buffer_size() + len(data) > MAX_WRITE_BUFFER:
            error = ZmtpError("the peer does not read what is sent to it")
            self._end(error)
            raise error
        self._writer.write(data)

    def _end(self, error: ZmtpError) -> None:
        if self.error is None:
            # A copy, never raised: the error raised holds its traceback, whose frames hold
            # what was being read (a frame's megabytes) and this connection, a cycle that only
            # the garbage collector's rare full passes would free.
            self.error = ZmtpError(str(error))
            self._queue.clear()
            self._writer.transport.abort()
            if self._ping_at is not None:
                self._ping_at.cancel()
            self._room.set()  # a reader waiting for room: it sees the end
            self._ready.set()

    async def _read_forever(self) -> None:
        try:
            while self.error is None:
                message = await self._read_message()
                if self.error is not None:
                    return
                self.messages_read += 1
                self._queue.append(message)
                self._ready.set()
                if len(self._queue) >= self.limits.max_queued:
                    self._room.clear()
                    await self._room.wait()  # not timed: the peer is not the one late
        except ZmtpError as exc:
            self._end(exc)
        except TimeoutError:  # before OSError, its base class
            self._end(ZmtpError(f"nothing received in {3 * self._heartbeat_s:g}s of heartbeats"))
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._end(ZmtpError(f"connection lost ({exc.__class__.__name__})"))
        except Exception as exc:  # a bug must not leave the connection open and unread
            self._end(ZmtpError(f"the reader failed: {exc!r}"))
            raise

    def _ping(self) -> None:
        """Send a PING, and the next one in ``heartbeat_s`` (a timer, not a task: nothing to
        cancel mid-await)."""
        if self.error is not None:
            return
        with contextlib.suppress(ZmtpError):
            self._write(_PING)
            self.pings_sent += 1
            self._ping_at = asyncio.get_running_loop().call_later(self._heartbeat_s, self._ping)

    async def _read(self, size: int) -> bytes:
        """``size`` bytes; with heartbeats, a wait of ``3 * heartbeat_s`` for the next ones
        is a lost peer (each chunk of a long frame restarts it)."""
        timed = self.peer_minor >= 1 and self._heartbeat_s > 0
        if size <= _READ_CHUNK:
            async with asyncio.timeout(3 * self._heartbeat_s if timed else None):
                data = await self._reader.readexactly(size)
            self.bytes_read += size
            return data
        parts = bytearray()
        while len(parts) < size:
            async with asyncio.timeout(3 * self._heartbeat_s if timed else None):
                chunk = await self._reader.readexactly(min(_READ_CHUNK, size - len(parts)))
            parts += chunk
            self.bytes_read += len(chunk)
        return bytes(parts)

    async def _read_message(self) -> list[bytes]:
        limits = self.limits
        frames: list[bytes] = []
        total = 0
        while True:
            flags, size = await self._read_header()
            if flags & FLAG_COMMAND:
                if frames:
                    raise ZmtpError("a command inside a message")
                await self._on_command(await self._read(size))
                continue
            if size > limits.max_frame_bytes:
                raise ZmtpError(f"a frame of {size} bytes > {limits.max_frame_bytes}")
            if len(frames) >= limits.max_frames:
                raise ZmtpError(f"a message of more than {limits.max_frames} frames")
            total += size
            if total > limits.max_message_bytes:
                raise ZmtpError(f"a message of more than {limits.max_message_bytes} bytes")
            frames.append(await self._read(size) if size else b"")
            if not flags & FLAG_MORE:
                return frames

    async def _read_header(self) -> tuple[int, int]:
        flags = (await self._read(1))[0]
        if flags & ~_FLAGS_KNOWN:
            raise ZmtpError(f"a frame with unknown flags {flags:#04x}")
        if flags & FLAG_COMMAND and flags & FLAG_MORE:
            raise ZmtpError("a command with more frames")
        if flags & FLAG_LONG:
            (size,) = struct.unpack(">Q", await self._read(8))
        else:
            size = (await self._read(1))[0]
        if flags & FLAG_COMMAND and size > MAX_COMMAND_BYTES:
            raise ZmtpError(f"a command of {size} bytes > {MAX_COMMAND_BYTES}")
        return flags, size

    async def _on_command(self, body: bytes) -> None:
        name, data = split_command(body)
        if name == b"PING":
            if len(data) < 2 or len(data) - 2 > _MAX_PING_CONTEXT:
                raise ZmtpError("a malformed PING")
            self._write(command(b"PONG", data[2:]))
        elif name == b"ERROR":
            raise ZmtpError(f"the peer said ERROR {_reason(data)!r}")
        # PONG: traffic, which is all a heartbeat asks; anything else (a late READY, a
        # command of a later version) is ignored, as ZMTP asks of unknown commands.


def _reason(data: bytes) -> str:
    return data[1 : 1 + data[0]].decode("utf-8", "replace") if data else ""


async def connect(
    host: str,
    port: int,
    *,
    socket_type: bytes,
    limits: Limits,
    heartbeat_s: float,
    ready: asyncio.Event,
    subscribe: bytes | None = None,
) -> Connection:
    """Connect to ``host:port`` and complete the handshake as ``socket_type`` (``SUB``,
    ``DEALER``), subscribed to ``subscribe`` (a SUB). Raises :class:`ZmtpError` (or
    ``OSError``); the caller bounds the time it takes."""
    reader, writer = await asyncio.open_connection(
        host.removeprefix("[").removesuffix("]"), port, limit=_READ_CHUNK
    )
    try:
        identity = b"" if socket_type == b"DEALER" else None
        writer.write(greeting() + ready_command(socket_type, identity))
        peer = await reader.readexactly(GREETING_BYTES)
        if peer[0] != 0xFF or peer[9] != 0x7F:
            raise ZmtpError("not a ZMTP peer")
        major, minor = peer[10], peer[11]
        if major < 3:
            raise ZmtpError(f"ZMTP {major}.{minor} is not supported (3.0 or later)")
        if peer[12:32] != MECHANISM_NULL:
            mechanism = peer[12:32].rstrip(b"\x00").decode("ascii", "replace")
            raise ZmtpError(f"the security mechanism {mechanism!r} is not supported (NULL)")
        peer_minor = 1 if major > 3 else minor
        peer_type = await _peer_ready(reader)
        if peer_type not in _PEERS.get(socket_type, ()):
            raise ZmtpError(f"a {socket_type.decode()} cannot talk to a {peer_type!r}")
        if subscribe is not None:
            if peer_minor >= 1:
                writer.write(command(b"SUBSCRIBE", subscribe))
            else:
                writer.write(frame(b"\x01" + subscribe))
    except asyncio.IncompleteReadError:
        writer.transport.abort()
        raise ZmtpError("the peer closed the connection during the handshake") from None
    except BaseException:
        writer.transport.abort()
        raise
    return Connection(
        reader, writer, limits=limits, peer_minor=peer_minor, heartbeat_s=heartbeat_s, ready=ready
    )


async def _peer_ready(reader: asyncio.StreamReader) -> bytes:
    """The peer's READY: its socket type."""
    flags = (await reader.readexactly(1))[0]
    if not flags & FLAG_COMMAND or flags & (FLAG_MORE | ~_FLAGS_KNOWN):
        raise ZmtpError("the handshake did not start with a command")
    if flags & FLAG_LONG:
        (size,) = struct.unpack(">Q", await reader.readexactly(8))
    else:
        size = (await reader.readexactly(1))[0]
    if size > MAX_COMMAND_BYTES:
        raise ZmtpError(f"a command of {size} bytes > {MAX_COMMAND_BYTES}")
    name, data = split_command(await reader.readexactly(size))
    if name == b"ERROR":
        raise ZmtpError(f"the peer said ERROR {_reason(data)!r}")
    if name != b"READY":
        raise ZmtpError(f"the handshake's command was {name!r}, not READY")
    return parse_properties(data).get(b"socket-type", b"")
