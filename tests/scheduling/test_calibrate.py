"""bench/calibrate.py's pure parts: the trace, the prompts it writes, the load it aims at."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.calibrate import CALIBRATION, agree, main, make_trace, prompt_for, rate_for
from bench.sim.run import simulate
from bench.sim.scenario import Variant
from sidecar.emulator.text import prompt_from_completion
from sidecar.scheduling.prompts import estimate_tokens
from tests.tools import program


def test_a_trace_is_fixed_by_its_seed_and_assigns_every_request_a_decode_pod():
    trace = make_trace(CALIBRATION, 1, rate=8.0, duration_s=10.0)
    assert trace == make_trace(CALIBRATION, 1, rate=8.0, duration_s=10.0)
    assert trace != make_trace(CALIBRATION, 2, rate=8.0, duration_s=10.0)
    assert 40 < len(trace) < 130
    assert {shape.home for shape in trace} == {0, 1}
    assert sum(shape.gap for shape in trace) <= 10.0
    assert {shape.kind for shape in trace} == {"chat", "rag"}


def test_prompts_have_the_true_count_for_the_emulator_and_the_length_for_the_sidecar():
    for shape in make_trace(CALIBRATION, 3, rate=8.0, duration_s=5.0):
        text = prompt_for(shape, "tag")
        assert prompt_from_completion(text, "words").num_tokens == shape.prompt_tokens
        assert estimate_tokens({"prompt": text}) == max(1, shape.prompt_chars // 4)
    shape = make_trace(CALIBRATION, 3, rate=8.0, duration_s=5.0)[0]
    assert prompt_for(shape, "a")[:64] != prompt_for(shape, "b")[:64]  # no shared block


def test_the_rate_aims_at_the_load():
    assert rate_for(CALIBRATION, 0.35, 1) == pytest.approx(rate_for(CALIBRATION, 0.7, 1) / 2)
    doubled = replace(CALIBRATION, prefill_speeds=tuple(2 * s for s in CALIBRATION.speeds()))
    assert rate_for(doubled, 0.7, 1) > 1.5 * rate_for(CALIBRATION, 0.7, 1)


def test_the_simulator_runs_a_calibration_trace_with_the_real_sidecars_scrape_phases():
    trace = make_trace(CALIBRATION, 1, rate=6.0, duration_s=5.0)

    def run(phases):
        return simulate(
            CALIBRATION,
            Variant("least_loaded"),
            1.0,
            measured=len(trace),
            warmup=0,
            seed=1,
            trace=trace,
            scrape_phases=phases,
        )

    stats = run([0.1, 0.6])
    assert stats.requests == len(trace)
    assert stats.unfinished == 0
    assert 0 < stats.remote_share < 1
    assert run([0.1, 0.6]).ttft_mean == stats.ttft_mean  # the phases given, not drawn
    # ... and they matter: least_loaded reads the scrapes.
    assert {run([p, p]).ttft_mean for p in (0.0, 0.3, 0.6, 0.9)} != {stats.ttft_mean}


def test_agreement_is_within_a_quarter():
    assert agree(1.0, 1.25)
    assert agree(1.0, 0.75)
    assert not agree(1.0, 1.26)
    assert not agree(0.0, 0.0)


@pytest.mark.system
@pytest.mark.timeout(120)
async def test_a_short_calibration_runs_the_real_processes_and_the_simulator(capsys, tmp_path):
    program("redis-server", "redis-server")
    argv = ["--policies", "qoe", "--runs", "1", "--duration", "2", "--log-dir", str(tmp_path)]
    status = await main(argv)
    out = capsys.readouterr().out
    assert "(0 failed)" in out
    assert "Median of 1 run(s), real vs simulated" in out
    assert status in (0, 1)  # 2 s of arrivals are too few to judge the agreement by
