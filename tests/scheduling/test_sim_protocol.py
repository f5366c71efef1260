"""The simulator's evaluation protocol: trace replay, decode engines that queue, the anchors'
own decode picks, the metrics, the rate grid and the paired intervals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.sim.engines import DecodeEngine, Loop, Request
from bench.sim.run import Simulation
from bench.sim.scenario import QOE
from bench.sim.scenarios import MOONCAKE, STANDARD
from bench.sim.workload import Shape


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
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
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
