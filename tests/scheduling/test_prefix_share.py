"""The prefix share's state without I/O: bounded sending, validated reading."""

from __future__ import annotations

from sidecar.scheduling.state.prefix_share import (
    MAX_PENDING,
    SEND_BYTES,
    PrefixShare,
)

DIGEST = b"\x01" * 8


def test_a_sync_sends_the_oldest_placements_within_its_byte_budget() -> None:
    share = PrefixShare("me")
    big = [DIGEST] * 4096  # 32 KiB of hashes, the most one placement carries
    for n in range(20):
        share.publish(f"127.0.0.11:{8000 + n}", big)
    args, sending = share.begin()
    assert len(sending) == SEND_BYTES // (4096 * 8) == 8
    assert args[:5] == ["me", "", 4096, 64 * 1024, 8]
    assert args[5] == "127.0.0.11:8000"  # the oldest first
    assert share.pending == 12
    # A failed sync gives them back, in order, before the newer ones.
    share.failed(sending)
    assert share.pending == 20
    assert share.begin()[1][0][0] == "127.0.0.11:8000"


def test_the_queue_is_bounded_dropping_the_oldest() -> None:
    share = PrefixShare("me")
    for n in range(MAX_PENDING + 5):
        share.publish("127.0.0.11:8000", [n.to_bytes(8, "big")])
    assert share.pending == MAX_PENDING
    assert share.dropped == 5
    assert share.begin()[1][0][1] == (5).to_bytes(8, "big")


def test_what_is_read_back_is_validated_and_the_cursor_moves() -> None:
    share = PrefixShare("me")
    reply = [
        b"1700000000000-3",
        [
            b"127.0.0.11:8000",
            DIGEST * 3,  # good
            b"127.0.0.12:8000",
            b"odd",  # not whole digests
            b"",
            DIGEST,  # no endpoint
            b"x" * 301,
            DIGEST,  # an over-long key
            b"127.0.0.13:8000",
            DIGEST * 4097,  # more blocks than a prompt has
        ],
        [],
        2,  # over the bounds: left out by the script
    ]
    learnt, skipped, repaired = share.received(reply)
    assert [(entry.endpoint, len(entry.hashes)) for entry in learnt] == [("127.0.0.11:8000", 3)]
    assert (skipped, repaired) == (6, ())
    assert share.cursor == "1700000000000-3"
    assert share.received(b"not a list") == ([], 1, ())
    assert share.cursor == "1700000000000-3"
