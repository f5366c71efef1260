"""What keeps a decision's exact look-ups cheap (``python -m bench decision_cost --kv-events``):
the prompt converted only as far as it is keyed, the short way for one full-attention group, the
placement rebuilt positionally. Each gives the answers the general way gives."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import fields
from typing import overload

from sidecar.kvevents.index import Hit, KVIndex, PromptKeys
from sidecar.kvevents.tokens import TokenIds, checked_ids
from sidecar.scheduling.placement import Placement
from tests.kvevents.test_index import BS, Engine, tokens


class Reads(Sequence[int]):
    """Token ids that remember the furthest index read."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.furthest = -1

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            got = self.ids[i]
            start = i.start or 0
            self.furthest = max(self.furthest, start + len(got) - 1)
            return got
        self.furthest = max(self.furthest, i)
        return self.ids[i]


def test_a_miss_at_block_0_reads_a_first_step_of_the_prompt_not_all_of_it() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    index.apply(engine.batch(engine.store(tokens(1, 8 * BS))))
    prompt = Reads(tokens(2, 125 * BS))
    assert index.lookup(PromptKeys(prompt)) == Hit()
    assert 0 <= prompt.furthest < 8 * BS  # 8 blocks of 2,000 tokens


def test_a_hit_reads_the_prompt_as_far_as_it_goes() -> None:
    engine, index = Engine(), KVIndex(max_blocks=1000)
    ids = tokens(3, 125 * BS)
    index.apply(engine.batch(engine.store(ids[: 20 * BS])))
    prompt = Reads(ids)
    assert index.lookup(PromptKeys(prompt)).gpu == 20 * BS
    assert prompt.furthest < 40 * BS  # the growing steps: 8, 16, then 32 blocks


def test_an_id_that_is_no_token_id_where_a_look_up_reads_hits_nowhere() -> None:
    """Ids are converted as far as the look-ups read them: one that is no 32-bit token id in
    that stretch keys nothing, in any index the keys are shared by (the sidecar's own ids are
    checked before: ``tokens.py``)."""
    engine, index = Engine(), KVIndex(max_blocks=1000)
    ids = tokens(4, 40 * BS)
    index.apply(engine.batch(engine.store(ids[: 12 * BS])))
    bad = [*ids[: 10 * BS], 1 << 40, *ids[10 * BS :]]
    assert index.lookup(bad) == Hit()
    keys = PromptKeys(bad)
    assert KVIndex(max_blocks=10).lookup(keys) == Hit()
    assert index.lookup(keys) == Hit()
    assert index.lookup(ids).gpu == 12 * BS


def test_checked_ids_are_keyed_from_their_packing_without_a_conversion() -> None:
    """The sidecar's ids come checked and packed (``tokens.checked_ids``): the keys are made from
    the packing (the ids are not read again) and equal those of the same ids as a list."""
    engine, index = Engine(), KVIndex(max_blocks=1000)
    ids = tokens(5, 40 * BS)
    index.apply(engine.batch(engine.store(ids[: 12 * BS])))
    checked = checked_ids(list(ids))
    assert checked is not None
    assert checked == ids
    assert index.lookup(PromptKeys(checked)) == index.lookup(PromptKeys(list(ids)))
    assert index.lookup(PromptKeys(checked)).gpu == 12 * BS
    packed = PromptKeys(checked)
    listed = PromptKeys(list(ids))
    assert packed.chain(0, BS, 39) == listed.chain(0, BS, 39)
    # What is keyed is the packing: ids whose list says otherwise hit as the packing does.
    unread = TokenIds(tokens(6, 40 * BS), checked.packed)
    assert index.lookup(PromptKeys(unread)).gpu == 12 * BS
    assert index.lookup(tokens(6, 40 * BS)) == Hit()


def test_the_short_way_answers_as_the_general_way() -> None:
    """One full-attention group on GPU (the short way) against the same index's general way,
    on prefixes of every length, a removal in the middle and copies."""
    rng = random.Random(7)
    engine, index = Engine(), KVIndex(max_blocks=10_000)
    prompts = [tokens(seed, rng.randrange(1, 60) * BS + rng.randrange(BS)) for seed in range(40)]
    for ids in prompts:
        index.apply(engine.batch(engine.store(ids[: rng.randrange(0, len(ids) + 1)])))
    for ids in prompts[::5]:
        if len(ids) >= 3 * BS:
            index.apply(engine.batch(engine.remove(ids, [1])))
    assert index._single is not None
    probes = [
        p[: rng.randrange(0, len(p) + 1)] + tokens(99, rng.randrange(3) * BS) for p in prompts
    ]
    short = [index.lookup(p) for p in probes]
    index._single = None  # the general way
    assert [index.lookup(p) for p in probes] == short
    assert any(hit.gpu for hit in short)
    assert any(not hit.gpu for hit in short)


def test_the_placement_is_rebuilt_in_its_fields_order() -> None:
    """``KVFleet.decided`` builds the placement positionally (cheaper than ``replace``)."""
    assert [f.name for f in fields(Placement)] == [
        "decision",
        "endpoint",
        "rank",
        "reservation",
        "local_tokens",
        "prefix",
        "tokenize_s",
        "cached_source",
    ]
