"""The exact-vs-approximate sweep (``bench.sim.sweep``, ``python -m bench exact_sweep``): the
exact variant decides as production does beside the approximate index, the sweep's cells and
pairing, its verdicts read from the intervals, its table and JSON."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace

import orjson
import pytest

from bench.exact_sweep import main_cli
from bench.sim.caches import chain
from bench.sim.engines import Loop
from bench.sim.exact import EventedCache, ExactLookup, ExactPrompt, ExactSource, prompt_ids
from bench.sim.protocol import Interval
from bench.sim.run import Simulation, simulate
from bench.sim.scenario import QOE_EXACT
from bench.sim.scenarios import MOONCAKE_EVICT
from bench.sim.sweep import APPROXIMATE, EXACT, Sweep, lead_of
from bench.sim.texts import Segment
from sidecar.kvevents.events import AllBlocksCleared, EventBatch
from sidecar.kvevents.index import PromptKeys


def seg(key: int, tokens: int) -> Segment:
    return Segment(key, tokens, tokens * 4)


def write_trace(path, conversations: int, turns: int, gap_ms: int = 1000) -> str:
    """Conversations of growing prompts (each turn the previous one's blocks and one more),
    interleaved, one request per ``gap_ms``."""
    rows: list[dict[str, object]] = []
    for turn in range(turns):
        for c in range(conversations):
            ids = [1000 + c * 100 + i for i in range(turn + 2)]
            rows.append(
                {
                    "timestamp": len(rows) * gap_ms,
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 20,
                    "hash_ids": ids,
                }
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_exact_variant_keeps_each_prompt_s_own_home(tmp_path):
    """The exact indexes answer what each engine holds; the prompt's prefix hashes still give
    its home (production computes them beside the look-ups): at a light load the conversations'
    first turns, which no engine holds, spread over the engines by their prefixes, and every
    later turn goes where its conversation went."""
    trace = write_trace(tmp_path / "trace.jsonl", conversations=16, turns=3)
    scenario = replace(
        MOONCAKE_EVICT, trace_path=trace, prefill_restart_s=0.0, foreign_tokens_per_s=0.0
    )
    simulation = Simulation(scenario, QOE_EXACT, 0.2, measured=48, warmup=0, seed=1)
    simulation.run()
    engines: dict[int, Counter[str]] = defaultdict(Counter)
    for request in simulation.requests:
        if request.endpoint is not None:  # not prefilled on its decode engine
            engines[request.shape.segments[1].key // 100][request.endpoint] += 1
    first = Counter(next(iter(used)) for used in engines.values())
    assert len(first) == scenario.prefill_engines  # every engine is some conversation's home
    assert all(len(used) == 1 for used in engines.values())


def test_the_approximate_variant_runs_once_per_cell_and_pairs_with_every_lag():
    sweep = Sweep(
        base=MOONCAKE_EVICT,
        caches=(1000, 2000),
        restart_s=100.0,
        foreign_tokens_per_s=500.0,
        lags=(0.05, 1.0),
        grid=(0.5, 0.8),
        seeds=(1, 2, 3),
        measured=10,
        warmup=0,
    )
    cells = sweep.cells()
    assert len(cells) == 16
    assert sum(cell.disturbed for cell in cells) == 12
    keys = sweep.runs()
    assert len(keys) == len(set(keys))
    assert sum(variant == EXACT for variant, *_ in keys) == 16 * 3 * 2
    assert sum(variant == APPROXIMATE for variant, *_ in keys) == 8 * 3 * 2
    for cell in cells:  # what the outcomes pair: every seed and rate of both sides
        for seed in sweep.seeds:
            for fraction in sweep.grid:
                assert (EXACT, cell, seed, fraction) in keys
                assert (APPROXIMATE, cell.approximate(), seed, fraction) in keys
    assert [key[2] for key in keys] == sorted(key[2] for key in keys)  # seed by seed
    scenario = sweep.scenario(cells[-1])
    assert (scenario.prefill_cache_tokens, scenario.prefill_restart_s) == (2000, 100.0)
    assert (scenario.foreign_tokens_per_s, scenario.kv_event_lag_s) == (500.0, 1.0)
    assert scenario.trace_windows


@pytest.mark.parametrize(
    ("interval", "expected"),
    [
        (Interval(1.12, 1.06, 1.19, 5), "shown"),
        (Interval(1.04, 0.97, 1.11, 5), "open"),
        (Interval(1.00, 0.97, 1.03, 5), "missed"),
        (None, "unread"),
    ],
)
def test_the_lead_where_the_caches_are_disturbed_is_read_from_the_interval(interval, expected):
    assert lead_of(interval) == expected


@pytest.mark.system  # 48 short runs: a few seconds
def test_the_sweep_prints_a_row_per_cell_and_writes_its_json(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.jsonl", conversations=6, turns=8)
    out = tmp_path / "sweep.json"
    argv = ["--trace", trace, "--seeds", "1,2", "--grid", "0.5", "--requests", "15"]
    assert main_cli([*argv, "--warmup", "5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith(("786k,", "1,536k,"))]
    document = orjson.loads(out.read_bytes())
    assert len(document["cells"]) == 16
    assert len(document["runs"]) == (16 + 8) * 2
    for cell in document["cells"]:
        for side in ("exact", "approximate"):
            assert 0.0 <= cell[side]["wrong"][0] <= 1.0
            assert 0.0 <= cell[side]["hit"][0] <= 1.0
        assert cell["verdict"] in text
    assert len(rows) == 16
    assert "48 runs in" in text


def test_in_flight_placements_count_as_held_until_their_events_arrive():
    """The what-if ``kv_in_flight``: a prompt sent to an engine counts as held there from the
    placement until its prefill's events reach the indexes, which a lag hides otherwise."""
    loop = Loop()
    source = ExactSource(loop, lag_s=1.0)
    cache = EventedCache(100_000, 16)
    source.subscribe("e", cache)
    first = [seg(1, 512), seg(2, 512), seg(3, 40)]
    follow_up = [*first[:2], seg(4, 300)]
    lookup = ExactLookup(source)
    chained = chain(first)
    lookup.begin(
        ExactPrompt(PromptKeys(prompt_ids(follow_up)), 1.0, chain(follow_up), [512] * 2 + [300])
    )
    assert lookup("e") == 0
    source.placed("e", chained)
    assert lookup("e") == 1024  # the shared segments, in flight
    cache.store(first)  # the prefill ends; its events are a second away
    source.arrived("e", chained)
    assert source.in_flight["e"] == Counter()
    assert lookup("e") == 0
    loop.run()
    assert lookup("e") == 1024  # the index holds them now


def test_with_a_lag_the_in_flight_what_if_predicts_the_follow_ups(tmp_path):
    # A conversation's turns one second apart; events 3 s behind: without the what-if the
    # exact index does not see the turn before, still in flight or lagging.
    trace = write_trace(tmp_path / "trace.jsonl", conversations=2, turns=20, gap_ms=500)
    scenario = replace(
        MOONCAKE_EVICT,
        trace_path=trace,
        prefill_restart_s=0.0,
        foreign_tokens_per_s=0.0,
        kv_event_lag_s=3.0,
    )
    runs = {
        flight: simulate(
            replace(scenario, kv_in_flight=flight), QOE_EXACT, 1.0, measured=30, warmup=5, seed=1
        )
        for flight in (False, True)
    }
    assert runs[True].prefix_wrong_share < runs[False].prefix_wrong_share


def test_restarts_keep_their_own_rate_beside_foreign_traffic(tmp_path):
    """Engines restarted every 20 s on average and foreign prompts cached every ~4 s: over
    ~200 virtual seconds, four engines restart about 40 times in all, not every 4 s."""
    trace = write_trace(tmp_path / "trace.jsonl", conversations=8, turns=25)
    scenario = replace(
        MOONCAKE_EVICT, trace_path=trace, prefill_restart_s=20.0, foreign_tokens_per_s=1000.0
    )
    simulation = Simulation(scenario, QOE_EXACT, 1.0, measured=190, warmup=10, seed=1)
    assert simulation.exact is not None
    clears: Counter[str] = Counter()

    def observe(key: str, batch: EventBatch) -> None:
        clears[key] += sum(isinstance(event, AllBlocksCleared) for event in batch.events)

    simulation.exact.observer = observe
    stats = simulation.run()
    expected = stats.sim_s / 20.0 * scenario.prefill_engines
    assert expected / 2 < clears.total() < expected * 2
