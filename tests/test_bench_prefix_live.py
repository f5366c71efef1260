"""bench/prefix_live.py: the shared-system-prompt workload it sends, the load it aims at, what it
judges, and (a system test) a quick run of the real processes."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest

from bench.prefix_live import (
    OUTPUT_TOKENS,
    SYSTEM_PROMPTS,
    SYSTEM_TOKENS,
    USER_TOKENS,
    Request,
    RunResult,
    Shape,
    Workload,
    affinity_report,
    block_tokens,
    ideal_hits,
    main,
    make_workload,
    one_server_shares,
    pool_rate,
    verdict,
)
from sidecar.emulator.kv import chain_hashes
from sidecar.emulator.text import prompt_from_completion
from sidecar.scheduling.prompts import estimate_tokens
from tests.tools import program


def test_the_workload_is_fixed_by_its_seed_and_has_its_shape() -> None:
    workload = make_workload(1, rate=50.0, duration_s=40.0)
    assert workload == make_workload(1, rate=50.0, duration_s=40.0)
    assert workload != make_workload(2, rate=50.0, duration_s=40.0)
    requests = workload.requests
    assert 1700 < len(requests) < 2300
    assert len(workload.system_tokens) == SYSTEM_PROMPTS
    assert all(SYSTEM_TOKENS[0] <= n <= SYSTEM_TOKENS[1] for n in workload.system_tokens)
    assert all(USER_TOKENS[0] <= r.user_tokens <= USER_TOKENS[1] for r in requests)
    assert all(OUTPUT_TOKENS[0] <= r.output_tokens <= OUTPUT_TOKENS[1] for r in requests)
    assert all(a.at < b.at for a, b in itertools.pairwise(requests))
    assert requests[-1].at <= 40.0
    # Zipf, s = 1.1, over 32: the first system prompt about 28 % of the requests, the 32nd 0.6 %.
    popularity = Counter(r.system for r in requests)
    assert 0.22 < popularity[0] / len(requests) < 0.34
    assert popularity[0] > popularity[1] > popularity[7] > popularity[31]


def test_prompts_share_their_system_prompt_block_for_block_and_nothing_else() -> None:
    workload = make_workload(3, rate=20.0, duration_s=10.0)
    requests = workload.requests
    same = next(
        (i, j)
        for i in range(len(requests))
        for j in range(i + 1, len(requests))
        if requests[i].system == requests[j].system
    )
    other = next(j for j in range(1, len(requests)) if requests[j].system != requests[0].system)
    for index in (*same, other):
        text = workload.prompt(index)
        tokens = workload.prompt_tokens(requests[index])
        assert len(text) == 4 * tokens
        assert prompt_from_completion(text).num_tokens == tokens  # the emulator's count
        assert estimate_tokens({"prompt": text}) == tokens  # the sidecar's estimate

    def blocks(index: int) -> list[bytes]:
        return chain_hashes(prompt_from_completion(workload.prompt(index)).full_blocks(16))

    system = workload.system_tokens[requests[same[0]].system]
    first, second = blocks(same[0]), blocks(same[1])
    shared = next(k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared == system // 16  # every full block of the system prompt, nothing after it
    assert blocks(0)[0] != blocks(other)[0]


def test_the_rate_aims_at_the_uncached_pool() -> None:
    slow = pool_rate(1, Shape(4000).speeds())
    assert 3.0 < slow < 7.0  # 2 engines at 10,000 tokens/s, 2 at 3,333; ~5,300-token prompts
    assert pool_rate(1, Shape(4000, speedup=20.0).speeds()) == pytest.approx(20 * slow)


def _result(name: str, ttft: float, hits: float = 0.0, failed: int = 0) -> RunResult:
    return RunResult(
        name, [ttft, ttft], failed, 1.0, None, [(hits, 1000.0)], {}, 0.0, 0.0, 0.0, 0.0, []
    )


def test_the_target_is_a_fifth_off_the_mean_with_hits_and_no_failure() -> None:
    assert verdict(_result("b", 1.0), _result("a", 0.8, hits=10))[0]
    assert not verdict(_result("b", 1.0), _result("a", 0.81, hits=10))[0]
    assert not verdict(_result("b", 1.0), _result("a", 0.5))[0]  # no hit on the prefill engines
    assert not verdict(_result("b", 1.0, failed=1), _result("a", 0.5, hits=10))[0]


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_a_quick_run_goes_through_the_real_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    program("redis-server", "redis-server")
    assert await main(["--quick", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith(("prefix-blind ", "prefix-aware "))
    ]
    assert len(rows) == 2
    for row in rows:
        assert row.split()[4] == "0"  # failed
    assert "TTFT prefix-aware / prefix-blind: mean" in out


def test_the_mean_absolute_error_weighs_every_sidecars_endpoints_by_their_answers() -> None:
    def endpoint(answers: int, error: float | None) -> dict[str, object]:
        return {"answers_with_cached_tokens": answers, "mean_abs_error_tokens": error}

    views = [
        {"enabled": True, "endpoints": {"a": endpoint(3, 100.0), "b": endpoint(0, None)}},
        {"enabled": True, "endpoints": {"a": endpoint(1, 500.0)}},
        {"enabled": False},
        None,
    ]
    result = RunResult("a", [1.0], 0, 1.0, None, [], {}, 0.0, 0.0, 0.0, 0.0, views)
    assert result.mean_abs_error() == 200.0
    assert RunResult("a", [1.0], 0, 1.0, None, [], {}, 0, 0, 0, 0, []).mean_abs_error() is None


def _affinity_workload() -> Workload:
    """Three system prompts of 1,024, 2,000 and 64 tokens; five requests."""
    requests = tuple(Request(system, 100, 10, float(i)) for i, system in enumerate((0, 0, 1, 0, 1)))
    return Workload(1, (1024, 2000, 64), requests)


def test_the_ideal_computes_each_system_prompt_once_over_the_remote_prefills() -> None:
    workload = _affinity_workload()
    # All remote: prompt 0 hits twice (1,024 tokens), prompt 1 once (2,000).
    assert ideal_hits(workload, [True] * 5) == (2 * 1024 + 2000, 3 * 1124 + 2 * 2100)
    # The first request local: the second of prompt 0 is the one that computes it.
    assert ideal_hits(workload, [False, True, True, True, True]) == (1024 + 2000, 2 * 1124 + 4200)
    # Whole blocks of 64 characters: 1,000 tokens are 62.5 blocks.
    assert block_tokens(1000) == 992
    assert block_tokens(15) == 0


def test_a_prefix_s_share_is_its_busiest_server_s_share_of_its_remote_prefills() -> None:
    workload = _affinity_workload()
    placements = ["a", "b", "a", "a", None]
    assert one_server_shares(workload, placements) == {0: (2 / 3, 3), 1: (1.0, 1)}


def test_the_affinity_verdict_needs_hits_ttft_and_one_server_per_judged_prefix() -> None:
    requests = tuple(Request(0, 100, 10, float(i)) for i in range(6))
    workload = Workload(1, (1000,), requests)
    everything = 6 * 1100.0

    def run(name: str, ttft: float, hits: float, placements: Sequence[str | None]) -> RunResult:
        return RunResult(
            name, [ttft], 0, 1.0, None, [(hits, everything)], {}, 0, 0, 0, 0, [], list(placements)
        )

    baseline = run("round-robin", 1.0, 1000.0, ["a", "b"] * 3)
    ideal = 5 * float(block_tokens(1000))
    assert affinity_report(workload, baseline, run("aware", 0.8, 0.86 * ideal, ["a"] * 6))[0]
    assert not affinity_report(workload, baseline, run("aware", 0.81, ideal, ["a"] * 6))[0]
    assert not affinity_report(workload, baseline, run("aware", 0.5, 0.8 * ideal, ["a"] * 6))[0]
    split = ["a", "a", "a", "a", "b", "b"]  # 4 of 6 on one server
    ok, lines = affinity_report(workload, baseline, run("aware", 0.5, ideal, split))
    assert not ok
    assert "prefix 0, its requests' servers in order: 0@0.0s 0@1.0s" in lines[-2]


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_a_quick_affinity_run_goes_through_the_real_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    program("redis-server", "redis-server")
    assert await main(["--affinity", "--quick", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("round-robin ", "prefix-aware "))]
    assert len(rows) == 2
    for row in rows:
        assert row.split()[4] == "0"  # failed
    assert "prefix-aware: hit ratio" in out
    assert "x round robin's" in out
