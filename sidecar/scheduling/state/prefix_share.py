"""Sharing the prefill prefix index through Redis, without I/O: what a sidecar placed goes out,
what the others placed comes in.

A placement publishes the prompt's block hashes (``prefixes.PrefixHasher``: keyed, so Redis holds
digests nobody without the key can recompute) for its endpoint. They wait in a bounded queue
(``MAX_PENDING`` placements; the oldest are dropped first, counted) until the share's own sync,
off the decision's path: one script call (at most ``SEND_BYTES`` of them) that appends them to a
stream (``{prefix}:prefixes``,
capped at ``STREAM_ENTRIES`` entries, so Redis holds a few MiB at most) and reads the entries
after this sidecar's cursor, at most ``REPLY_BYTES`` of them per call (the rest comes with the
next). A new sidecar starts from the stream's beginning: it learns what the pool was sent lately.

Everything read back is validated before use: an endpoint key of at most ``MAX_KEY_BYTES``, hashes
a multiple of ``DIGEST_BYTES`` long and at most ``MAX_PROMPT_BLOCKS`` of them; anything else is
skipped and counted. The stream key shares the pool's hash tag: on a Redis Cluster it lives in
the pool's slot, with the other keys.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.scheduling.prefixes import DIGEST_BYTES, MAX_PROMPT_BLOCKS
from sidecar.scheduling.state.protocol import MAX_KEY_BYTES

MAX_PENDING = 1024
"""Placements waiting for the share's next sync."""
STREAM_ENTRIES = 4096
"""Placements the stream keeps (approximately: Redis trims whole nodes)."""
SEND_BYTES = 256 * 1024
"""Bytes of hashes one sync sends at most (the rest waits for the next): a burst of long
prompts never makes one script call of megabytes."""
REPLY_BYTES = 64 * 1024
"""Bytes of hashes one sync reads back at most (8,192 blocks: a few milliseconds of the loop to
apply)."""
SYNC_S = 0.25
"""How often the share syncs while there is something to send, and polls otherwise (4 × that)."""

_SCRIPT = """
local sid, cursor, maxlen, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n = tonumber(ARGV[5])
-- A key of another type would fail every sync of every sidecar: deleted, and said.
local repaired = {}
local held = redis.call('TYPE', KEYS[1]).ok
if held ~= 'stream' and held ~= 'none' then
  redis.call('DEL', KEYS[1])
  repaired = {KEYS[1], held}
end
local i = 6
for _ = 1, n do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 's', sid, 'e', ARGV[i], 'h', ARGV[i + 1])
  i = i + 2
end
-- The others' entries after the cursor, read 16 at a time (so that Redis copies few into Lua),
-- 512 at most, until the budget is used. An entry over the bounds (a name over @KEY_BYTES@
-- bytes, hashes over @HASH_BYTES@: no placement's) is never sent: skipped, counted, and the
-- cursor moves past it, as it does past this sidecar's own.
local out, used, last, skipped, read = {}, 0, cursor, 0, 0
local from_id = '-'
if cursor ~= '' then from_id = '(' .. cursor end
local full = false
while not full and read < 512 do
  local range = redis.call('XRANGE', KEYS[1], from_id, '+', 'COUNT', math.min(16, 512 - read))
  for _, entry in ipairs(range) do
    read = read + 1
    local fields = entry[2]
    local from, ep, hashes = nil, nil, nil
    for j = 1, #fields, 2 do
      if fields[j] == 's' then from = fields[j + 1]
      elseif fields[j] == 'e' then ep = fields[j + 1]
      elseif fields[j] == 'h' then hashes = fields[j + 1] end
    end
    local ep_size, hash_size = ep and #ep or 0, hashes and #hashes or 0
    if ep_size > @KEY_BYTES@ or hash_size > @HASH_BYTES@ then
      skipped = skipped + 1
    elseif from ~= sid then
      if used > 0 and used + ep_size + hash_size > budget then full = true; break end
      out[#out + 1] = ep or ''
      out[#out + 1] = hashes or ''
      used = used + ep_size + hash_size
    end
    last = entry[1]
  end
  if #range < 16 then break end
  from_id = '(' .. last
end
redis.call('PEXPIRE', KEYS[1], 3600000)
return {last, out, repaired, skipped}
"""
SCRIPT = _SCRIPT.replace("@KEY_BYTES@", str(MAX_KEY_BYTES)).replace(
    "@HASH_BYTES@", str(MAX_PROMPT_BLOCKS * DIGEST_BYTES)
)
"""KEYS: the stream. ARGV: sidecar id, cursor ('' for the start), the stream's cap, the reply's
byte budget, a count and that many (endpoint, hashes) pairs. Returns the last entry id read,
the others' (endpoint, hashes) pairs, flat, the stream's key and the type it had if it was of
another type (deleted), else nothing, and how many entries over the bounds were passed. The
stream expires an hour after the last sync."""


