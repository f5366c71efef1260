"""Modelled engines in virtual time: an event loop, prefill engines and decode engines.

Prefill time is ``a·n + b·((c + n)² − c²)`` for ``n`` tokens computed after ``c`` already there
(the emulator's latency model, ``sidecar.emulator.engine.prefill_seconds``): the weights cost
every token the same, attention costs more the further into the prompt.

Two engine models. ``batched`` (the scenarios): prefill works in iterations, first come first
served, up to the batch budget of prompt tokens per iteration (longer prompts are chunked over
several), an iteration costing the sum of its chunks; so a prefill's time grows with its tokens
and with the batch it shares. A decode engine gives local prefills priority: while one runs,
its decode batch stalls. Otherwise it runs decode steps, one token for every running request per
step, a step taking longer the larger the batch. It runs at most ``decode_max_batch`` requests
(local prefills included); the others queue, first come first served, for a free seat.
``slots`` (the calibration against real emulators): exactly what ``sidecar.emulator`` does —
``max_num_seqs`` slots taken first come first served, and every admitted request sleeps on its
own: its prefill (or KV transfer), then one decode delay per output token after the first, each
delay × (1 + slowdown × (running − 1)) with ``running`` read when the delay starts.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim.caches import PrefixCache
from bench.sim.exact import EventedCache
from bench.sim.scenario import Scenario
from bench.sim.workload import Shape
from sidecar.emulator.engine import prefill_seconds


class Loop:
    """A heap of (time, sequence, callback, argument)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stopped = False
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0

    def at(self, when: float, callback: Callable[[Any], None], argument: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, callback, argument))

    def run(self) -> None:
        heap = self._heap
        while heap and not self.stopped:
            when, _, callback, argument = heapq.heappop(heap)
            self.now = when
            callback(argument)


@dataclass(slots=True, eq=False)
class Request:
    id: int
    shape: Shape
    arrival: float
    measured: bool
    engine: int = -1
    endpoint: str | None = None
    reason: str = ""
    prefill_tokens: int = 0
    """True tokens the chosen engine prefills: the uncached ones locally, the whole prompt
    remotely."""
    first_token: float = math.nan
    finish: float = math.nan
    sent: float = math.nan
    """When the prefill call left the sidecar (after ``reserve``)."""
    local_tokens: int = 0
    """A local prefill's uncached tokens as the sidecar estimated them."""
    claim: Any = None
    """The decode rank's ``RankClaim``."""
    reservation: Any = None
    engine_cached: int = 0
    """True tokens the prefill engine found in its prefix cache (what vLLM's answer reports as
    ``usage.prompt_tokens_details.cached_tokens``)."""
    guess: Any = None
    """The sidecar's ``PrefixGuess`` for the endpoint it chose (its feedback)."""
    predicted_cached: int = -1
    """True tokens the sidecar predicted the chosen prefill engine holds (-1: no prediction)."""
    joined: int = -1
    """The decode step after which it joined the batch (its tokens come from the next ones)."""
    tail_tbt: float = math.nan
    """Mooncake's tail time between tokens: the mean of the longest 10 % of its inter-token
    gaps (``tail_gap``); 0 for a one-token answer."""


TAIL_SHARE = 0.10
"""Mooncake (FAST'25, kvcache-ai/Mooncake ``FAST25-release/Mooncake-FAST25.pdf``, §5.1 Metric):
"the TBT is calculated as the average of the longest 10% of the token arrival intervals"."""


def tail_gap(times: Sequence[float]) -> float:
    """The mean of the longest ``TAIL_SHARE`` of the gaps between consecutive token times (at
    least one gap; 0 when there is none)."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    if not gaps:
        return 0.0
    longest = heapq.nlargest(max(1, math.ceil(TAIL_SHARE * len(gaps))), gaps)
    return sum(longest) / len(longest)


@dataclass(slots=True, eq=False)
class Job:
    request: Request
    remaining: int
    """Tokens still to compute."""
    offset: int = 0
    """Tokens before the next chunk (cached ones, then those computed): its attention span."""
    started: bool = False


class Gauge:
    """The history of an engine's (waiting, running) gauges, for stale reads."""

    def __init__(self) -> None:
        self._times: list[float] = [-math.inf]
        self._values: list[tuple[int, int]] = [(0, 0)]

    def record(self, now: float, waiting: int, running: int) -> None:
        value = (waiting, running)
        if self._values[-1] == value:
            return
        if self._times[-1] == now:
            self._values[-1] = value
        else:
            self._times.append(now)
            self._values.append(value)

    def at(self, when: float) -> tuple[int, int]:
        return self._values[bisect_right(self._times, when) - 1]


