"""The simulator's evaluation protocol: trace replay, decode engines that queue, the anchors'
own decode picks, the metrics, the rate grid and the paired intervals."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from bench.sim.anchors import LlmdScorer
from bench.sim.engines import DecodeEngine, Job, Loop, Request, tail_gap
from bench.sim.protocol import capacity, crossing, paired_ratio
from bench.sim.run import Simulation
from bench.sim.scenario import LEAST_LOADED, LLMD, NEVER, QOE, QOE_ALWAYS, SGLANG
from bench.sim.scenarios import MOONCAKE, SHARED_PROMPTS, STANDARD
from bench.sim.traces import mooncake
from bench.sim.workload import Shape
from bench.simulate import main_cli
from sidecar.scheduling.model import Transfer


def write_trace(path, timestamps_ms):
    rows = [
        {"timestamp": at, "input_length": 600, "output_length": 4, "hash_ids": [i, 10**6 + i]}
        for i, at in enumerate(timestamps_ms)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0])
def test_a_trace_s_grouped_timestamps_replay_evenly_spread_at_every_rate(tmp_path, rate):
    # Groups of 4, 2, 1 and 3 requests at 0, 1, 3 and 4 s: each group spread up to the next
    # timestamp, the last one over the mean interval between timestamps (4 / 3 s).
    stamps = [0, 0, 0, 0, 1000, 1000, 3000, 4000, 4000, 4000]
    trace = write_trace(tmp_path / "grouped.jsonl", stamps)
    scenario = replace(MOONCAKE, trace_path=trace, prefill_engines=1, decode_engines=1)
    simulation = Simulation(scenario, QOE, rate, measured=len(stamps), warmup=0, seed=1)
    simulation.run()
    arrivals = [request.arrival for request in simulation.requests]
    assert len(set(arrivals)) == len(stamps)
    steps = [0.25] * 4 + [1.0] * 2 + [1.0] + [4 / 9] * 2  # seconds of trace time apart
    scale = (len(stamps) - 1) / sum(steps)  # the trace's mean rate is 1 request/s
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert gaps == pytest.approx([step * scale / rate for step in steps])


def remote_requests(count: int, output_tokens: int) -> list[Request]:
    shape = Shape("chat", 100, 0, output_tokens, None, 0.0, prompt_chars=400)
    return [Request(i, shape, 0.0, True) for i in range(count)]


@pytest.mark.parametrize("seats", [2, 0])
def test_a_decode_engine_runs_at_most_its_batch_and_queues_the_rest(seats):
    scenario = replace(STANDARD, decode_max_batch=seats)
    loop = Loop()
    finished: list[Request] = []
    engine = DecodeEngine(loop, 0, scenario, lambda request: None, finished.append)
    requests = remote_requests(3, output_tokens=5)
    for request in requests:
        engine.arrive_remote(request)
    assert engine.gauge.at(0.0)[0] == (1 if seats else 0)  # waiting: the third, for a seat
    loop.run()
    first, second, third = requests
    if seats:
        # The third waits for a seat: its first token comes after the first one finished.
        assert third.first_token > first.finish
    else:
        # The second and third join the batch at the same step boundary.
        assert third.first_token == second.first_token < first.finish
    assert len(finished) == 3


def decode_concentration(variant) -> float:
    """Mean over system prompts of the share of its requests on its most used decode engine."""
    scenario = replace(SHARED_PROMPTS, prefill_engines=2, decode_engines=4)
    simulation = Simulation(scenario, variant, 2.0, measured=120, warmup=30, seed=2)
    simulation.run()
    engines: dict[int, Counter[int]] = defaultdict(Counter)
    for request in simulation.requests:
        engines[request.shape.segments[0].key][request.engine] += 1
    return sum(max(c.values()) / sum(c.values()) for c in engines.values()) / len(engines)


def test_each_anchor_picks_the_decode_engine_its_own_way():
    # SGLang's cache_aware and llm-d's decode profile both follow the prompt's prefix to the
    # decode engine that saw it; the gateway in front of the other variants spreads by load.
    assert decode_concentration(SGLANG) > 0.9
    assert decode_concentration(LLMD) > 0.9
    assert decode_concentration(LEAST_LOADED) < 0.8


def test_llmd_s_decode_profile_lets_the_queue_push_back():
    waiting = {"decode-0": 4.0, "decode-1": 0.0, "p0": 0.0}
    scorer = LlmdScorer(["p0"], 1000, random.Random(1), lambda pod, at: waiting[pod])
    hashes = scorer.hashes("y" * 640)
    pods = ["decode-0", "decode-1"]
    scorer.record("decode-0", hashes)
    assert scorer.choose(hashes, 0.0, pods) == "decode-0"  # 2 x 1 + 0 > 0 + 1
    scorer.record("decode-1", hashes[:4])
    assert scorer.choose(hashes, 0.0, pods) == "decode-0"  # 2 > 2 x 0.4 + 1
    scorer._index["decode-0"].clear()
    scorer.record("decode-0", hashes[:4])
    assert scorer.choose(hashes, 0.0, pods) == "decode-1"  # the queue decides between equals


def test_tail_time_between_tokens_is_the_mean_of_the_longest_tenth_of_the_gaps():
    times = [0.0]
    for gap in [0.02] * 18 + [0.5, 0.3]:
        times.append(times[-1] + gap)
    assert tail_gap(times) == pytest.approx(0.4)  # the longest 2 of 20 gaps
    assert tail_gap(times[:12]) == pytest.approx(0.02)  # 11 gaps: the longest 2
    assert tail_gap([1.0]) == 0.0


def test_a_local_prefill_s_stall_shows_in_the_tail_not_in_the_mean_tpot():
    loop = Loop()
    engine = DecodeEngine(loop, 0, STANDARD, lambda request: None, lambda request: None)
    (decoding,) = remote_requests(1, output_tokens=60)
    decoding.endpoint = "p0"
    engine.arrive_remote(decoding)
    prompt = Shape("rag", 6000, 0, 2, None, 0.0, prompt_chars=24000)
    local = Request(1, prompt, 0.3, True)
    loop.at(0.3, lambda _: engine.submit_local(Job(local, 6000)))  # stalls the batch ~0.7 s
    loop.run()
    tpot = (decoding.finish - decoding.first_token) / 59
    assert tpot < STANDARD.tpot_slo_s  # the mean hides the stall ...
    assert decoding.tail_tbt > 0.1  # ... the tail shows it
    assert local.tail_tbt == pytest.approx(local.finish - local.first_token)  # one gap


def test_every_run_reports_each_slo_set_and_its_two_halves_apart():
    stats = Simulation(
        replace(STANDARD, prefill_engines=2, decode_engines=2),
        NEVER,
        6.0,
        measured=300,
        warmup=50,
        seed=3,
    ).run()
    assert list(stats.slos) == [
        "scaled",
        "constant",
        "mooncake 100 ms",
        "mooncake 200 ms",
        "mooncake 300 ms",
    ]
    scaled = stats.slos["scaled"]
    assert (scaled.both, scaled.ttft, scaled.decode) == (
        stats.attainment,
        stats.ttft_attainment,
        stats.tpot_attainment,
    )
    for met in stats.slos.values():
        assert met.both <= min(met.ttft, met.decode)
    tails = [stats.slos[f"mooncake {ms} ms"].decode for ms in (100, 200, 300)]
    assert tails == sorted(tails)
    assert tails[0] < 1  # local prefills stall the batches
    assert stats.tail_tbt_mean > stats.tpot_mean


def test_a_ratio_s_interval_is_paired_over_the_seeds():
    same = paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert same is not None
    assert (same.mean, same.low, same.high) == pytest.approx((2.0, 2.0, 2.0))  # no spread
    spread_ = paired_ratio([2.0, 8.0], [1.0, 2.0])
    assert spread_ is not None
    half = 12.706 * (math.log(2) / math.sqrt(2)) / math.sqrt(2)  # t x sd / sqrt n
    assert spread_.mean == pytest.approx(2 * math.sqrt(2))
    assert spread_.low == pytest.approx(2 * math.sqrt(2) * math.exp(-half))
    assert spread_.high == pytest.approx(2 * math.sqrt(2) * math.exp(half))
    assert paired_ratio([1.0, 2.0], [0.0, 1.0]) is None  # a ratio that does not exist


def test_goodput_is_read_where_the_curve_crosses_and_flagged_when_it_crosses_flat():
    steep = crossing([(2.0, 1.0), (4.0, 0.98), (6.0, 0.5)], 0.9, capacity=10.0)
    assert steep.rate == pytest.approx(4.0 + 2.0 * 0.08 / 0.48)
    assert steep.steep  # 48 points over 20 % of capacity
    flat = crossing([(2.0, 0.95), (4.0, 0.85)], 0.9, capacity=10.0)
    assert flat.rate == pytest.approx(3.0)
    assert not flat.steep  # 10 points over 20 % of capacity
    assert crossing([(2.0, 0.5)], 0.9, 10.0).bound == "<"
    assert crossing([(2.0, 0.95)], 0.9, 10.0).bound == ">="


def test_protocol_seeds_vary_a_trace_s_window_and_phase_keeping_the_spread(tmp_path):
    stamps = [1000 * (i // 5) for i in range(200)]  # 40 timestamps, 5 requests each
    trace = write_trace(tmp_path / "windows.jsonl", stamps)
    scenario = replace(MOONCAKE, trace_path=trace, trace_windows=True)
    one, two = mooncake(trace, scenario, 1), mooncake(trace, scenario, 2)
    assert one == mooncake(trace, scenario, 1)
    assert one[0].segments != two[0].segments  # another window
    assert [s.gap for s in one] != [s.gap for s in two]  # another phase
    for shapes_ in (one, two):
        gaps = Counter(round(shape.gap, 9) for shape in shapes_[1:])
        assert min(gaps) > 0
        assert gaps.most_common(1)[0][1] >= 4 * 39  # within each group: evenly spaced
    fixed = replace(scenario, trace_windows=False)
    assert [s.gap for s in mooncake(trace, fixed, 1)] == [s.gap for s in mooncake(trace, fixed, 2)]


def test_the_protocol_runs_every_variant_at_the_same_grid_of_capacity(capsys):
    args = ["--protocol", "--scenario", "standard", "--requests", "100", "--jobs", "1"]
    args += ["--seeds", "1,2", "--grid", "0.5,1", "--policies", "qoe,qoe:always"]
    assert main_cli(args) == 0
    out = capsys.readouterr().out
    nominal = capacity(STANDARD)
    assert nominal.rate == min(nominal.prefill, nominal.decode)
    assert f"rates {nominal.rate * 0.5:.2f}, {nominal.rate:.2f} req/s (50 %, 100 %)" in out
    assert "decider alone    qoe / qoe always" in out
    assert "TTFT met, scaled SLO" in out
    assert "tail TBT mean" in out
    assert "8 runs in" in out


def test_means_are_over_the_requests_that_got_there_and_the_rest_is_counted():
    overloaded = replace(STANDARD, prefill_engines=1, decode_engines=1)
    stats = Simulation(overloaded, NEVER, 30.0, measured=300, warmup=20, seed=3).run()
    assert 0 < stats.unfinished < stats.requests
    assert stats.unfinished_share == stats.unfinished / stats.requests
    assert math.isinf(stats.ttft_p99)
    assert math.isfinite(stats.ttft_mean)
    assert math.isfinite(stats.tpot_mean)
    assert math.isfinite(stats.tail_tbt_mean)


def test_a_decode_engine_counts_the_requests_pulling_kv_as_waiting():
    # vLLM's vllm:num_requests_waiting counts a request whose KV is still coming from the
    # prefill server (WAITING_FOR_REMOTE_KVS); here a transfer takes 0.5 s, no seat is short.
    scenario = replace(
        STANDARD,
        prefill_engines=1,
        decode_engines=1,
        decode_max_batch=0,
        transfer=Transfer(fixed_s=0.5, s_per_token=0.0),
    )
    simulation = Simulation(scenario, QOE_ALWAYS, 2.0, measured=20, warmup=0, seed=1)
    simulation.run()
    gauge = simulation.decode[0].gauge
    remote = [request for request in simulation.requests if request.endpoint is not None]
    assert remote
    # The KV arrives at most two steps before the first token, and left 0.5 s before that.
    for request in remote:
        assert gauge.at(request.first_token - 0.2)[0] >= 1
