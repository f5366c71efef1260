"""Modelled engines in virtual time: an event loop, prefill engines and decode engines.

Prefill (on either kind of engine) works in iterations: first come first served, up to the batch
budget of prompt tokens per iteration (longer prompts are chunked over several), an iteration of
``n`` tokens taking ``n / tokens_per_s``. So a prefill's time grows with its tokens and with the
batch it shares. A decode engine gives local prefills priority: while one runs, its decode batch
stalls. Otherwise it runs decode steps, one token for every running request per step, a step
taking longer the larger the batch.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.sim.scenario import Scenario
from bench.sim.workload import Shape


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
    """Tokens the chosen engine prefills: the uncached ones locally, the whole prompt remotely."""
    work_tokens: float = 0.0
    """Tokens ahead at send (as the sidecar knew them) plus this prefill's: for SpeedEstimate."""
    first_token: float = math.nan
    finish: float = math.nan


@dataclass(slots=True, eq=False)
class Job:
    request: Request
    remaining: int
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
        for job in self.jobs:
            if left <= 0:
                break
            tokens = min(job.remaining, left)
            taken.append((job, tokens))
            left -= tokens
            if not job.started:
                job.started = True
                self.waiting -= 1
                self.running += 1
        return taken, (self.budget - left) / self.tokens_per_s

    def complete(self, taken: list[tuple[Job, int]]) -> list[Job]:
        for job, tokens in taken:
            job.remaining -= tokens
        done: list[Job] = []
        jobs = self.jobs
        while jobs and jobs[0].remaining <= 0:  # chunks are taken in order: the done ones lead
            done.append(jobs.popleft())
        self.running -= len(done)
        return done


class PrefillEngine:
    def __init__(
        self, loop: Loop, key: str, scenario: Scenario, on_done: Callable[[Request], None]
    ) -> None:
        self.key = key
        self.gauge = Gauge()
        self._loop = loop
        self._queue = _PrefillQueue(scenario.prefill_budget_tokens, scenario.prefill_tokens_per_s)
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
    """Local prefills first (the decode batch stalls meanwhile), else one decode step."""

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
        self._loop = loop
        self._scenario = scenario
        self._local = _PrefillQueue(scenario.prefill_budget_tokens, scenario.prefill_tokens_per_s)
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._busy = False
        self._step = 0
        self._batch = 0
        self._finishing: list[tuple[int, int, Request]] = []
        self._joining: list[tuple[Request, bool]] = []
        self._first_pending: list[Request] = []

    def submit_local(self, job: Job) -> None:
        self._local.add(job)
        self._kick()
        self._record()

    def arrive_remote(self, request: Request) -> None:
        """The KV cache arrived: the request joins the batch at the next step boundary."""
        self._joining.append((request, True))
        self._kick()

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
                self._on_finish(request)
        self._start()
        self._record()

    def _end_step(self, _: object) -> None:
        now = self._loop.now
        self._step += 1
        for request in self._first_pending:
            request.first_token = now
            self._on_first_token(request)
        self._first_pending.clear()
        finishing = self._finishing
        finished = False
        while finishing and finishing[0][0] <= self._step:
            request = heapq.heappop(finishing)[2]
            request.finish = now
            self._batch -= 1
            finished = True
            self._on_finish(request)
        self._start()
        if finished:
            self._record()

    def _record(self) -> None:
        self.gauge.record(self._loop.now, self._local.waiting, self._local.running + self._batch)
