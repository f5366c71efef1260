"""A tiny run of the scheduling simulator (bench/): structure, not performance."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench.sim.checks import GoodputRatio, Outcome, QueueBalance
from bench.sim.goodput import find_goodput
from bench.sim.run import Simulation, simulate
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


def test_the_fleet_is_sized_on_the_command_line_and_runs_are_kept(capsys, tmp_path):
    kept = str(tmp_path / "runs.pickle")
    args = ["--protocol", "--scenario", "standard", "--requests", "100", "--jobs", "1"]
    args += ["--seeds", "1", "--grid", "0.5", "--policies", "qoe,qoe:always"]
    args += ["--prefill-engines", "2", "--decode-engines", "5", "--runs-file", kept]
    assert main_cli(args) == 0
    first = capsys.readouterr().out
    assert "standard: 2 prefill + 5 decode engines, 5 sidecars" in first
    assert "2 runs in" in first
    assert main_cli(args) == 0  # the same runs again: read, not simulated
    again = capsys.readouterr().out
    assert "0 runs in" in again
    assert (
        again.split("\n== ")[1].split("\n\n0 runs")[0]
        == first.split("\n== ")[1].split("\n\n2 runs")[0]
    )
    with pytest.raises(SystemExit, match="mixed set each prefill engine's speed"):
        main_cli(["--protocol", "--scenario", "mixed", "--prefill-engines", "2"])
    with pytest.raises(SystemExit, match="at least 1"):
        main_cli(["--protocol", "--scenario", "standard", "--decode-engines", "0"])


def test_decode_engines_serve_their_time_between_tokens_to_the_sidecars():
    simulation = Simulation(TINY, QOE, 4.0, measured=300, warmup=50, seed=3)
    simulation.run()
    for engine in simulation.decode:
        served = engine.inter_token(math.inf)
        assert served is not None
        total, tokens = served
        assert tokens > 0
        # Each token's gap: at least a step at batch 1, at most a step plus the local prefills.
        assert TINY.decode_step_s(1) <= total / tokens <= TINY.decode_step_s(64) * 2
        assert engine.inter_token(-1.0) == (0.0, 0)
    # The budgets learnt the engines' steps from them (production's StallBudget.scraped).
    for sidecar in simulation.sidecars:
        budget = sidecar.planner.budget_of(sidecar.rank)
        assert budget.step_s is not None
        assert TINY.decode_step_s(1) * 0.5 <= budget.step_s <= TINY.decode_step_s(64)