def stream_key(prefix: str) -> str:
    return "{" + prefix + "}:prefixes"


@dataclass(frozen=True, slots=True)
class Learnt:
    endpoint: str
    hashes: tuple[bytes, ...]


class PrefixShare:
    """The share's state: placements waiting to go out, and the cursor in the stream."""

    def __init__(self, sidecar: str) -> None:
        self.sidecar = sidecar
        self.cursor = ""
        self._pending: deque[tuple[str, bytes]] = deque()
        self.dropped = 0
        """Placements dropped unsent (the queue was full)."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def publish(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((endpoint, b"".join(hashes[:MAX_PROMPT_BLOCKS])))

    def begin(self) -> tuple[list[str | bytes | int], list[tuple[str, bytes]]]:
        """The script's ARGV, and the placements it carries (given back by ``failed``): the
        oldest waiting, up to ``SEND_BYTES`` (at least one)."""
        sending: list[tuple[str, bytes]] = []
        size = 0
        pending = self._pending
        while pending and (not sending or size + len(pending[0][1]) <= SEND_BYTES):
            entry = pending.popleft()
            sending.append(entry)
            size += len(entry[1])
        args: list[str | bytes | int] = [
            self.sidecar,
            self.cursor,
            STREAM_ENTRIES,
            REPLY_BYTES,
            len(sending),
        ]
        for endpoint, hashes in sending:
            args += [endpoint, hashes]
        return args, sending

    def failed(self, sending: list[tuple[str, bytes]]) -> None:
        """The sync failed: what it carried goes with the next one (within the queue's bound)."""
        for endpoint, hashes in reversed(sending):
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                continue
            self._pending.appendleft((endpoint, hashes))

    def received(self, reply: object) -> tuple[list[Learnt], int, tuple[tuple[str, str], ...]]:
        """The others' placements in a reply, how many entries were skipped (malformed, or
        over the bounds and left out by the script), and the key the script found of another
        type and deleted (key, type), if any."""
        if (
            not isinstance(reply, list)
            or len(reply) != 4
            or not isinstance(reply[1], list)
            or not isinstance(reply[2], list)
            or not isinstance(reply[3], int)
        ):
            return [], 1, ()
        last, flat, found, oversized = reply
        repaired = tuple(
            (key.decode("utf-8", "replace"), held.decode("utf-8", "replace"))
            for key, held in zip(found[::2], found[1::2], strict=False)
            if isinstance(key, bytes) and isinstance(held, bytes)
        )[:1]
        if isinstance(last, bytes) and len(last) <= 64:
            self.cursor = last.decode("ascii", "replace")
        learnt: list[Learnt] = []
        skipped = max(0, oversized)
        for j in range(0, len(flat) - 1, 2):
            endpoint, packed = flat[j], flat[j + 1]
            if (
                not isinstance(endpoint, bytes)
                or not isinstance(packed, bytes)
                or not 0 < len(endpoint) <= MAX_KEY_BYTES
                or len(packed) % DIGEST_BYTES
                or len(packed) > MAX_PROMPT_BLOCKS * DIGEST_BYTES
            ):
                skipped += 1
                continue
            hashes = tuple(
                packed[k : k + DIGEST_BYTES] for k in range(0, len(packed), DIGEST_BYTES)
            )
            learnt.append(Learnt(endpoint.decode("utf-8", "replace"), hashes))
        return learnt, skipped, repaired