@dataclass(slots=True, eq=False)
class _PrefillQueue:
    """FCFS prompt tokens with chunking, shared by both engine kinds."""

    budget: int
    tokens_per_s: float
    crossover_tokens: int
    cache: PrefixCache | None = None
    """A prefill engine's prefix cache: looked up when a prompt is first scheduled (its cached
    tokens are not computed, but their attention is paid), filled when it is done."""
    jobs: deque[Job] = field(default_factory=deque)
    waiting: int = 0
    running: int = 0

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.waiting += 1

    def take(self) -> tuple[list[tuple[Job, int]], float]:
        """The next iteration's chunks and its duration."""
        left = self.budget
        taken: list[tuple[Job, int]] = []
        seconds = 0.0
        a = 1.0 / self.tokens_per_s
        for job in self.jobs:
            if left <= 0:
                break
            if not job.started and self.cache is not None:
                _found(self.cache, job)
            tokens = min(job.remaining, left)
            taken.append((job, tokens))
            seconds += prefill_seconds(a, self.crossover_tokens, tokens, job.offset)
            left -= tokens
            if not job.started:
                job.started = True
                self.waiting -= 1
                self.running += 1
        return taken, seconds

    def complete(self, taken: list[tuple[Job, int]]) -> list[Job]:
        for job, tokens in taken:
            job.remaining -= tokens
            job.offset += tokens
        done: list[Job] = []
        jobs = self.jobs
        while jobs and jobs[0].remaining <= 0:  # chunks are taken in order: the done ones lead
            done.append(jobs.popleft())
        self.running -= len(done)
        if self.cache is not None:
            for job in done:
                if job.request.shape.segments:
                    self.cache.store(job.request.shape.segments)
        return done


def _found(cache: PrefixCache, job: Job) -> None:
    """A prompt is first scheduled: what the engine's prefix cache holds of it is not computed."""
    shape = job.request.shape
    if not shape.segments:
        return
    cached = cache.cached_tokens(shape.segments, shape.prompt_tokens)
    job.request.engine_cached = cached
    job.remaining -= cached
    job.offset += cached


class PrefillEngine:
    def __init__(
        self,
        loop: Loop,
        key: str,
        scenario: Scenario,
        tokens_per_s: float,
        on_done: Callable[[Request], None],
    ) -> None:
        self.key = key
        self.gauge = Gauge()
        self._loop = loop
        self.cache = EventedCache(scenario.prefill_cache_tokens, scenario.block_size)
        self._queue = _PrefillQueue(
            scenario.prefill_budget_tokens, tokens_per_s, scenario.crossover_tokens, self.cache
        )
        self._on_done = on_done
        self._busy = False

    @property
    def outstanding(self) -> int:
        return self._queue.waiting + self._queue.running

    def submit(self, job: Job) -> None:
        self._queue.add(job)
        if not self._busy:
            self._start()
        self._record()

    def _start(self) -> None:
        taken, seconds = self._queue.take()
        self._busy = True
        self._loop.at(self._loop.now + seconds, self._finish, taken)

    def _finish(self, taken: list[tuple[Job, int]]) -> None:
        self._busy = False
        for job in self._queue.complete(taken):
            self._on_done(job.request)
        if self._queue.jobs:
            self._start()
        self._record()

    def _record(self) -> None:
        self.gauge.record(self._loop.now, self._queue.waiting, self._queue.running)


