"""One simulated run: a scenario, a scheduler variant, an arrival rate; and its statistics."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from bench.sim.anchors import (
    LLMD_PRECISE_BLOCK_TOKENS,
    LlmdPrecise,
    LlmdScorer,
    SglangCacheAware,
)
from bench.sim.caches import chain
from bench.sim.engines import (
    DecodeEngine,
    Job,
    Loop,
    PrefillEngine,
    Request,
    SlotDecodeEngine,
    SlotPrefillEngine,
)
from bench.sim.exact import EventedCache, ExactPrompt, ExactSource, prompt_ids
from bench.sim.scenario import Scenario, Variant
from bench.sim.sidecars import BLOCK_TOKENS, Sidecar, endpoint_key, prefill_hasher
from bench.sim.slos import Met, slos
from bench.sim.state import PrefixShare, state_factory
from bench.sim.texts import Segment, prompt_text
from bench.sim.workload import Shape, shapes
from devkit.stats import percentile
from sidecar.kvevents.index import PromptKeys
from sidecar.scheduling.placement import reserved_tokens
from sidecar.scheduling.prefixes import PrefixGuess
from sidecar.scheduling.prompts import CHARS_PER_TOKEN, tokens_of_text

SAMPLE_S = 0.05
"""Virtual seconds between samples of the prefill queues."""
LOAD_SAMPLE_S = 0.01
"""Virtual seconds between samples of the prefill engines' loads in tokens."""
DRAIN_S = 60.0
"""After the last measured arrival, give up on unfinished measured requests (SLO missed)."""


