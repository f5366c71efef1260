"""The exact-vs-approximate sweep (``bench.sim.sweep``, ``python -m bench exact_sweep``): the
exact variant decides as production does beside the approximate index, the sweep's cells and
pairing, its verdicts read from the intervals, its table and JSON."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace

from bench.sim.run import Simulation
from bench.sim.scenario import QOE_EXACT
from bench.sim.scenarios import MOONCAKE_EVICT


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
