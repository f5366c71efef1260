"""A tiny run of the scheduling simulator (bench/): structure, not performance."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.goodput import find_goodput
from bench.sim.run import simulate
from bench.sim.scenario import STANDARD, Scenario, Variant
from bench.simulate import main

TINY = replace(STANDARD, name="tiny", prefill_engines=2, decode_engines=2)


def run(variant: Variant, rate: float = 4.0, scenario: Scenario = TINY):
    return simulate(scenario, variant, rate, measured=300, warmup=50, seed=3)


def test_never_disaggregating_prefills_everything_locally():
    stats = run(Variant("qoe", "never"))
    assert stats.requests == 300
    assert stats.remote_share == 0
    assert stats.reasons == {"pool_empty": 300}
    assert stats.queue_mean == 0
    assert stats.local_prefill_share > 0


def test_always_disaggregating_prefills_everything_remotely():
    stats = run(Variant("round_robin", "always"))
    assert stats.remote_share == 1
    assert stats.reasons == {"scheduled": 300}
    assert stats.local_prefill_share == 0


def test_conditional_disaggregation_splits_by_prompt():
    stats = run(Variant("qoe"))
    assert 0 < stats.remote_share < 1
    assert set(stats.reasons) <= {"scheduled", "short_prompt", "prefix_cached", "pool_saturated"}
    assert stats.reasons["short_prompt"] > 0
    assert stats.reasons["prefix_cached"] > 0  # multi-turn: the history is on the decode engine
    assert stats.by_kind.keys() == {"chat", "rag", "multi"}


@pytest.mark.parametrize("state", ["shared", "local"])
@pytest.mark.parametrize("stale_mode", ["delay", "scrape"])
def test_every_state_and_staleness_model_runs(state, stale_mode):
    scenario = replace(TINY, state=state, stale_mode=stale_mode, bursty=True)
    stats = run(Variant("least_loaded"), scenario=scenario)
    assert 0 <= stats.attainment <= 1
    assert stats.unfinished == 0
    assert 0 < stats.ttft_p50 <= stats.ttft_p99
    assert 0 < stats.tpot_p50 <= stats.tpot_p99


def test_runs_are_reproducible():
    assert run(Variant("qoe")).ttft_p99 == run(Variant("qoe")).ttft_p99


def test_overload_lowers_attainment():
    assert run(Variant("qoe"), rate=40.0).attainment < run(Variant("qoe"), rate=2.0).attainment


def test_goodput_search_brackets_the_target():
    found = find_goodput(
        TINY, Variant("qoe"), guess=8.0, measured=150, warmup=30, seed=1, precision=0.1
    )
    assert found.rate > 0
    assert found.at_rate is not None
    assert found.at_rate.attainment >= TINY.target_attainment
    failing = [run.rate for run in found.runs if run.attainment < TINY.target_attainment]
    assert failing
    assert min(failing) <= found.rate * 1.1 + 1e-9


def test_the_command_prints_goodput_and_latency_tables(capsys):
    main(["--scenario", "standard", "--policies", "never", "--requests", "100", "--jobs", "1"])
    out = capsys.readouterr().out
    assert "Goodput: highest rate with >= 90 %" in out
    assert "never (all local)" in out
    assert "max/mean" in out
    assert "runs in" in out
