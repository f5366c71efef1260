"""The coalesced sharing design in the simulator: background syncs, decisions that never wait,
and the randomised pick among the best candidates."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from bench.sim.engines import Loop
from bench.sim.run import simulate
from bench.sim.scenarios import STANDARD
from bench.sim.state import CoalescedClient, RedisClient, RedisServer
from bench.simulate import parse_variant
from sidecar.scheduling.model import Candidate
from sidecar.scheduling.policies import Qoe

RTT_S = 0.001
SYNC_S = 0.1


def coalesced(
    loop: Loop, server: RedisServer, index: int, phase_s: float, *, eager: bool = False
) -> CoalescedClient:
    return CoalescedClient(
        loop,
        server,
        index,
        rtt_s=RTT_S,
        lease_s=10.0,
        sync_s=SYNC_S,
        phase_s=phase_s,
        eager=eager,
    )


def run_until(loop: Loop, when: float) -> None:
    def stop(_: object) -> None:
        loop.stopped = True

    loop.at(when, stop)
    loop.run()
    loop.stopped = False


def tokens(client: CoalescedClient | RedisClient, endpoint: str) -> int:
    load = client.view().loads.get(endpoint)
    return 0 if load is None else load.tokens


def test_a_decision_decides_at_once_where_the_redis_backend_waits_a_round_trip():
    loop = Loop()
    decided: list[tuple[str, float]] = []
    now = coalesced(loop, RedisServer(), 0, phase_s=0.05)
    now.refresh(lambda: decided.append(("coalesced", loop.now)))
    assert decided == [("coalesced", 0.0)]  # before the loop ran: nothing waited for
    waits = RedisClient(loop, RedisServer(), 1, rtt_s=RTT_S, timeout_s=0.005, lease_s=10.0)
    waits.refresh(lambda: decided.append(("redis", loop.now)))
    run_until(loop, 0.01)
    assert decided == [("coalesced", 0.0), ("redis", RTT_S)]


def test_own_reservations_count_at_once_and_anothers_after_the_next_read():
    loop = Loop()
    server = RedisServer()
    a = coalesced(loop, server, 0, phase_s=0.0)  # rounds at 0, 0.1, 0.2, ...
    b = coalesced(loop, server, 1, phase_s=0.05)  # rounds at 0.05, 0.15, ...
    run_until(loop, 0.01)
    held = b.reserve("127.0.0.1:8000", 300)
    assert tokens(b, "127.0.0.1:8000") == 300  # its own: at once, before any sync
    assert tokens(a, "127.0.0.1:8000") == 0
    run_until(loop, 0.06)
    # b's round has reached the server, a has not read since.
    assert server.totals["127.0.0.1:8000"].tokens == 300
    assert tokens(a, "127.0.0.1:8000") == 0
    run_until(loop, 0.1 + RTT_S / 2 + 1e-6)  # a's next round ran at the server, not answered
    assert tokens(a, "127.0.0.1:8000") == 0
    run_until(loop, 0.1 + RTT_S + 1e-6)  # its answer: b's reservation counts
    assert tokens(a, "127.0.0.1:8000") == 300
    b.release(held)
    assert tokens(b, "127.0.0.1:8000") == 0
    run_until(loop, 0.2 + RTT_S + 1e-6)  # b's round at 0.15, a's read at 0.2
    assert tokens(a, "127.0.0.1:8000") == 0


def test_an_eager_sidecar_sends_a_change_at_once_unless_it_sent_within_sync_s():
    loop = Loop()
    server = RedisServer()
    eager = coalesced(loop, server, 0, phase_s=0.05, eager=True)
    run_until(loop, 0.01)
    eager.reserve("127.0.0.1:8000", 300)  # nothing sent yet: sent now, not at 0.05
    run_until(loop, 0.01 + RTT_S / 2 + 1e-6)
    assert server.totals["127.0.0.1:8000"].tokens == 300
    run_until(loop, 0.05)
    eager.reserve("127.0.0.1:8000", 200)  # sent 0.04 s ago: waits for the round at 0.11
    run_until(loop, 0.11)
    assert server.totals["127.0.0.1:8000"].tokens == 300
    run_until(loop, 0.11 + RTT_S / 2 + 1e-6)
    assert server.totals["127.0.0.1:8000"].tokens == 500


def test_qoe_among_two_draws_between_the_two_best_and_never_a_worse_one():
    candidates = [Candidate(str(i), reserved_tokens=1000 * i) for i in range(5)]
    spread = Qoe(random.Random(7), among=2)
    picks = Counter(spread.choose(candidates, 500).key for _ in range(400))  # type: ignore[union-attr]
    assert set(picks) == {"0", "1"}
    assert min(picks.values()) > 150
    best = Qoe(random.Random(7))
    assert {best.choose(candidates, 500).key for _ in range(50)} == {"0"}  # type: ignore[union-attr]


def test_the_coalesced_variants_run_and_report_the_prefill_load_balance():
    scenario = replace(STANDARD, name="tiny", prefill_engines=3, decode_engines=6)
    for text in ("qoe:always", "qoe:always:sync=0.1", "qoe:always:sync=0.05:top2"):
        variant = parse_variant(text)
        stats = simulate(scenario, variant, 15.0, measured=300, warmup=50, seed=3)
        assert stats.unfinished == 0
        assert stats.remote_share == 1
        # Busiest over mean: at least 1, at most the engines' count.
        assert 1 <= stats.load_max_over_mean <= 3
        assert 1 <= stats.load_ratio <= 3
    assert parse_variant("qoe:sync=0.2:sample2").label == "qoe sync 0.2 sample2"
