"""Shared-storage mode: engines find each other's prompt blocks in a directory they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.emulator import EmulatorConfig, RunningEmulator
from sidecar.emulator.kv import chain_hashes
from sidecar.emulator.storage import SharedKvStore

from .conftest import MakeEmulator
from .helpers import get_json, post_json

PROMPT = "Shared storage: the prefill writes its blocks, the decode reads them back by prefix. " * 3


async def complete(
    session: aiohttp.ClientSession, emu: RunningEmulator, **fields: Any
) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": 3, **fields}
    return await post_json(session, f"{emu.url}/v1/completions", body)


async def store_blocks(session: aiohttp.ClientSession, emu: RunningEmulator) -> int:
    state = await get_json(session, f"{emu.url}/emulator/kv")
    assert state["kv_protocol"] == "shared-storage"
    return int(state["store_blocks"])


async def test_second_engine_finds_the_first_engines_blocks(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fields = {"kv_protocol": "shared-storage", "kv_store": str(tmp_path)}
    prefiller = await make_emulator(**fields)
    decoder = await make_emulator(**fields, prompt_tokens_details=True)
    status, first = await complete(session, prefiller, max_tokens=1)
    assert status == 200
    assert first["kv_transfer_params"] is None
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens == 64
    assert await store_blocks(session, prefiller) == 4
    assert await store_blocks(session, decoder) == 4

    status, second = await complete(session, decoder)
    assert status == 200
    # The block holding the last prompt token is always computed: 3 of 4 blocks come from the store.
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    _, local = await post_json(
        session, f"{prefiller.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 3}
    )
    assert second["choices"][0]["text"] == local["choices"][0]["text"]


async def test_a_miss_recomputes_and_fills_the_store(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    decoder = await make_emulator(
        kv_protocol="shared-storage", kv_store=str(tmp_path), prompt_tokens_details=True
    )
    status, body = await complete(session, decoder, prompt="something else entirely " * 8)
    assert status == 200
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert await store_blocks(session, decoder) == 3


async def test_a_shared_prefix_is_found_block_by_block(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    writer = await make_emulator(kv_protocol="shared-storage", kv_store=str(tmp_path))
    reader = await make_emulator(
        kv_protocol="shared-storage", kv_store=str(tmp_path), prompt_tokens_details=True
    )
    assert (await complete(session, writer))[0] == 200
    longer = PROMPT[:128] + "a different continuation of the prompt, long enough for a block"
    status, body = await complete(session, reader, prompt=longer)
    assert status == 200
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_strict_refuses_kv_transfer_params(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    strict = await make_emulator(kv_protocol="shared-storage", kv_store=str(tmp_path))
    lenient = await make_emulator(
        kv_protocol="shared-storage", kv_store=str(tmp_path), mode="lenient"
    )
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    status, body = await complete(session, strict, kv_transfer_params=params)
    assert status == 400
    assert "not used with shared-storage" in body["error"]["message"]
    status, body = await complete(session, lenient, kv_transfer_params=params)
    assert status == 200
    assert body["kv_transfer_params"] is None


def test_store_evicts_least_recently_used_blocks(tmp_path: Path) -> None:
    store = SharedKvStore(str(tmp_path), max_blocks=3)
    hashes = chain_hashes([b"a", b"b", b"c", b"d"])
    assert store.save(hashes[:2]) == 2
    assert store.lookup(hashes) == 2
    assert store.save(hashes) == 2  # c and d are new; one block goes
    assert store.count() == 3
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"kv_protocol": "shared-storage"}, "needs kv_store"),
        ({"kv_store": "/tmp/x"}, "kv_store applies"),
        ({"kv_protocol": "sglang"}, "needs disaggregation_mode"),
        ({"disaggregation_mode": "decode"}, "applies to kv_protocol sglang"),
        ({"kv_protocol": "bogus"}, "kv_protocol must be one of"),
        ({"waiting_timeout_s": 0}, "waiting_timeout_s must be > 0"),
    ],
)
def test_protocol_config_errors(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        EmulatorConfig(**fields)
