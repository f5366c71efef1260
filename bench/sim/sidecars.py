"""A modelled sidecar: production's placement code (``sidecar.scheduling``) fed from the model.

Each one owns what a sidecar process owns — a ``Planner`` (the pool's ``EndpointState``s with
real ``SpeedEstimate``s, ageing in virtual time with production's default half-life, and
``Health``; re-tests at production's default interval; the decider and its seeded policy, the
local speed), the decode engine's ``DecodeRanks`` (one rank; its ``PrefixIndex`` is the prefix
estimate) and a modelled state backend (``bench.sim.state``) — and decides with production's
code: the token estimate (``prompts.tokens_of_text``), the rank claim
(``DecodeRanks.claim_blocks``: the cached estimate), ``Planner.decide`` (candidates, the decider,
re-tests), ``placement.reserved_tokens``, and learns with ``Planner.prefill_observed`` /
``local_observed``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

from bench.sim.exact import ExactLookup, ExactSource
from bench.sim.scenario import Scenario, Variant
from bench.sim.state import ModelledState
from sidecar.config import Settings
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import EngineLoad
from sidecar.fleet.snapshot import EngineHealth, EngineSnapshot
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.estimates import Health
from sidecar.scheduling.placement import STALE_AFTER_SCRAPES, Planner
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.prefixes import PrefillPrefixes, PrefixHasher, blocks_within
from sidecar.scheduling.ranks import DecodeRanks

BLOCK_TOKENS = 16
"""``SIDECAR_PREFIX_BLOCK_TOKENS``' default."""
INDEX_BLOCKS = 65536
"""``SIDECAR_PREFIX_CACHE_BLOCKS``' default."""
HASH_KEY = b"simulated prefix hash key, shared"
"""``SIDECAR_PREFIX_HASH_KEY``: one secret for the pool, so the sidecars share what they placed."""


def _default(name: str) -> Any:
    return Settings.model_fields[name].default


def prefill_prefixes() -> PrefillPrefixes:
    """The prefill prefix index as production builds it with the default settings (block
    tokens, capacity when not scraped, trust, memory bound): ``Scheduler.__init__``."""
    block = _default("prefill_prefix_block_tokens")
    return PrefillPrefixes(
        block_tokens=block,
        capacity_blocks=_default("prefill_cache_tokens") // block,
        max_blocks=blocks_within(int(_default("prefix_index_memory_mib") * 2**20)),
        trust=_default("prefill_prefix_trust"),
    )


def prefill_hasher() -> PrefixHasher:
    return PrefixHasher(HASH_KEY, block_tokens=_default("prefill_prefix_block_tokens"))


def endpoint_key(index: int) -> str:
    return str(Endpoint("10.0.0.1", 8000 + index))


class Sidecar:
    def __init__(
        self,
        index: int,
        scenario: Scenario,
        variant: Variant,
        keys: list[str],
        state: ModelledState,
        seed: int,
        clock: Callable[[], float],
        phase: float | None = None,
        exact: ExactSource | None = None,
    ) -> None:
        """``phase``: when this sidecar scrapes, seconds into each interval (None: at random, as
        sidecars started at different times do). ``exact``: the prefill engines' exact indexes,
        read instead of the approximate index by an ``exact`` variant."""
        rng = random.Random(f"sidecar-{seed}-{index}")
        self.index = index
        always = variant.mode == "always"
        # An anchor variant decides in its own router (bench.sim.anchors): the planner is idle.
        name = "qoe" if variant.mode == "anchor" else variant.policy
        choices = variant.choices or scenario.choices
        policy = make_policy(name, rng, choices=choices, among=variant.among)
        options: dict[str, Any] = {"always": always}
        if scenario.ttft_ratio is not None:
            options["ttft_ratio"] = scenario.ttft_ratio
        if scenario.stall_weight is not None:
            options["stall_weight"] = scenario.stall_weight
        # SIDECAR_DISAGG_TPOT_SLO_MS as an operator sets it: the scenario's TPOT SLO.
        options["tpot_slo_s"] = scenario.tpot_slo_s
        decider = Decider(policy, **options)
        # The prefill prefix index is on by default (SIDECAR_PREFILL_PREFIX_INDEX); a blind
        # variant runs without it, as production did before it had one.
        aware = not variant.blind and variant.mode in ("conditional", "always")
        self.prefixes: PrefillPrefixes | None = prefill_prefixes() if aware else None
        self.exact: ExactLookup | None = None
        if aware and variant.exact:
            # Beside the approximate index, as in production (Scheduler: ``exact`` in sync
            # answers for an engine; the prefix hashes and their affinity stay the index's).
            if exact is None:
                raise ValueError("an exact variant needs the engines' exact indexes")
            self.exact = ExactLookup(exact)
        self.planner = Planner(
            decider,
            stale_after_s=STALE_AFTER_SCRAPES * scenario.staleness_s,
            prefixes=self.prefixes,
            **({} if scenario.retest_s is None else {"retest_s": scenario.retest_s}),
        )
        for key in keys:
            host, _, port = key.rpartition(":")
            self.planner.join(Endpoint(host, int(port)), Health())
            if self.prefixes is not None:
                # What the engine monitor's scrape of vllm:cache_config_info tells the index.
                self.prefixes.set_capacity(key, scenario.prefill_cache_tokens)
        self.state = state
        self.ranks = DecodeRanks(
            [f"http://decode-{index}"],
            block_tokens=BLOCK_TOKENS,
            capacity_blocks=INDEX_BLOCKS,
            stale_after_s=STALE_AFTER_SCRAPES * scenario.staleness_s,
            rng=random.Random(f"ranks-{seed}-{index}"),
            clock=clock,
        )
        self.rank = self.ranks[0]
        if scenario.workload != "mixed":
            # What the scrape of the decode engine's vllm:cache_config_info tells its index.
            self.rank.prefix.engine_holds(scenario.decode_cache_tokens)
        # Ready throughout: the model has no /health polls.
        self.ranks.publish(self.rank, EngineSnapshot(health=EngineHealth.UP, ready=True))
        self._staleness = scenario.staleness_s
        self._scrape = scenario.stale_mode == "scrape"
        drawn = rng.random() * scenario.staleness_s
        self._phase = drawn if phase is None else phase % scenario.staleness_s
        self.last_scrape = math.nan

    def scrape_time(self, now: float) -> float:
        """The moment the scraped gauges this sidecar holds at ``now`` describe."""
        if not self._scrape or self._staleness <= 0:
            return now - self._staleness
        scrapes = math.floor((now - self._phase) / self._staleness)
        return self._phase + scrapes * self._staleness

    def scraped(
        self,
        at: float,
        loads: dict[str, tuple[int, int]],
        local: tuple[int, int],
        inter_token: tuple[float, int] | None = None,
    ) -> None:
        """A scrape at ``at`` (monotonic, virtual): every engine's waiting and running, and the
        decode engine's inter-token latency histogram (sum, count; None: not served)."""
        self.last_scrape = at
        pool = self.planner.pool
        for key, (waiting, running) in loads.items():
            if key in pool:
                pool[key].load = EngineLoad(float(waiting), float(running), None, at)
        itl_sum, itl_count = (None, None) if inter_token is None else inter_token
        load = EngineLoad(
            float(local[0]),
            float(local[1]),
            None,
            at,
            itl_sum_s=itl_sum,
            itl_count=None if itl_count is None else float(itl_count),
        )
        self.ranks.publish(self.rank, dataclasses.replace(self.rank.engine, load=load, at=at))
