"""The shared-storage KV store (vLLM ExampleConnector / LMCache-style): a directory of blocks.

One small file per full prompt block, named by its chained hash (``<hex>.kv``), so a prompt's
stored prefix is the longest run of its leading block hashes that have a file. Writes go to a
temporary name and are renamed into place, so a reader never sees a half-written block. With
``max_blocks`` > 0 the least recently used blocks (by modification time; a hit touches its files)
are deleted beyond the cap; with 0 the directory only grows (use a temporary directory).

The methods are synchronous file I/O; the engine runs them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

SUFFIX = ".kv"


class SharedKvStore:
    def __init__(self, directory: str, max_blocks: int = 0) -> None:
        self._dir = Path(directory)
        self._max_blocks = max_blocks
        self._dir.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: bytes) -> Path:
        return self._dir / f"{block_hash.hex()}{SUFFIX}"

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks stored; their files count as recently used."""
        found = 0
        for block_hash in hashes:
            path = self._path(block_hash)
            try:
                os.utime(path)
            except FileNotFoundError:
                break
            found += 1
        return found

    def save(self, hashes: Sequence[bytes]) -> int:
        """Write the blocks not stored yet; returns how many were written."""
        written = 0
        for block_hash in hashes:
            path = self._path(block_hash)
            if path.exists():
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)
                continue
            temporary = self._dir / f".{uuid.uuid4().hex}.tmp"
            temporary.write_bytes(block_hash.hex().encode())
            os.replace(temporary, path)
            written += 1
        if written and self._max_blocks:
            self._evict()
        return written

    def _evict(self) -> None:
        entries: list[tuple[float, Path]] = []
        with os.scandir(self._dir) as scan:
            for entry in scan:
                if entry.name.endswith(SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        entries.append((entry.stat().st_mtime, Path(entry.path)))
        excess = len(entries) - self._max_blocks
        if excess <= 0:
            return
        entries.sort()
        for _, path in entries[:excess]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def count(self) -> int:
        with os.scandir(self._dir) as scan:
            return sum(1 for entry in scan if entry.name.endswith(SUFFIX))
