"""Unit tests of the pure parts: text, KV store, prefix cache, fault specs, config and CLI."""

from __future__ import annotations

import pytest

from sidecar.emulator import EmulatorConfig, FaultKind, FaultRole, FaultSpec
from sidecar.emulator.config import build_parser, config_from_args
from sidecar.emulator.faults import FaultBoard
from sidecar.emulator.kv import KvStore, PrefixCache, PullStatus, chain_hashes
from sidecar.emulator.text import (
    VOCABULARY,
    OutputText,
    estimate_tokens,
    prompt_from_completion,
    prompt_from_messages,
)

from .helpers import FakeClock


def make_store(clock: FakeClock, expiry_s: float = 30.0) -> KvStore:
    return KvStore(engine_id="engine-a", block_size=16, expiry_s=expiry_s, clock=clock)


# --- text -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "tokens"), [("", 1), ("a", 1), ("abcd", 1), ("abcde", 2)])
def test_estimate_tokens(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


def test_completion_prompt_forms() -> None:
    assert prompt_from_completion("hello world").num_tokens == 3
    assert prompt_from_completion(["first prompt", "second"]).text == "first prompt"
    ids = prompt_from_completion([1, 2, 3, 4, 5])
    assert (ids.text, ids.num_tokens) == ("1 2 3 4 5", 5)
    assert prompt_from_completion([[7, 8], [9]]).text == "7 8"
    for bad in ([], [1, "a"], [True], 5, None, [[1], "x"]):
        with pytest.raises(ValueError):  # noqa: PT011 - the message is the client's
            prompt_from_completion(bad)


def test_chat_prompt_lines_and_parts() -> None:
    prompt = prompt_from_messages(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    )
    assert prompt.text == "system: be brief\nuser: hi"
    for bad in ([], [{"content": "x"}], ["x"], [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError):  # noqa: PT011
            prompt_from_messages(bad)


def test_output_is_deterministic_and_prompt_dependent() -> None:
    a = OutputText("the same prompt").text(0, 20)
    assert a == OutputText("the same prompt").text(0, 20)
    assert a != OutputText("another prompt").text(0, 20)
    assert OutputText("the same prompt").text(1, 20) != a
    words = a.split(" ")[1:]
    assert len(words) == 20
    assert all(f" {w}" in VOCABULARY for w in words)


def test_full_blocks_are_prefix_stable() -> None:
    long = prompt_from_completion("x" * 200 + "tail")
    longer = prompt_from_completion("x" * 200 + "different tail, much longer than before")
    assert long.full_blocks(16) == longer.full_blocks(16)[: len(long.full_blocks(16))]
    ids = prompt_from_completion(list(range(40)))
    assert len(ids.full_blocks(16)) == 2
    assert len(ids.full_blocks(16, limit_tokens=39)) == 2
    assert len(ids.full_blocks(16, limit_tokens=31)) == 1


# --- KV store ---------------------------------------------------------------------------------


def test_stage_and_pull() -> None:
    clock = FakeClock()
    kv = make_store(clock)
    staged = kv.stage("cmpl-1", 40)  # 3 blocks of 16
    assert len(staged.block_ids) == 3
    assert (kv.staged_requests, kv.staged_blocks) == (1, 3)
    assert kv.pull("engine-a", "cmpl-1", staged.block_ids) is PullStatus.OK
    assert (kv.staged_requests, kv.staged_blocks, kv.pulled_total) == (0, 0, 1)
    assert kv.pull("engine-a", "cmpl-1", staged.block_ids) is PullStatus.ALREADY_PULLED
    assert kv.pull("engine-a", "cmpl-unknown", [1]) is PullStatus.UNKNOWN


def test_block_ids_are_unique_per_store() -> None:
    kv = make_store(FakeClock())
    a = kv.stage("a", 32).block_ids
    b = kv.stage("b", 32).block_ids
    assert not set(a) & set(b)


def test_pull_mismatches_leave_blocks_staged() -> None:
    kv = make_store(FakeClock())
    ids = kv.stage("r", 20).block_ids
    assert kv.pull("engine-b", "r", ids) is PullStatus.ENGINE_MISMATCH
    assert kv.pull("engine-a", "r", [999]) is PullStatus.BLOCK_MISMATCH
    assert kv.rejected_total == 2
    assert kv.pull("engine-a", "r", ids[1:]) is PullStatus.OK  # a subset is a partial pull


def test_expiry_with_injected_clock() -> None:
    clock = FakeClock()
    kv = make_store(clock, expiry_s=30.0)
    kv.stage("old", 16)
    clock.advance(20)
    kv.stage("young", 16)
    clock.advance(10.5)
    assert [s.request_id for s in kv.snapshot()] == ["young"]
    assert kv.expired_total == 1
    assert kv.pull("engine-a", "old", [1]) is PullStatus.EXPIRED
    clock.advance(30)
    assert kv.sweep() == 1
    assert (kv.staged_requests, kv.expired_total) == (0, 2)


def test_restaging_a_request_id_replaces_it() -> None:
    kv = make_store(FakeClock())
    kv.stage("r", 16)
    ids = kv.stage("r", 48).block_ids
    assert (kv.staged_requests, kv.staged_blocks) == (1, 3)
    assert kv.pull("engine-a", "r", ids) is PullStatus.OK


def test_prefix_cache_lru() -> None:
    cache = PrefixCache(capacity=3)
    hashes = chain_hashes([b"a", b"b", b"c"])
    assert cache.match(hashes) == 0
    cache.insert(hashes)
    assert cache.match(hashes) == 3
    assert cache.match(chain_hashes([b"a", b"x"])) == 1
    cache.insert(chain_hashes([b"z"]))  # evicts the least recently used
    assert len(cache) == 3
    assert chain_hashes([b"b"]) != hashes[1:2]  # chained: a block's hash depends on its prefix


def test_prefix_cache_evicts_a_prompts_tail_before_its_head() -> None:
    """As vLLM frees a request's blocks in reverse order: the head stays, the prefix is kept."""
    cache = PrefixCache(capacity=4)
    first = chain_hashes([b"a", b"b", b"c"])
    cache.insert(first)
    cache.insert(chain_hashes([b"x", b"y"]))  # one over: the first prompt's last block goes
    assert cache.match(first) == 2
    assert cache.evicted_total == 1
    cache.insert(chain_hashes([b"p", b"q", b"r", b"s", b"t"]))  # longer than the cache: its head
    assert cache.match(chain_hashes([b"p", b"q", b"r", b"s"])) == 4
    assert cache.match(first) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(capacity=0)


# --- faults -----------------------------------------------------------------------------------


def test_fault_cli_syntax() -> None:
    assert FaultSpec.parse_cli("status:503:2") == FaultSpec(FaultKind.STATUS, count=2, status=503)
    assert FaultSpec.parse_cli("hang") == FaultSpec(FaultKind.HANG)
    assert FaultSpec.parse_cli("disconnect:3@decode") == FaultSpec(
        FaultKind.DISCONNECT, after_chunks=3, role=FaultRole.DECODE
    )
    assert FaultSpec.parse_cli("reset:4").count == 4
    for bad in ("nope", "status:x", "hang:1:2", "stall@nobody", "status:200"):
        with pytest.raises(ValueError):  # noqa: PT011
            FaultSpec.parse_cli(bad)


def test_fault_json() -> None:
    spec = FaultSpec.from_json({"kind": "stall", "after_chunks": 2, "role": "plain"})
    assert spec == FaultSpec(FaultKind.STALL, after_chunks=2, role=FaultRole.PLAIN)
    bad: object
    for bad in ({}, {"kind": "x"}, {"kind": "status", "count": "2"}, {"kind": "hang", "x": 1}, []):
        with pytest.raises(ValueError):  # noqa: PT011
            FaultSpec.from_json(bad)


def test_fault_board_consumes_by_role() -> None:
    board = FaultBoard((FaultSpec(FaultKind.STATUS, count=2, role=FaultRole.PREFILL),))
    assert board.take(is_prefill=False, is_decode=True) is None
    assert board.take(is_prefill=True, is_decode=False) is not None
    assert board.pending()[0]["remaining"] == 1
    assert board.take(is_prefill=True, is_decode=False) is not None
    assert board.take(is_prefill=True, is_decode=False) is None
    board.add(FaultSpec(FaultKind.HEALTH_DOWN))
    assert board.health_down
    board.clear()
    assert not board.health_down
    assert board.pending() == []


# --- config -----------------------------------------------------------------------------------


def test_config_defaults_and_validation() -> None:
    config = EmulatorConfig()
    assert (config.host, config.port, config.mode, config.block_size) == (
        "127.0.0.1",
        8200,
        "strict",
        16,
    )
    with pytest.raises(ValueError, match="mode"):
        EmulatorConfig(mode="loose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        EmulatorConfig(block_size=0)
    with pytest.raises(ValueError, match="jitter"):
        EmulatorConfig(jitter=1.5)


def test_cli_has_one_flag_per_field() -> None:
    help_text = build_parser().format_help()
    for flag in ("--side-channel-port", "--prefill-s-per-token", "--prompt-tokens-details"):
        assert flag in help_text
    config = config_from_args(
        [
            "--port",
            "9000",
            "--mode",
            "lenient",
            "--prefill-s-per-token",
            "0.0001",
            "--prompt-tokens-details",
            "--fault",
            "status:503:2",
            "--fault",
            "health_down",
        ]
    )
    assert config.port == 9000
    assert config.mode == "lenient"
    assert config.prefill_s_per_token == 0.0001
    assert config.prompt_tokens_details is True
    assert config.faults == (
        FaultSpec(FaultKind.STATUS, count=2, status=503),
        FaultSpec(FaultKind.HEALTH_DOWN),
    )


def test_cli_rejects_bad_values() -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--block-size", "0"])
    with pytest.raises(SystemExit):
        config_from_args(["--fault", "explode"])
