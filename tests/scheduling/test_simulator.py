"""A tiny run of the scheduling simulator (bench/): structure, not performance."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.checks import GoodputRatio, Outcome, QueueBalance
from bench.sim.goodput import find_goodput
from bench.sim.run import simulate
from bench.sim.scenario import LEAST_LOADED, QOE, ROUND_ROBIN, Scenario, Variant
from bench.sim.scenarios import MIXED, STANDARD
from bench.simulate import main_cli

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
    # (retest: an endpoint the policy left alone for SIDECAR_SCHEDULER_RETEST_S; decode_budget:
    # a local prefill the decodes running on the engine could not absorb)
    assert set(stats.reasons) <= {
        "scheduled",
        "short_prompt",
        "prefix_cached",
        "pool_saturated",
        "decode_budget",
        "retest",
    }
    assert stats.reasons["short_prompt"] > 0
    assert stats.reasons["prefix_cached"] > 0  # multi-turn: the history is on the decode engine
    assert stats.by_kind.keys() == {"chat", "rag", "multi"}


@pytest.mark.parametrize("state", ["redis", "shared", "local"])
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


def test_plain_and_honest_models_differ():
    honest = run(Variant("qoe"), rate=6.0)
    plain = run(Variant("qoe"), rate=6.0, scenario=TINY.plain())
    assert honest.ttft_p99 != plain.ttft_p99


def test_engines_work_on_true_counts_while_sidecars_estimate():
    # The same requests: only what the sidecars see changes, so the decisions do.
    estimated = run(Variant("qoe"), rate=6.0)
    exact = run(Variant("qoe"), rate=6.0, scenario=replace(TINY, tokens="exact"))
    assert estimated.reasons != exact.reasons


def test_a_mixed_fleet_runs_in_both_engine_models():
    fleet = replace(MIXED, prefill_engines=2, decode_engines=2, prefill_speeds=(30_000, 10_000))
    for scenario in (fleet, replace(fleet, engine_model="slots", decode_s_per_token=0.01)):
        stats = run(Variant("qoe"), rate=3.0, scenario=scenario)
        assert stats.unfinished == 0
        assert 0 < stats.remote_share < 1


def test_a_check_whose_variants_did_not_run_fails_with_a_message():
    outcome = Outcome({ROUND_ROBIN: 10.0}, {ROUND_ROBIN: 1.2})
    verdict = GoodputRatio(QOE, ROUND_ROBIN, 1.3).judge(outcome)
    assert verdict.failed
    assert "cannot run" in verdict.text
    assert "qoe" in verdict.text
    assert QueueBalance(QOE, 1.5).judge(outcome).failed
    # A report does not fail, even when it cannot run.
    assert GoodputRatio(QOE, ROUND_ROBIN, None).judge(outcome).ok is None
    assert QueueBalance(LEAST_LOADED, None).judge(outcome).ok is None


def test_checks_judge_ratios():
    outcome = Outcome({QOE: 13.0, ROUND_ROBIN: 10.0}, {QOE: 1.4})
    assert GoodputRatio(QOE, ROUND_ROBIN, 1.3).judge(outcome).ok is True
    assert GoodputRatio(QOE, ROUND_ROBIN, 1.31).judge(outcome).ok is False
    assert GoodputRatio(QOE, QOE, 1).judge(outcome).ok is False  # strictly greater
    assert QueueBalance(QOE, 1.5).judge(outcome).ok is True
    assert QueueBalance(QOE, 1.3).judge(outcome).ok is False


def test_the_command_prints_goodput_and_latency_tables(capsys):
    quick = ["--requests", "100", "--jobs", "1", "--seeds", "1"]
    status = main_cli(["--scenario", "standard", "--policies", "never", *quick])
    out = capsys.readouterr().out
    assert "Goodput (req/s): highest rate with >= 90 %" in out
    assert "never (all local)" in out
    assert "max/mean" in out
    assert "runs in" in out
    # Only 'never' ran: every check needing another variant fails, loudly.
    assert status == 1
    assert "[FAIL] standard seed 1: qoe goodput >= 1.5x round_robin always" in out
    assert "cannot run, not run: qoe, round_robin always" in out
    assert main_cli(["--scenario", "standard", "--policies", "never", "--no-checks", *quick]) == 0
    assert "checks not judged (--no-checks)" in capsys.readouterr().out