@dataclass(frozen=True, slots=True)
class RunStats:
    scenario: str
    variant: str
    rate: float
    requests: int
    attainment: float
    """Share of measured requests meeting both the TTFT and the TPOT SLO."""
    ttft_attainment: float
    tpot_attainment: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    tpot_mean: float
    tail_tbt_mean: float
    """Mooncake's tail time between tokens (the mean of the longest 10 % of a request's
    inter-token gaps), averaged over the measured requests; its 90th percentile below."""
    tail_tbt_p90: float
    remote_share: float
    reasons: dict[str, int]
    queue_mean: float
    """Time-averaged mean over prefill engines of requests queued or running there."""
    queue_max_over_mean: float
    """Time average of the longest prefill queue / time average of the mean queue."""
    queue_ratio_busy: float
    """Average of the instantaneous max/mean ratio over samples where the mean is above 0."""
    load_max_over_mean: float
    """Prefill load = prompt tokens sent to an engine and not yet prefilled (queued or running),
    sampled every ``LOAD_SAMPLE_S``: the busiest engine's time-averaged load / the mean of the
    engines' time-averaged loads (herding on one engine for the whole run)."""
    load_ratio: float
    """The mean over the samples where the mean load is above 0 of the instant busiest load /
    the instant mean (herding at any moment)."""
    local_prefill_share: float
    """Share of decode-engine time spent on local prefills (decode batch stalled)."""
    prefill_hit_share: float
    """Share of the prompt tokens sent to prefill engines that their prefix caches held."""
    prefix_wrong_share: float
    """Share of the prefills sent with a prediction whose predicted cached tokens were off the
    engine's by more than 10 % of the prompt."""
    prefix_over_share: float
    """Share of them predicted to hold more than it did by that much (a hit it could not give)."""
    unfinished: int
    """Measured requests that never finished: they count in the percentiles (as infinite) and
    the SLO shares (as missing), not in the means."""
    wall_s: float
    sim_s: float
    by_kind: dict[str, float] = field(default_factory=dict)
    """SLO attainment per request kind."""
    slos: dict[str, Met] = field(default_factory=dict)
    """Per SLO set (``bench.sim.slos``): the shares meeting both bounds, TTFT's, the decode
    one's. ``scaled`` is ``attainment`` / ``ttft_attainment`` / ``tpot_attainment``."""

    @property
    def unfinished_share(self) -> float:
        return self.unfinished / self.requests if self.requests else 0.0


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        variant: Variant,
        rate: float,
        *,
        measured: int,
        warmup: int,
        seed: int,
        trace: Iterable[Shape] | None = None,
        scrape_phases: Sequence[float] | None = None,
    ) -> None:
        """``trace``: the requests to send (gaps in seconds at ``rate`` 1) instead of the
        scenario's seeded stream; it must hold at least ``warmup + measured`` of them.
        ``scrape_phases``: when each sidecar scrapes (seconds after time 0, modulo the
        interval), e.g. as measured on real sidecars; None: at random."""
        self.scenario = scenario
        self.variant = variant
        self.loop = Loop()
        self._rate = rate
        self._warmup = warmup
        self._total = warmup + measured
        self._shapes = iter(trace) if trace is not None else shapes(scenario, seed)
        self._gateway_rng = random.Random(f"gateway-{seed}")
        self._exact = scenario.tokens == "exact"
        keys = [endpoint_key(i) for i in range(scenario.prefill_engines)]
        slots = scenario.engine_model == "slots"
        prefill_kind = SlotPrefillEngine if slots else PrefillEngine
        decode_kind = SlotDecodeEngine if slots else DecodeEngine
        self._transfer = None if slots else scenario.transfer  # slots: the decode engine pulls
        self.prefill: dict[str, PrefillEngine | SlotPrefillEngine] = {
            key: prefill_kind(self.loop, key, scenario, speed, self._prefilled)
            for key, speed in zip(keys, scenario.speeds(), strict=True)
        }
        self.exact: ExactSource | None = None
        if variant.exact:
            # llm-d's index ignores AllBlocksCleared (bench.sim.anchors.LlmdPrecise).
            clears = variant.policy != "llm-d_precise"
            self.exact = ExactSource(self.loop, scenario.kv_event_lag_s, clears=clears)
            for key, engine in self.prefill.items():
                assert isinstance(engine.cache, EventedCache)
                self.exact.subscribe(key, engine.cache)
        for number, key in enumerate(keys):
            self._disturb(number, key, seed)
        self.decode: list[DecodeEngine | SlotDecodeEngine] = [
            decode_kind(self.loop, i, scenario, self._first_token, self._finished)
            for i in range(scenario.decode_engines)
        ]
        coalesced = variant.sync_s > 0
        backend = state_factory(
            "coalesced" if coalesced else scenario.state,
            self.loop,
            sync_s=variant.sync_s if coalesced else scenario.sync_s,
            eager=variant.eager,
            seed=seed,
            rtt_s=scenario.redis_rtt_s,
            timeout_s=scenario.state_timeout_s,
            lease_s=scenario.lease_s,
            refresh_s=scenario.redis_refresh_s,
        )
        clock = self._clock
        self.sidecars = [
            Sidecar(
                i,
                scenario,
                variant,
                keys if variant.mode != "never" else [],
                backend(i),
                seed,
                clock,
                None if scrape_phases is None else scrape_phases[i],
                self.exact,
            )
            for i in range(scenario.decode_engines)
        ]
        self._hasher = prefill_hasher()
        self._share = PrefixShare(self.loop, scenario, self.sidecars, seed)
        self._sglang: SglangCacheAware | None = None
        self._sglang_decode: SglangCacheAware | None = None
        self._llmd: LlmdScorer | None = None
        self._precise: LlmdPrecise | None = None
        self._sent_tokens = dict.fromkeys(keys, 0)
        """Per prefill engine: the prompt tokens sent to it and not yet prefilled."""
        self._decode_pods = [f"decode-{i}" for i in range(scenario.decode_engines)]
        if variant.policy == "sglang_cache_aware":
            self._sglang = SglangCacheAware(keys)
            self._sglang_decode = SglangCacheAware(self._decode_pods)
        elif variant.policy in ("llm-d_pd_scorer", "llm-d_precise"):
            # The decode profile and the decider (llm-d_precise: the prefill profile's too).
            self._llmd = LlmdScorer(
                keys,
                scenario.prefill_cache_tokens // scenario.block_size,
                random.Random(f"llm-d-{seed}"),
                self._pod_waiting,
            )
            if variant.policy == "llm-d_precise":
                self._precise = LlmdPrecise(
                    keys, random.Random(f"llm-d-precise-{seed}"), self._pod_waiting, self._kv_usage
                )
        self._remote_tokens = 0
        self._remote_cached = 0
        self._predicted = 0
        self._wrong = 0
        self._over = 0
        self._foreign = 0
        self._in_flight: dict[int, Sequence[int]] = {}
        """``Scenario.kv_in_flight``: a remote request's chained segment keys, until its
        prefill's events arrive."""
        self.requests: list[Request] = []
        self._arrived = 0
        self._done = 0
        self._measuring = False
        self._samples = 0
        self._sum_max = 0.0
        self._sum_mean = 0.0
        self._sum_ratio = 0.0
        self._busy_samples = 0
        self._load_sums = dict.fromkeys(keys, 0)
        self._load_ratio_sum = 0.0
        self._load_busy_samples = 0

    def _clock(self) -> float:
        return self.loop.now

    def _pod_waiting(self, pod: str, at: float) -> float:
        """A pod's waiting gauge as it was at ``at`` (what llm-d's queue scorer scrapes)."""
        if pod.startswith("decode-"):
            return float(self.decode[int(pod.removeprefix("decode-"))].gauge.at(at)[0])
        return float(self.prefill[pod].gauge.at(at)[0])

    def _kv_usage(self, pod: str) -> float:
        """A prefill engine's KV cache usage when the decision is made: the prompts sent to it
        and not yet prefilled over its cache (vLLM counts cached blocks no request uses as free;
        the waiting prompts are counted too, so this is an upper bound)."""
        return self._sent_tokens[pod] / self.scenario.prefill_cache_tokens

    # What the approximate index cannot see: restarts, other traffic.

    def _disturb(self, number: int, key: str, seed: int) -> None:
        scenario = self.scenario
        cache = self.prefill[key].cache
        if not isinstance(cache, EventedCache):
            return
        # Each disturbance's closure has names of its own: a closure reads its variables when
        # it runs, so a name both shared would make the restarts follow the foreign traffic's
        # draws and mean gap (4 s instead of minutes).
        if scenario.prefill_restart_s > 0:
            restarts = random.Random(f"restarts-{seed}-{number}")
            between = scenario.prefill_restart_s

            def restart(_: object) -> None:
                cache.clear()
                self.loop.at(self.loop.now + restarts.expovariate(1.0 / between), restart)

            self.loop.at(restarts.expovariate(1.0 / between), restart)
        if scenario.foreign_tokens_per_s > 0:
            rng = random.Random(f"foreign-{seed}-{number}")
            tokens = scenario.foreign_prompt_tokens
            mean = tokens / scenario.foreign_tokens_per_s

            def foreign(_: object) -> None:
                self._foreign += 1
                # A unique prompt (keys below every workload's), in Mooncake-sized segments.
                base = -(self._foreign << 8) - (number << 4) - (1 << 40)
                segments = tuple(
                    Segment(base - i, min(512, tokens - start), min(512, tokens - start) * 4)
                    for i, start in enumerate(range(0, tokens, 512))
                )
                cache.store(segments)
                self.loop.at(self.loop.now + rng.expovariate(1.0 / mean), foreign)

            self.loop.at(rng.expovariate(1.0 / mean), foreign)

    def run(self) -> RunStats:
        started = time.perf_counter()
        self._schedule_arrival()
        self.loop.run()
        return self._stats(time.perf_counter() - started)

    # Arrivals and the scheduling decision.

    def _schedule_arrival(self) -> None:
        shape = next(self._shapes, None)
        if shape is not None:
            self.loop.at(self.loop.now + shape.gap / self._rate, self._arrive, shape)

    def _arrive(self, shape: Shape) -> None:
        loop = self.loop
        now = loop.now
        index = self._arrived
        self._arrived += 1
        measured = self._warmup <= index < self._total
        request = Request(index, shape, now, measured)
        if measured:
            self.requests.append(request)
            if index == self._warmup:
                self._measuring = True
                loop.at(now, self._sample)
                loop.at(now, self._sample_load)
            if index == self._total - 1:
                self._measuring = False
                loop.at(now + DRAIN_S, self._give_up)
        self._schedule_arrival()

        anchor = self.variant.mode == "anchor"
        segments = shape.segments or (Segment(-1 - index, shape.prompt_tokens, shape.prompt_chars),)
        llmd_hashes = self._llmd.hashes(prompt_text(segments)) if self._llmd else []
        if shape.home is not None:
            engine = shape.home
        elif anchor:
            engine = self._anchor_decode(segments, shape.prompt_chars, llmd_hashes)
        else:
            engine = self._gateway()
        request.engine = engine
        self.decode[engine].outstanding += 1
        sidecar = self.sidecars[engine]
        tokens, blocks = self._estimate(sidecar, shape)
        claim, cached = sidecar.ranks.claim_blocks(blocks, tokens)
        request.claim = claim
        if anchor:
            self._route(request, segments, llmd_hashes, tokens)
            return
        sidecar.state.refresh(lambda: self._place(request, sidecar, tokens, cached))

    def _place(self, request: Request, sidecar: Sidecar, tokens: int, cached: int) -> None:
        """The decision, once the state backend's view is fresh (``refresh``)."""
        now, shape = self.loop.now, request.shape
        engine = request.engine
        seen = sidecar.scrape_time(now)
        if seen != sidecar.last_scrape:
            sidecar.scraped(
                seen,
                {key: prefill.gauge.at(seen) for key, prefill in self.prefill.items()},
                self.decode[engine].gauge.at(seen),
                self.decode[engine].inter_token(seen),
            )
        claim = request.claim
        assert claim is not None
        planner = sidecar.planner
        # The prompt's prefix blocks, hashed once from its text (production's PrefixHasher);
        # a prompt of unique text (no segments) matches nothing, so it is not hashed.
        hashes: tuple[bytes, ...] = ()
        if sidecar.prefixes is not None and shape.segments:
            hashes = self._hasher.hashes(prompt_text(shape.segments))
        exact = sidecar.exact if shape.segments else None
        if exact is not None:
            # The engines' exact indexes, on the prompt's token ids (production asks the decode
            # engine's /tokenize), answer for every engine; the hashes still give the prompt's
            # affinity anchor and what the approximate index learns, as in production.
            prompt = ExactPrompt(
                PromptKeys(prompt_ids(shape.segments)), tokens / shape.prompt_tokens
            )
            if self.scenario.kv_in_flight:
                prompt.chained = chain(shape.segments)
                prompt.tokens = [segment.tokens for segment in shape.segments]
            exact.begin(prompt)
        decision = planner.decide(
            sidecar.rank,
            sidecar.ranks.waiting(sidecar.rank),
            prompt_tokens=tokens,
            cached_tokens=cached,
            view=sidecar.state.view(),
            now=now,
            wall=now,
            hashes=hashes,
            exact=exact,
        )
        request.reason = decision.reason
        if decision.endpoint is None:
            self._local(request, decision.uncached_tokens)
            return
        key = decision.endpoint
        reserve = reserved_tokens(decision) if self.scenario.reserve == "production" else tokens
        request.reservation = sidecar.state.reserve(key, reserve)
        prefixes = sidecar.prefixes
        if prefixes is not None and hashes:
            # Scheduler._reserve: the guess to compare with the answer, the endpoint holds the
            # prompt next, and the other sidecars learn it through the prefix share.
            matched = prefixes.matched_blocks(key, hashes)
            request.guess = PrefixGuess(hashes, request.shape.prompt_chars, matched)
            width = prefixes.block_tokens * CHARS_PER_TOKEN
            held = min(1.0, matched * width / shape.prompt_chars) if shape.prompt_chars else 0.0
            request.predicted_cached = round(held * shape.prompt_tokens)
            if exact is not None:
                # The decision's figure: what the engine's exact index holds.
                request.predicted_cached = round((exact(key) or 0) * shape.prompt_tokens / tokens)
            prefixes.placed(key, hashes)
            self._share.publish(sidecar.index, key, hashes)
        if exact is not None and exact.prompt is not None and exact.prompt.chained:
            assert self.exact is not None
            self.exact.placed(key, exact.prompt.chained)
            self._in_flight[request.id] = exact.prompt.chained
        self._remote(request, key)

    def _local(self, request: Request, uncached_estimate: int) -> None:
        """Prefill on the request's decode engine, which computes what its own cache lacks
        (true tokens): the history of a multi-turn continuation, nothing else."""
        shape = request.shape
        request.claim.prefilling(uncached_estimate)
        request.local_tokens = uncached_estimate
        held = shape.cached_tokens
        if shape.segments:
            # A prompt with prefix structure: what the engine's own prefix cache holds of it.
            cache = self.decode[request.engine].cache
            held = max(held, cache.cached_tokens(shape.segments, shape.prompt_tokens))
            cache.store(shape.segments)
        true_tokens = max(1, shape.prompt_tokens - held)
        request.prefill_tokens = true_tokens
        self.decode[request.engine].submit_local(
            Job(request, true_tokens, offset=shape.prompt_tokens - true_tokens)
        )

    def _remote(self, request: Request, key: str) -> None:
        """Send the whole prompt to prefill engine ``key`` (it holds none of the decode engine's
        cache, and computes what its own prefix cache lacks)."""
        shape = request.shape
        request.endpoint = key
        request.prefill_tokens = shape.prompt_tokens
        request.sent = self.loop.now
        self._sent_tokens[key] += shape.prompt_tokens
        self.prefill[key].submit(Job(request, shape.prompt_tokens))

    def _anchor_decode(self, segments: Sequence[Segment], chars: int, hashes: list[int]) -> int:
        """The anchor's own decode pick: SGLang's ``cache_aware`` on the decode workers, llm-d's
        decode profile (prefix × 2 + queue × 1 over the decode pods)."""
        now = self.loop.now
        if self._sglang_decode is not None:
            pod = self._sglang_decode.choose(segments, chars, now)
        else:
            assert self._llmd is not None
            pod = self._llmd.choose(hashes, now, self._decode_pods)
        return int(pod.removeprefix("decode-"))

    def _route(
        self, request: Request, segments: Sequence[Segment], hashes: list[int], tokens: int
    ) -> None:
        """An anchor's central router decides (bench.sim.anchors), on the request's text."""
        shape = request.shape
        if self._sglang is not None:
            # SGLang's PD mode disaggregates every request.
            request.reason = "scheduled"
            self._remote(request, self._sglang.choose(segments, shape.prompt_chars, self.loop.now))
            return
        assert self._llmd is not None
        llmd = self._llmd
        decode_pod = f"decode-{request.engine}"
        if llmd.disaggregates(decode_pod, hashes, shape.prompt_chars):
            if self._precise is not None:
                key = self._precise_pick(shape)
            else:
                key = llmd.choose(hashes, self.loop.now)
                llmd.record(key, hashes)
            request.reason = "scheduled"
            self._remote(request, key)
        else:
            request.reason = "prefix_cached"
            self._local(request, tokens)
        llmd.record(decode_pod, hashes)

    def _precise_pick(self, shape: Shape) -> str:
        """llm-d_precise's prefill profile, on the prompt's token ids and the engines' indexes
        as their KV events have reached them."""
        assert self._precise is not None
        assert self.exact is not None
        leading: dict[str, int] = {}
        if shape.segments:
            keys = PromptKeys(prompt_ids(shape.segments))
            for key in self._precise.keys:
                leading[key] = self.exact.leading_blocks(key, keys, LLMD_PRECISE_BLOCK_TOKENS)
        total = shape.prompt_tokens // LLMD_PRECISE_BLOCK_TOKENS
        return self._precise.choose(leading, total, self.loop.now)

    def _estimate(self, sidecar: Sidecar, shape: Shape) -> tuple[int, Sequence[Hashable]]:
        """What the sidecar knows of a prompt: its token estimate, and its block hashes — of
        its text for a prompt with segments; else stand-ins (the previous turn's blocks,
        inserted into the home rank's index as they were when it was sent, then this
        prompt's). Chat and RAG prompts are unique and share no block with any other, so their
        blocks are left out (docs/scheduling.md)."""
        if self._exact:
            tokens = shape.prompt_tokens
            indexed, total = shape.cached_tokens // BLOCK_TOKENS, tokens // BLOCK_TOKENS
        else:
            tokens = tokens_of_text(shape.prompt_chars)
            width = BLOCK_TOKENS * CHARS_PER_TOKEN
            indexed, total = shape.indexed_chars // width, shape.prompt_chars // width
        if shape.segments:
            # Prefix structure: production's local index on the prompt's own text.
            return tokens, sidecar.rank.prefix.hashes(prompt_text(shape.segments))
        if shape.conversation < 0:
            return tokens, []
        conversation = shape.conversation
        history = [b"%d/%d" % (conversation, i) for i in range(indexed)]
        sidecar.rank.prefix.insert(history)
        return tokens, history + [b"%d+%d" % (conversation, i) for i in range(indexed, total)]

    def _gateway(self) -> int:
        """The decode engine with the fewest requests in flight, ties at random."""
        loads = [engine.outstanding for engine in self.decode]
        least = min(loads)
        return self._gateway_rng.choice([i for i, load in enumerate(loads) if load == least])

    def _prefilled(self, request: Request) -> None:
        loop = self.loop
        assert request.endpoint is not None
        sidecar = self.sidecars[request.engine]
        shape = request.shape
        self._sent_tokens[request.endpoint] -= shape.prompt_tokens
        chained = self._in_flight.pop(request.id, None)
        if chained is not None:
            assert self.exact is not None
            # The engine stores the prompt now; its events reach the indexes a lag later.
            loop.at(loop.now + self.exact.lag_s, self._events_arrived, (request.endpoint, chained))
        if shape.segments and request.measured:
            self._remote_tokens += shape.prompt_tokens
            self._remote_cached += request.engine_cached
            if request.predicted_cached >= 0:
                self._predicted += 1
                error = request.predicted_cached - request.engine_cached
                if abs(error) > 0.1 * shape.prompt_tokens:
                    self._wrong += 1
                    self._over += error > 0
        reservation = request.reservation
        if reservation is not None:
            sidecar.state.release(reservation)
            speed = sidecar.planner.prefill_observed(reservation, loop.now - request.sent, loop.now)
            if speed is not None:
                sidecar.state.publish_speed(request.endpoint, speed)
        if request.guess is not None and sidecar.prefixes is not None:
            # The prefill answer's usage: prompt_tokens and prompt_tokens_details.cached_tokens.
            sidecar.prefixes.answered(
                request.endpoint, request.guess, shape.prompt_tokens, request.engine_cached
            )
        decode = self.decode[request.engine]
        if shape.segments:
            decode.cache.store(shape.segments)  # it holds the KV it pulls
        if self._transfer is None:
            decode.arrive_remote(request)
        else:
            transfer = self._transfer.seconds(request.prefill_tokens)
            assert isinstance(decode, DecodeEngine)  # slots: no transfer, the engine pulls
            decode.pull()
            loop.at(loop.now + transfer, decode.pulled, request)

    def _events_arrived(self, placed: tuple[str, Sequence[int]]) -> None:
        assert self.exact is not None
        self.exact.arrived(*placed)

    def _first_token(self, request: Request) -> None:
        if request.endpoint is None and request.local_tokens:
            sidecar = self.sidecars[request.engine]
            request.claim.prefilled()
            sidecar.planner.local_observed(
                sidecar.rank.ahead_tokens, request.local_tokens, self.loop.now - request.arrival
            )

    def _finished(self, request: Request) -> None:
        self.decode[request.engine].outstanding -= 1
        if self._sglang is not None and request.endpoint is not None:
            self._sglang.finished(request.endpoint)
        if self._sglang_decode is not None and request.shape.home is None:
            self._sglang_decode.finished(f"decode-{request.engine}")
        request.claim.end()
        if request.measured:
            self._done += 1
            if self._done == self._total - self._warmup:
                self.loop.stopped = True

    def _give_up(self, _: object) -> None:
        self.loop.stopped = True

    def _sample(self, _: object) -> None:
        queues = [engine.outstanding for engine in self.prefill.values()]
        mean = sum(queues) / len(queues)
        self._samples += 1
        self._sum_max += max(queues)
        self._sum_mean += mean
        if mean > 0:
            self._busy_samples += 1
            self._sum_ratio += max(queues) / mean
        if self._measuring:
            self.loop.at(self.loop.now + SAMPLE_S, self._sample)

    def _sample_load(self, _: object) -> None:
        loads = self._sent_tokens
        sums = self._load_sums
        total = busiest = 0
        for key, load in loads.items():
            sums[key] += load
            total += load
            busiest = max(busiest, load)
        if total > 0:
            self._load_busy_samples += 1
            self._load_ratio_sum += busiest * len(loads) / total
        if self._measuring:
            self.loop.at(self.loop.now + LOAD_SAMPLE_S, self._sample_load)

    # Statistics.

    def _stats(self, wall_s: float) -> RunStats:
        scenario = self.scenario
        met_ttft = met_tpot = met = 0
        ttfts: list[float] = []
        tpots: list[float] = []
        tails: list[float] = []
        judged = slos(scenario)
        counts = {slo.name: [0, 0, 0] for slo in judged}
        kinds: Counter[str] = Counter()
        kinds_met: Counter[str] = Counter()
        unfinished = 0
        for request in self.requests:
            shape = request.shape
            ttft = request.first_token - request.arrival
            if math.isnan(request.finish):
                unfinished += 1
                ttft = math.inf if math.isnan(ttft) else ttft
                tpot = tail = math.inf
            else:
                tpot = (request.finish - request.first_token) / max(1, shape.output_tokens - 1)
                tail = request.tail_tbt
            ttfts.append(ttft)
            tpots.append(tpot)
            tails.append(tail)
            for slo in judged:
                count = counts[slo.name]
                ttft_ok = slo.ttft_met(scenario, shape.prompt_tokens, ttft)
                decode_ok = slo.decode_met(tpot, tail)
                count[0] += ttft_ok and decode_ok
                count[1] += ttft_ok
                count[2] += decode_ok
            ok_ttft = ttft <= scenario.ttft_slo(shape.prompt_tokens)
            ok_tpot = tpot <= scenario.tpot_slo_s
            met_ttft += ok_ttft
            met_tpot += ok_tpot
            met += ok_ttft and ok_tpot
            kinds[shape.kind] += 1
            kinds_met[shape.kind] += ok_ttft and ok_tpot
        n = len(self.requests)
        samples = max(1, self._samples)
        busy_decode = sum(engine.prefill_s for engine in self.decode)
        load_total = sum(self._load_sums.values())
        return RunStats(
            scenario=scenario.name,
            variant=self.variant.label,
            rate=self._rate,
            requests=n,
            attainment=met / n,
            ttft_attainment=met_ttft / n,
            tpot_attainment=met_tpot / n,
            ttft_mean=_finite_mean(ttfts),
            ttft_p50=percentile(ttfts, 50),
            ttft_p90=percentile(ttfts, 90),
            ttft_p99=percentile(ttfts, 99),
            tpot_p50=percentile(tpots, 50),
            tpot_p99=percentile(tpots, 99),
            tpot_mean=_finite_mean(tpots),
            tail_tbt_mean=_finite_mean(tails),
            tail_tbt_p90=percentile(tails, 90),
            remote_share=sum(r.endpoint is not None for r in self.requests) / n,
            reasons=dict(Counter(r.reason for r in self.requests)),
            queue_mean=self._sum_mean / samples,
            queue_max_over_mean=self._sum_max / self._sum_mean if self._sum_mean else math.nan,
            queue_ratio_busy=(
                self._sum_ratio / self._busy_samples if self._busy_samples else math.nan
            ),
            load_max_over_mean=(
                max(self._load_sums.values()) * len(self._load_sums) / load_total
                if load_total
                else math.nan
            ),
            load_ratio=(
                self._load_ratio_sum / self._load_busy_samples
                if self._load_busy_samples
                else math.nan
            ),
            local_prefill_share=busy_decode / (len(self.decode) * self.loop.now),
            prefill_hit_share=self._remote_cached / self._remote_tokens
            if self._remote_tokens
            else 0.0,
            prefix_wrong_share=self._wrong / self._predicted if self._predicted else 0.0,
            prefix_over_share=self._over / self._predicted if self._predicted else 0.0,
            unfinished=unfinished,
            wall_s=wall_s,
            sim_s=self.loop.now,
            by_kind={kind: kinds_met[kind] / count for kind, count in kinds.items()},
            slos={name: Met(*(c / n for c in count)) for name, count in counts.items()},
        )


def _finite_mean(values: list[float]) -> float:
    """The mean over the requests that got there (NaN when none did)."""
    finite = [value for value in values if not math.isinf(value)]
    return sum(finite) / len(finite) if finite else math.nan


def simulate(
    scenario: Scenario,
    variant: Variant,
    rate: float,
    *,
    measured: int,
    warmup: int,
    seed: int,
    trace: Iterable[Shape] | None = None,
    scrape_phases: Sequence[float] | None = None,
) -> RunStats:
    return Simulation(
        scenario,
        variant,
        rate,
        measured=measured,
        warmup=warmup,
        seed=seed,
        trace=trace,
        scrape_phases=scrape_phases,
    ).run()
