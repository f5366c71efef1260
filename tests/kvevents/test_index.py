"""The exact prefix index against sequences of KV events, as vLLM publishes them."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tracemalloc
from array import array
from collections.abc import Sequence
from dataclasses import replace

import pytest

from sidecar.kvevents.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from sidecar.kvevents.index import (
    BYTES_PER_BLOCK,
    MAX_GROUPS,
    MAX_LOOKUP_TOKENS,
    Hit,
    KVIndex,
    PromptKeys,
)

BS = 16


def tokens(seed: int, count: int) -> list[int]:
    """``count`` token ids drawn from ``seed``: distinct prompts for distinct seeds."""
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(count)]


class Engine:
    """What vLLM's block pool publishes for prompts, with its own hash (sha256 of the parent's
    hash, the block's tokens and its extra keys: not ours), so the index can only match by
    content."""

    def __init__(self, seed: bytes = b"engine") -> None:
        self.seed = seed
        self.seq = 0

    def hashes(self, ids: Sequence[int], extras: Sequence[object], size: int = BS) -> list[bytes]:
        parent = self.seed
        out = []
        data = array("I", ids).tobytes()
        for i in range(len(ids) // size):
            block = data[i * size * 4 : (i + 1) * size * 4] + repr(extras[i]).encode()
            parent = hashlib.sha256(parent + block).digest()
            out.append(parent)
        return out

    def store(
        self,
        ids: Sequence[int],
        *,
        start_block: int = 0,
        lora: str | None = None,
        salt: str | None = None,
        medium: str | None = MEDIUM_GPU,
        group: int | None = 0,
        size: int = BS,
        kind: str | None = None,
        window: int | None = None,
    ) -> BlockStored:
        """The store of ``ids``'s full blocks from ``start_block`` (its parent the block before),
        with vLLM's published extra keys: the LoRA name on every block, the salt on block 0."""
        count = len(ids) // size
        extras: list[tuple[object, ...] | None] = []
        for i in range(count):
            entry: list[object] = [lora] if lora else []
            if i == 0 and salt:
                entry.append(salt)
            extras.append(tuple(entry) if entry else None)
        hashes = self.hashes(ids, extras, size)
        return BlockStored(
            block_hashes=tuple(hashes[start_block:]),
            parent_block_hash=hashes[start_block - 1] if start_block else None,
            token_ids=tuple(ids[start_block * size : count * size]),
            block_size=size,
            medium=medium,
            lora_id=7 if lora else None,
            lora_name=lora,
            extra_keys=tuple(extras[start_block:]) if any(extras) else None,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    def remove(
        self,
        ids: Sequence[int],
        blocks: Sequence[int],
        *,
        lora: str | None = None,
        salt: str | None = None,
        medium: str | None = MEDIUM_GPU,
        group: int | None = 0,
    ) -> BlockRemoved:
        stored = self.store(ids, lora=lora, salt=salt, medium=medium, group=group)
        return BlockRemoved(
            block_hashes=tuple(stored.block_hashes[b] for b in blocks),
            medium=medium,
            group_idx=group,
        )

    def batch(self, *events: KVEvent) -> EventBatch:
        self.seq += 1
        return EventBatch(seq=self.seq, ts=float(self.seq), events=events)


def test_a_stored_chain_matches_its_prefix_to_the_block_and_nothing_else() -> None:
    engine, index = Engine(), KVIndex(max_blocks=10_000)
    prompt = tokens(1, 10 * BS)
    index.apply(engine.batch(engine.store(prompt)))
    assert len(index) == 10
    # vLLM computes the last token: a prompt of exactly the cached blocks hits one block less.
    assert index.lookup(prompt) == Hit(gpu=9 * BS)
    assert index.lookup([*prompt, 1]) == Hit(gpu=10 * BS)
    # A longer prompt sharing 6 blocks and 5 tokens matches 6 blocks; a change in block 0, none.
    other = [*prompt[: 6 * BS + 5], *tokens(2, 100)]
    assert index.lookup(other).gpu == 6 * BS
    assert index.lookup([prompt[0] + 1, *prompt[1:]]).gpu == 0
    # A continuation stored from block 10 on (its parent the last block) extends the match.
    longer = [*prompt, *tokens(3, 4 * BS)]
    index.apply(engine.batch(engine.store(longer, start_block=10)))
    assert index.lookup([*longer, 1]).gpu == 14 * BS
    assert index.stats().stored == 14


def test_keys_are_our_own_so_any_engine_hash_matches_by_content() -> None:
    prompt = tokens(4, 5 * BS)
    one, two = KVIndex(max_blocks=100), KVIndex(max_blocks=100)
    one.apply(Engine(b"sha256 seed A").batch(Engine(b"sha256 seed A").store(prompt)))
    engine_b = Engine(b"xxhash seed B")
    two.apply(engine_b.batch(engine_b.store(prompt)))
    assert one.lookup([*prompt, 1]) == two.lookup([*prompt, 1]) == Hit(gpu=5 * BS)


def test_removing_a_middle_block_cuts_the_match_there() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(5, 8 * BS)
    index.apply(engine.batch(engine.store(prompt)))
    index.apply(engine.batch(engine.remove(prompt, [3])))
    assert index.lookup([*prompt, 1]).gpu == 3 * BS
    assert len(index) == 7
    # Removed again, or never stored: nothing changes.
    index.apply(engine.batch(engine.remove(prompt, [3]), engine.remove(tokens(6, BS), [0])))
    assert len(index) == 7
    assert index.stats().removed == 1


def test_a_block_in_several_media_is_held_until_removed_from_all_and_tiers_are_apart() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(7, 8 * BS)
    probe = [*prompt, 1]
    index.apply(engine.batch(engine.store(prompt[: 4 * BS])))  # GPU: blocks 0-3
    index.apply(engine.batch(engine.store(prompt[: 6 * BS], medium=MEDIUM_CPU)))  # CPU: 0-5
    index.apply(engine.batch(engine.store(prompt, medium=MEDIUM_STORAGE)))  # storage: 0-7
    assert index.lookup(probe) == Hit(gpu=4 * BS, cpu=2 * BS, storage=2 * BS)
    assert index.lookup(probe).weighted(cpu=0.5, storage=0.25) == 4 * BS + BS + BS / 2
    # Evicted from GPU, still on CPU: the hit moves to the CPU tier, the block stays held.
    index.apply(engine.batch(engine.remove(prompt, [0, 1, 2, 3], medium=MEDIUM_GPU)))
    assert index.lookup(probe) == Hit(gpu=0, cpu=6 * BS, storage=2 * BS)
    index.apply(engine.batch(engine.remove(prompt, [0], medium=MEDIUM_CPU)))
    assert index.lookup(probe) == Hit(gpu=0, cpu=0, storage=8 * BS)
    index.apply(engine.batch(engine.remove(prompt, [0], medium=MEDIUM_STORAGE)))
    assert index.lookup(probe) == Hit()
    assert len(index) == 7  # block 0 is gone from every medium; 1-7 are still held somewhere


def test_medium_none_is_the_gpu() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(8, 3 * BS)
    index.apply(engine.batch(engine.store(prompt, medium=None)))
    assert index.lookup([*prompt, 1]) == Hit(gpu=3 * BS)
    index.apply(engine.batch(engine.remove(prompt, [0], medium=MEDIUM_GPU)))
    assert index.lookup([*prompt, 1]) == Hit()


def test_salts_and_adapters_never_cross_match() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    prompt = tokens(9, 4 * BS)
    probe = [*prompt, 1]
    index.apply(engine.batch(engine.store(prompt, salt="tenant-a")))
    assert index.lookup(probe, salt="tenant-a").gpu == 4 * BS
    assert index.lookup(probe).gpu == 0
    assert index.lookup(probe, salt="tenant-b").gpu == 0
    index.apply(engine.batch(engine.store(prompt, lora="sql-adapter")))
    assert index.lookup(probe, lora="sql-adapter").gpu == 4 * BS
    assert index.lookup(probe, lora="sql-adapter", salt="tenant-a").gpu == 0
    assert index.lookup(probe, lora="other-adapter").gpu == 0
    assert index.lookup(probe).gpu == 0  # the base model holds nothing of it
    index.apply(engine.batch(engine.store(prompt, lora="sql-adapter", salt="tenant-a")))
    assert index.lookup(probe, lora="sql-adapter", salt="tenant-a").gpu == 4 * BS
    index.apply(engine.batch(engine.store(prompt)))
    assert index.lookup(probe).gpu == 4 * BS


def test_an_adapter_named_only_by_id_never_matches_a_request() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(10, 3 * BS)
    stored = engine.store(prompt)
    index.apply(
        engine.batch(
            BlockStored(
                block_hashes=stored.block_hashes,
                parent_block_hash=None,
                token_ids=stored.token_ids,
                block_size=BS,
                lora_id=3,
            )
        )
    )
    assert index.lookup([*prompt, 1]) == Hit()


def test_groups_never_cross_match_and_a_hit_needs_every_group() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    prompt = tokens(11, 6 * BS)
    probe = [*prompt, 1]
    index.apply(engine.batch(engine.store(prompt, group=0)))
    assert index.lookup(probe).gpu == 6 * BS
    # Group 1 stored 4 blocks: the engine hits only where both hold the prefix.
    index.apply(engine.batch(engine.store(prompt[: 4 * BS], group=1)))
    assert index.lookup(probe).gpu == 4 * BS
    # Removing block 2 of group 1 (the same engine hash in group 0 stays) cuts the hit there.
    index.apply(engine.batch(engine.remove(prompt, [2], group=1)))
    assert index.lookup(probe).gpu == 2 * BS
    assert len(index) == 6 + 3


def test_groups_are_capped_and_an_empty_one_gives_its_place() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    prompt = tokens(12, 2 * BS)
    probe = [*prompt, 1]
    for group in range(MAX_GROUPS):
        index.apply(engine.batch(engine.store(prompt, group=group)))
    assert index.lookup(probe).gpu == 2 * BS
    # A group beyond the cap, while every group holds blocks: skipped and counted.
    index.apply(engine.batch(engine.store(prompt, group=1_000_000)))
    assert (index.stats().groups, index.stats().too_many_groups) == (MAX_GROUPS, 2)
    # An emptied group is kept (a hit needs it too: none now) until a new group needs its place.
    index.apply(engine.batch(engine.remove(prompt, [0, 1], group=5)))
    assert index.lookup(probe).gpu == 0
    index.apply(engine.batch(engine.store(prompt, group=1_000_000)))
    assert (index.stats().groups, index.stats().too_many_groups) == (MAX_GROUPS, 2)
    assert len(index) == MAX_GROUPS * 2
    assert index.lookup(probe).gpu == 2 * BS


def test_groups_whose_blocks_the_cap_dropped_make_room_for_new_ones() -> None:
    """The review's case: one block in each of 2,000 new groups, an index of 4 blocks."""
    engine, index = Engine(), KVIndex(max_blocks=4)
    prompt = tokens(13, BS)
    for group in range(2_000):
        index.apply(engine.batch(engine.store(prompt, group=group)))
    assert len(index) == 4
    assert (index.stats().groups, index.stats().too_many_groups) == (MAX_GROUPS, 0)


def test_a_sliding_window_group_needs_only_its_window_before_the_hit() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    prompt = tokens(12, 10 * BS)
    probe = [*prompt, 1]
    full = {"group": 0, "kind": "full_attention"}
    swa = {"group": 1, "kind": "sliding_window", "window": 2 * BS + 1}  # needs 2 blocks
    index.apply(engine.batch(engine.store(prompt, **full), engine.store(prompt, **swa)))  # type: ignore[arg-type]
    assert index.lookup(probe).gpu == 10 * BS
    # The window's early blocks evicted: a hit still needs only the 2 blocks before its end.
    index.apply(engine.batch(engine.remove(prompt, [0, 1, 2, 3], group=1)))
    assert index.lookup(probe).gpu == 10 * BS
    # Block 8 gone from the window group: the rightmost end with 2 held blocks before it is 8.
    index.apply(engine.batch(engine.remove(prompt, [8], group=1)))
    assert index.lookup(probe).gpu == 8 * BS
    # With the window unknown, the full-attention rule judges the group: no early blocks, no hit.
    other = KVIndex(max_blocks=1000)
    other.apply(
        engine.batch(
            engine.store(prompt, **full),  # type: ignore[arg-type]
            engine.store(prompt, group=1, kind="sliding_window"),
            engine.remove(prompt, [0], group=1),
        )
    )
    assert other.lookup(probe).gpu == 0


def test_an_unknown_parent_is_skipped_and_counted() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(13, 6 * BS)
    index.apply(engine.batch(engine.store(prompt, start_block=2)))
    assert len(index) == 0
    assert index.stats().unknown_parent == 4
    assert index.lookup([*prompt, 1]) == Hit()


def test_misaligned_and_malformed_stores_are_skipped_and_counted() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(14, 4 * BS)
    stored = engine.store(prompt)
    # Masked sliding-window blocks: fewer hashes than blocks of tokens.
    index.apply(
        engine.batch(
            BlockStored(
                block_hashes=stored.block_hashes[1:],
                parent_block_hash=None,
                token_ids=stored.token_ids,
                block_size=BS,
            ),
            BlockStored(
                block_hashes=stored.block_hashes[:1],
                parent_block_hash=None,
                token_ids=(-1,) * BS,
                block_size=BS,
            ),
        )
    )
    assert len(index) == 0
    assert index.stats().misaligned == 3
    assert index.stats().malformed == 1
    # Extra keys decoded as lists are keyed like tuples.
    listed = BlockStored(
        block_hashes=stored.block_hashes,
        parent_block_hash=None,
        token_ids=stored.token_ids,
        block_size=BS,
        extra_keys=(["tenant"], None, None, None),  # type: ignore[arg-type]
    )
    index.apply(engine.batch(listed))
    assert index.lookup([*prompt, 1], salt="tenant").gpu == 4 * BS


def test_all_blocks_cleared_and_a_reset_forget_everything() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(15, 4 * BS)
    index.apply(engine.batch(engine.store(prompt)))
    index.apply(engine.batch(AllBlocksCleared()))
    assert len(index) == 0
    assert index.lookup([*prompt, 1]) == Hit()
    index.apply(engine.batch(engine.store(prompt)))
    index.reset("gap 7..9 not replayable")
    assert len(index) == 0
    assert index.lookup([*prompt, 1]) == Hit()
    # After a reset, a continuation whose parent was stored before it cannot be keyed.
    index.apply(engine.batch(engine.store([*prompt, *tokens(16, BS)], start_block=4)))
    assert len(index) == 0
    stats = index.stats()
    assert (stats.cleared, stats.resets, stats.last_reset) == (1, 1, "gap 7..9 not replayable")
    assert stats.unknown_parent == 1


def test_a_block_stored_again_is_kept_once_and_made_recent() -> None:
    engine, index = Engine(), KVIndex(max_blocks=6)
    first, second = tokens(17, 4 * BS), tokens(18, 2 * BS)
    index.apply(engine.batch(engine.store(first), engine.store(second)))
    # vLLM re-publishes a prompt's reused blocks (``emit_cached_block_events``, from block 0):
    # no double count, and not a copy either.
    index.apply(engine.batch(engine.store(first)))
    assert len(index) == 6
    assert index.stats().copies == 0
    index.apply(engine.batch(engine.remove(first, [0])))
    assert index.lookup([*first, 1]).gpu == 0
    # ``second`` is now the oldest: the cap drops it first.
    index.apply(engine.batch(engine.store(first[:BS]), engine.store(tokens(19, 2 * BS))))
    assert index.lookup([*first, 1]).gpu == 4 * BS
    assert index.lookup([*second, 1]).gpu == 0
    assert index.stats().dropped == 2


def test_a_block_stored_again_after_its_parent_is_a_copy_held_until_every_copy_goes() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(22, 4 * BS)
    index.apply(engine.batch(engine.store(prompt)))
    # vLLM computes the last token of a prompt whose blocks are all cached: its last block is
    # computed again into a new block, stored after its parent under the same hash (twice here).
    again = engine.store(prompt, start_block=3)
    index.apply(engine.batch(again))
    index.apply(engine.batch(again))
    assert len(index) == 4
    assert index.stats().copies == 2
    for left in (1, 0):
        index.apply(engine.batch(engine.remove(prompt, [3])))
        assert index.lookup([*prompt, 1]).gpu == 4 * BS
        assert index.stats().copies == left
    index.apply(engine.batch(engine.remove(prompt, [3])))
    assert index.lookup([*prompt, 1]).gpu == 3 * BS
    assert (index.stats().removed, len(index)) == (3, 3)
    # A copy in another medium is that medium's first, not a copy.
    index.apply(engine.batch(engine.store(prompt, start_block=2, medium=MEDIUM_CPU)))
    assert index.stats().copies == 0


def test_copies_leave_with_their_block() -> None:
    engine, index = Engine(), KVIndex(max_blocks=6)
    first = tokens(23, 3 * BS)
    index.apply(engine.batch(engine.store(first), engine.store(first, start_block=2)))
    assert index.stats().copies == 1
    # The cap drops the block: its copy goes with it, and a new store of it is one block.
    index.apply(engine.batch(engine.store(tokens(24, 6 * BS))))
    assert index.stats().copies == 0
    index.apply(engine.batch(engine.store(first)))
    index.apply(engine.batch(engine.remove(first, [2])))
    assert index.lookup([*first, 1]).gpu == 2 * BS
    # Cleared: none left either.
    index.apply(
        engine.batch(engine.store(first, start_block=2), engine.store(first, start_block=2))
    )
    assert index.stats().copies == 1
    index.apply(engine.batch(AllBlocksCleared()))
    assert index.stats().copies == 0


def test_the_cap_drops_the_oldest_blocks_and_counts_them() -> None:
    engine, index = Engine(), KVIndex(max_blocks=10)
    old, new = tokens(20, 6 * BS), tokens(21, 8 * BS)
    index.apply(engine.batch(engine.store(old)))
    index.apply(engine.batch(engine.store(new)))
    assert len(index) == 10
    assert index.stats().dropped == 4
    # The old prompt lost its first 4 blocks: no match from block 0; the new one is whole.
    assert index.lookup([*old, 1]).gpu == 0
    assert index.lookup([*new, 1]).gpu == 8 * BS
    with pytest.raises(ValueError, match="max_blocks"):
        KVIndex(max_blocks=0)


def test_a_look_up_keys_a_bounded_number_of_blocks() -> None:
    engine, index = Engine(), KVIndex(max_blocks=100)
    prompt = tokens(22, 2 * BS)
    index.apply(engine.batch(engine.store(prompt)))
    huge = [*prompt, *range(MAX_LOOKUP_TOKENS)]
    assert index.lookup(huge).gpu == 2 * BS
    assert index.lookup([1 << 40, *prompt]) == Hit()  # not a token id: cannot be keyed
    assert index.lookup([]) == Hit()


def test_prompt_keys_are_shared_by_every_index_and_keyed_lazily() -> None:
    engine = Engine()
    prompt = tokens(23, 100 * BS)
    one, two = KVIndex(max_blocks=1000), KVIndex(max_blocks=1000)
    one.apply(engine.batch(engine.store(prompt[: 3 * BS])))
    two.apply(engine.batch(engine.store(prompt[: 40 * BS], salt="s")))
    keys = PromptKeys(prompt, salt="s")
    assert one.lookup(keys).gpu == 0  # the salt: block 0 differs
    # The miss at block 0 keyed a first step of blocks, not the prompt.
    assert len(keys.chain(0, BS, 0)) < 100
    assert two.lookup(keys).gpu == 40 * BS
    assert one.lookup(PromptKeys(prompt)).gpu == 3 * BS
    assert one.lookup(prompt).gpu == 3 * BS  # token ids: keys of their own


def test_keys_are_private_to_the_process() -> None:
    """Token bytes are hashed with the process's random key: another process keys the same
    prompt differently (a client cannot precompute collisions)."""
    code = "from array import array; print(hash((0, array('I', range(16)).tobytes(), None)))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(runs) == 2


def test_memory_per_block_is_within_the_documented_figure() -> None:
    """The engine's hashes are made inside the measurement (vLLM's default 64-bit ints) and the
    events dropped after use, as the subscriber's are: what stays is what the index keeps."""
    engine = Engine()
    stores = [engine.store(tokens(1000 + i, 20 * BS)) for i in range(2500)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KVIndex(max_blocks=200_000)
        for stored in stores:
            hashes = tuple(int.from_bytes(h[:8], "big") for h in stored.block_hashes)  # type: ignore[index]
            index.apply(engine.batch(replace(stored, block_hashes=hashes)))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 50_000
    assert used / len(index) <= BYTES_PER_BLOCK