class DecodeEngine:
    """Local prefills first (the decode batch stalls meanwhile), else one decode step; at most
    ``decode_max_batch`` requests seated (prefilling, joining or decoding), the rest queued."""

    def __init__(
        self,
        loop: Loop,
        index: int,
        scenario: Scenario,
        on_first_token: Callable[[Request], None],
        on_finish: Callable[[Request], None],
    ) -> None:
        self.index = index
        self.gauge = Gauge()
        self.outstanding = 0
        """Requests the gateway sent here that have not finished (its routing signal)."""
        self.prefill_s = 0.0
        """Virtual seconds spent on local prefills (decode stalled)."""
        self.cache = PrefixCache(scenario.decode_cache_tokens, scenario.block_size)
        """What it holds of prompts with segments (``Scenario.decode_cache_tokens``)."""
        self._loop = loop
        self._scenario = scenario
        self._local = _PrefillQueue(
            scenario.prefill_budget_tokens, scenario.prefill_tokens_per_s, scenario.crossover_tokens
        )
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._busy = False
        self._step = 0
        self._ends: list[float] = [0.0]
        """When each decode step ended (index: the step's number), for the inter-token gaps."""
        self._batch = 0
        self._finishing: list[tuple[int, int, Request]] = []
        self._joining: list[tuple[Request, bool]] = []
        self._first_pending: list[Request] = []
        self._seats = scenario.decode_max_batch
        self._seated = 0
        self._queue: deque[tuple[Request, Job | None]] = deque()
        """Requests waiting for a seat: a local prefill's job, or None for a remote one."""
        self._pulling = 0
        """Requests pulling their KV from a prefill server (``pull`` to ``arrive_remote``)."""
        self._itl: list[tuple[float, float, int]] = [(-math.inf, 0.0, 0)]
        """After each decode step: its end, and vLLM's inter-token latency histogram's sum and
        count so far (each token of the step observes the time since its request's previous
        one: the step and any prefill that stalled the batch before it)."""

    def inter_token(self, when: float) -> tuple[float, int] | None:
        """The inter-token latency histogram's sum (seconds) and count as a scrape at ``when``
        reads it."""
        at = bisect_right(self._itl, (when, math.inf, 0)) - 1
        return self._itl[at][1], self._itl[at][2]

    def submit_local(self, job: Job) -> None:
        self._admit(job.request, job)

    def pull(self) -> None:
        """A remote prefill answered: its request pulls the KV (``pulled`` when it is here).
        vLLM counts it as waiting meanwhile (``WAITING_FOR_REMOTE_KVS``)."""
        self._pulling += 1
        self._record()

    def pulled(self, request: Request) -> None:
        """The KV a ``pull`` began arrived."""
        self._pulling -= 1
        self.arrive_remote(request)

    def arrive_remote(self, request: Request) -> None:
        """The KV cache arrived: the request joins the batch at the next step boundary (once it
        has a seat)."""
        self._admit(request, None)

    def _admit(self, request: Request, job: Job | None) -> None:
        if self._seats and self._seated >= self._seats:
            self._queue.append((request, job))
            self._record()
            return
        self._seat(request, job)
        self._kick()
        self._record()

    def _seat(self, request: Request, job: Job | None) -> None:
        self._seated += 1
        if job is None:
            self._joining.append((request, True))
        else:
            self._local.add(job)

    def _leave(self) -> None:
        """A request finished: its seat goes to the first one waiting."""
        self._seated -= 1
        if self._queue:
            self._seat(*self._queue.popleft())

    def _kick(self) -> None:
        if not self._busy:
            self._start()

    def _start(self) -> None:
        loop = self._loop
        if self._local.jobs:
            taken, seconds = self._local.take()
            self._busy = True
            self.prefill_s += seconds
            loop.at(loop.now + seconds, self._end_prefill, taken)
            return
        if self._joining:
            for request, remote in self._joining:
                # A remote prefill's first token comes from this engine's first step; a local
                # prefill produced it already.
                tokens = request.shape.output_tokens - (0 if remote else 1)
                request.joined = self._step
                heapq.heappush(self._finishing, (self._step + tokens, request.id, request))
                self._batch += 1
                if remote:
                    self._first_pending.append(request)
            self._joining.clear()
            self._record()
        if self._batch:
            self._busy = True
            loop.at(loop.now + self._scenario.decode_step_s(self._batch), self._end_step)
        else:
            self._busy = False

    def _end_prefill(self, taken: list[tuple[Job, int]]) -> None:
        now = self._loop.now
        for job in self._local.complete(taken):
            request = job.request
            request.first_token = now
            self._on_first_token(request)
            if request.shape.output_tokens > 1:
                self._joining.append((request, False))
            else:
                request.finish = now
                request.tail_tbt = 0.0
                self._leave()
                self._on_finish(request)
        self._start()
        self._record()

    def _end_step(self, _: object) -> None:
        now = self._loop.now
        self._step += 1
        # Every request of the batch had a token at the previous step's end but those that
        # joined for this step (a remote prefill's first token; a local one's came from its
        # prefill, earlier): their gap is not an inter-token time of a step.
        gap = now - self._ends[-1]
        tokens = self._batch - len(self._first_pending)
        if tokens > 0:
            _, total, count = self._itl[-1]
            self._itl.append((now, total + gap * tokens, count + tokens))
        self._ends.append(now)
        for request in self._first_pending:
            request.first_token = now
            self._on_first_token(request)
        self._first_pending.clear()
        finishing = self._finishing
        finished = False
        while finishing and finishing[0][0] <= self._step:
            request = heapq.heappop(finishing)[2]
            request.finish = now
            # A remote prefill's tokens all come from steps; a local one's first from its prefill.
            times = self._ends[request.joined + 1 :]
            request.tail_tbt = tail_gap(
                times if request.endpoint is not None else [request.first_token, *times]
            )
            self._batch -= 1
            finished = True
            self._leave()
            self._on_finish(request)
        self._start()
        if finished:
            self._record()

    def _record(self) -> None:
        waiting = self._local.waiting + len(self._queue) + self._pulling
        self.gauge.record(self._loop.now, waiting, self._local.running + self._batch)


class SlotPrefillEngine:
    """The emulator as a prefill engine: ``max_num_seqs`` slots, a prefill sleep each."""

    def __init__(
        self,
        loop: Loop,
        key: str,
        scenario: Scenario,
        tokens_per_s: float,
        on_done: Callable[[Request], None],
    ) -> None:
        self.key = key
        self.gauge = Gauge()
        self._loop = loop
        self._scenario = scenario
        self._a = 1.0 / tokens_per_s
        self._on_done = on_done
        self.cache = EventedCache(scenario.prefill_cache_tokens, scenario.block_size)
        self._slots = scenario.prefill_max_num_seqs
        self._waiting: deque[Job] = deque()
        self._running = 0

    @property
    def outstanding(self) -> int:
        return len(self._waiting) + self._running

    def submit(self, job: Job) -> None:
        if self._slots and self._running >= self._slots:
            self._waiting.append(job)
        else:
            self._start(job)
        self._record()

    def _start(self, job: Job) -> None:
        self._running += 1
        factor = 1 + self._scenario.concurrency_slowdown * (self._running - 1)
        _found(self.cache, job)
        seconds = prefill_seconds(
            self._a, self._scenario.crossover_tokens, job.remaining, job.offset
        )
        self._loop.at(self._loop.now + seconds * factor, self._finish, job)

    def _finish(self, job: Job) -> None:
        self._running -= 1
        if job.request.shape.segments:
            self.cache.store(job.request.shape.segments)
        if self._waiting:
            self._start(self._waiting.popleft())
        self._record()
        self._on_done(job.request)

    def _record(self) -> None:
        self.gauge.record(self._loop.now, len(self._waiting), self._running)


class SlotDecodeEngine:
    """The emulator as a decode engine: a slot per request; a local prefill sleeps, a remote
    one's KV transfer sleeps; then one decode delay per output token after the first. Nothing
    stalls anything else (the emulator has no batch), but every delay grows with ``running``."""

    def __init__(
        self,
        loop: Loop,
        index: int,
        scenario: Scenario,
        on_first_token: Callable[[Request], None],
        on_finish: Callable[[Request], None],
    ) -> None:
        self.index = index
        self.gauge = Gauge()
        self.outstanding = 0
        self.prefill_s = 0.0
        self.cache = PrefixCache(scenario.decode_cache_tokens, scenario.block_size)
        self._loop = loop
        self._scenario = scenario
        self._a = 1.0 / scenario.prefill_tokens_per_s
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._slots = scenario.decode_max_num_seqs
        self._waiting: deque[tuple[Request, Job | None]] = deque()
        self._running = 0

    def inter_token(self, when: float) -> tuple[float, int] | None:
        """The emulator's model serves no inter-token latency histogram here."""
        return None

    def submit_local(self, job: Job) -> None:
        self._admit(job.request, job)

    def arrive_remote(self, request: Request) -> None:
        """The prefill answered: the decode leg comes in, pulls the KV, decodes."""
        self._admit(request, None)

    def _admit(self, request: Request, job: Job | None) -> None:
        if self._slots and self._running >= self._slots:
            self._waiting.append((request, job))
        else:
            self._start(request, job)
        self._record()

    def _factor(self) -> float:
        return 1 + self._scenario.concurrency_slowdown * (self._running - 1)

    def _start(self, request: Request, job: Job | None) -> None:
        self._running += 1
        scenario = self._scenario
        if job is None:
            blocks = -(-request.shape.prompt_tokens // scenario.block_size)
            seconds = scenario.kv_transfer_s_per_block * blocks  # transfer: no slowdown factor
        else:
            seconds = (
                prefill_seconds(self._a, scenario.crossover_tokens, job.remaining, job.offset)
                * self._factor()
            )
            self.prefill_s += seconds
        self._loop.at(self._loop.now + seconds, self._first, request)

    def _first(self, request: Request) -> None:
        request.first_token = self._loop.now
        self._on_first_token(request)
        self._step(request, request.shape.output_tokens - 1, [request.first_token])

    def _step(self, request: Request, left: int, times: list[float]) -> None:
        """``times``: when each of its tokens came, so far."""
        if left <= 0:
            request.finish = self._loop.now
            request.tail_tbt = tail_gap(times)
            self._running -= 1
            if self._waiting:
                self._start(*self._waiting.popleft())
            self._record()
            self._on_finish(request)
            return
        delay = self._scenario.decode_s_per_token * self._factor()
        self._loop.at(self._loop.now + delay, lambda _: self._token(request, left - 1, times))

    def _token(self, request: Request, left: int, times: list[float]) -> None:
        times.append(self._loop.now)
        self._step(request, left, times)

    def _record(self) -> None:
        self.gauge.record(self._loop.now, len(self._waiting), self._running)
