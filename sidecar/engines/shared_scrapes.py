"""Prefill scrapes shared by the sidecars of a pool: each prefill endpoint's ``/metrics`` is
scraped by a few sidecars, whatever the number of decode pods, and read by the others from the
state backend (``SIDECAR_SHARED_SCRAPES``).

**Who scrapes an endpoint.** Its owners: the ``SIDECAR_SCRAPES_PER_ENDPOINT`` (*k*) members
ranked first for it by rendezvous hashing of their ids. The members are the sidecars that share
scrapes: each renews its membership when it reads the list (every round of its first
``members_every_s``, then once per ``members_every_s``) for two periods and two rounds, so a
sidecar that stopped sharing or never did (an older version, the setting off) is no member and
owns nothing. Every sidecar with the same list picks the same owners, and a sidecar joining or
leaving moves only the endpoints it ranks among their first *k*. An owner scrapes as before
and publishes what it found — the gauges, or that the scrape went unanswered or could not reach
the engine, when (its Unix time) and who it is — in one key per endpoint that expires after
``EXPIRE_INTERVALS`` scrape intervals.

**What the others do.** Every sidecar reads its pool's publications once per scrape round (one
round trip, with the member list when it is due; the first read includes it) and hands each
endpoint's publication to its pool once, as if it had scraped it itself, dated by the
publication's age; one older than a publication already handed (two owners write in any order)
is not handed. What one owner alone may have seen is not taken for the engine's state
(``ScrapeShare.take``): a scrape that went unanswered or could not reach the engine is handed,
as one without gauges, only once two publishers (or three lines of one) said so in a row, and
never as unreachable (the owner's own
pool ejects the endpoint, and the ejection reaches the others through the shared state).

**When the publications fail.** A sidecar that cannot read them (the backend is unreachable)
scrapes every endpoint itself, as it decides on its local state, and reads again after a
backoff. The *k* sidecars ranked next, an endpoint's **backups**, scrape it and publish when its
publication is missing, refused or older than ``FALLBACK_INTERVALS`` scrape intervals (every
owner gone at once before the member lists show it, or leaving it alone while their own pool has
it ejected), and keep scraping while the line there is theirs; nobody else does, so that a stale
publication never makes the whole fleet scrape. A sidecar that cannot publish (Redis read-only,
out of memory) goes on reading (its membership then lapses and the others own its endpoints);
its endpoints' backups take over meanwhile.

**What a publication may say.** Whoever can write the values cannot stall a sidecar or make it
believe a gauge out of range: a value is read only when it is one line of bounded size whose
every field parses in range and whose time is at most one scrape interval (and at least a
second) ahead of the reader's clock (``decode``); one that fails is skipped and counted. The
member list is bounded (``MAX_MEMBERS``) and its ids are checked; like the shared state's
leases, it is trusted: whoever can write there can also hold reservations.

Pure but for the ``ScrapeStore`` it is given (``RedisState``): no clock of its own (``now`` and
``wall`` are passed in), no task; the engine monitor drives it in its scrape round.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.fleet.load import EngineLoad
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.scheduling.placement import affinity, endpoint_weight

log = logging.getLogger("sidecar.engines.shared_scrapes")

FALLBACK_INTERVALS = 2.0
"""A publication older than this many scrape intervals is not waited for: the endpoint's backups
scrape it (and publish). Two, so that a load read at its oldest is still within the planner's
staleness bound (three intervals) until the next round."""
EXPIRE_INTERVALS = 5.0
"""A publication's key expires this many scrape intervals after it was written (at least
``EXPIRE_MIN_S``): an endpoint nobody scrapes any more leaves nothing behind."""
EXPIRE_MIN_S = 1.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0
"""After a failed read or publication, the next read waits 0.5 s, doubling to 5 s; meanwhile
every prefill endpoint is scraped here."""
ROUND_TIMEOUTS_S = 3.0
"""The longest a round may wait beyond its interval: its read, its slowest scrape (2 s at
most), a publication."""
MEMBERSHIP_MIN_S = 5.0
"""A membership is renewed for at least twice this (the member list read more often than that
renews it for longer than it is read)."""
SILENT_LINES_ALONE = 3
"""Unanswered lines in a row that a reader takes for the engine's stall when they all come from
one publisher (an owner alone, k = 1); from two publishers or more, two suffice."""
SHARED_SCRAPES_TIMEOUT_S = 0.5
"""The longest wait for a round's read or publication: Redis answers in a millisecond or two, and
a round waits for its read before it scrapes."""
MAX_MEMBERS = 10_000
"""Members read at most: a larger fleet ranks owners over the first ``MAX_MEMBERS`` by
membership deadline, which differ between sidecars (more or fewer owners for a while; the
backups cover an endpoint its owners leave alone)."""
MAX_ID_BYTES = 64
"""A sidecar id (``uuid4().hex``: 32 bytes); a longer member is not one of ours: skipped."""
MAX_VALUE_BYTES = 200
"""A publication is one line of about 60–120 bytes."""
MAX_QUEUE = 10**7
"""Waiting or running requests beyond this are no engine's."""
MAX_CACHE_TOKENS = 10**12
VERSION = "1"


class ScrapeStore(Protocol):
    """Where publications and the member list live (``RedisState``). Both calls raise on any
    failure (a connection, a timeout, a reply of the wrong shape)."""

    @property
    def member_id(self) -> str:
        """This sidecar's id among the members."""
        ...

    async def read_scrapes(
        self, endpoints: Sequence[str], *, members: int, wall: float, member_until: float
    ) -> tuple[list[bytes | None], list[bytes] | None]:
        """The publications of ``endpoints`` (one per endpoint, None where there is none); and,
        when ``members`` is above 0, the ids of at most ``members`` sidecars whose membership
        runs past ``wall``, and this sidecar's renewed until ``member_until`` (best effort: a
        refused write does not fail the read); else None: one round trip."""
        ...

    async def write_scrapes(self, values: Mapping[str, str], *, expire_s: float) -> None:
        """Publish ``values`` (endpoint -> ``encode``'s line), each expiring after
        ``expire_s``."""
        ...


@dataclass(frozen=True, slots=True)
class Published:
    """One endpoint's scrape as a sidecar published it."""

    wall: float
    """When the scrape ended, by the publisher's clock (Unix time)."""
    load: EngineLoad | None
    """Its gauges (``at`` is the reader's to set), or None: unanswered, or no metrics."""
    unreachable: bool
    publisher: str = ""
    """The publishing sidecar's id."""


def encode(wall: float, snapshot: EngineSnapshot, publisher: str) -> str:
    """One scrape's snapshot, by ``publisher`` (a sidecar id), as a publication's line."""
    load = snapshot.load
    flags = ("u" if snapshot.unreachable else "-") + ("l" if load is not None else "-")
    if load is None:
        fields = ["-"] * 6
    else:
        cache = load.cache_tokens
        fields = [
            _text(load.waiting, MAX_QUEUE),
            _text(load.running, MAX_QUEUE),
            _text(load.kv_usage, 1.0),
            str(cache) if cache is not None and 0 <= cache <= MAX_CACHE_TOKENS else "-",
            _text(load.itl_sum_s, math.inf),
            _text(load.itl_count, math.inf),
        ]
    return " ".join([VERSION, repr(wall), flags, publisher, *fields])


def _text(value: float | None, high: float) -> str:
    """A gauge as ``decode`` reads it back; one it would refuse (an engine's negative, infinite
    or out-of-range value) is published as unknown, so that readers take the rest."""
    if value is None or not (math.isfinite(value) and 0.0 <= value <= high):
        return "-"
    return repr(float(value))


def decode(raw: object) -> Published | None:
    """A publication's line, checked: None unless it is one of ours whose every field parses
    in range."""
    if not isinstance(raw, bytes) or len(raw) > MAX_VALUE_BYTES or not raw.isascii():
        return None
    parts = raw.decode("ascii").split(" ")
    if len(parts) != 10 or parts[0] != VERSION or parts[2] not in ("--", "u-", "-l", "ul"):
        return None
    unreachable, has_load = parts[2][0] == "u", parts[2][1] == "l"
    publisher = parts[3]
    if not 0 < len(publisher) <= MAX_ID_BYTES or not publisher.isprintable():
        return None
    values = parts[4:]
    try:
        wall = _number(parts[1], math.inf)
        if not has_load:
            if values != ["-"] * 6:
                return None
            return Published(wall, None, unreachable, publisher)
        cache = _optional(values[3], MAX_CACHE_TOKENS)
        if cache is not None and not cache.is_integer():
            return None
        load = EngineLoad(
            waiting=_optional(values[0], MAX_QUEUE),
            running=_optional(values[1], MAX_QUEUE),
            kv_usage=_optional(values[2], 1.0),
            at=0.0,
            cache_tokens=None if cache is None else int(cache),
            itl_sum_s=_optional(values[4], math.inf),
            itl_count=_optional(values[5], math.inf),
        )
    except ValueError:
        return None
    return Published(wall, load, unreachable, publisher)


def _number(text: str, high: float) -> float:
    """``text`` as a finite number in [0, high]; ValueError otherwise."""
    value = float(text)
    if not (math.isfinite(value) and 0.0 <= value <= high):
        raise ValueError(f"{text} is out of range")
    return value


def _optional(text: str, high: float) -> float | None:
    """``-`` is None (the engine did not say); otherwise ``_number``."""
    return None if text == "-" else _number(text, high)


def owners(members: Iterable[int], endpoint: str, count: int) -> list[int]:
    """The ``count`` members (by ``member_weight``) ranked first for ``endpoint`` by rendezvous
    hashing: the same in every process given the same members."""
    anchor = endpoint_weight(endpoint)
    return heapq.nlargest(count, members, key=lambda member: affinity(anchor, member))


def member_weight(member: str) -> int:
    """A member's half of a rendezvous weight (as an endpoint's is, in placement)."""
    return endpoint_weight(member)


class ScrapeShare:
    """One sidecar's part in the shared scrapes (see the module's docstring)."""

    def __init__(
        self,
        store: ScrapeStore,
        *,
        per_endpoint: int,
        interval_s: float,
        members_every_s: float,
        timeout_s: float,
        on_skipped: Callable[[str, int], None] = lambda kind, count: None,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        """``per_endpoint``: owners per endpoint (k). ``interval_s``: the scrape interval.
        ``members_every_s``: how often the member list is read again. ``timeout_s``: the
        longest wait for a read or a publication. ``on_skipped(kind, count)``: entries read and
        refused (``scrape``, ``member``). ``on_error()``: a read or a publication failed."""
        self._store = store
        self._me = store.member_id
        self._my_weight = member_weight(self._me)
        self._per_endpoint = per_endpoint
        self._interval_s = interval_s
        self._members_every_s = members_every_s
        self._timeout_s = timeout_s
        self._on_skipped = on_skipped
        self._on_error = on_error
        self._down_until = -math.inf
        self._backoff_s = BACKOFF_FIRST_S
        self._members: frozenset[int] = frozenset([self._my_weight])
        self._members_read_at = -math.inf
        self._first_read: float | None = None
        self._places: dict[str, int] = {}
        """This sidecar's place in each endpoint's ranking, for the members as last read: below
        k an owner, below 2k a backup, 2k neither."""
        self._read: dict[str, tuple[bytes, Published]] = {}
        """This round's publications, as read and as decoded."""
        self._handed: dict[str, tuple[bytes, float]] = {}
        """The publication last handed to the pool (or this sidecar's own last scrape), and its
        time, per endpoint: one read again, or an older one written later, is not handed."""
        self._publish_failing = False
        self._silent: dict[str, tuple[int, frozenset[str]]] = {}
        """The run of unanswered scrapes per endpoint: how many lines in a row, and by whom."""
        self._publish_down_until = -math.inf
        self._publish_backoff_s = BACKOFF_FIRST_S
        self._found: dict[str, str] = {}
        """This round's own scrapes, to publish."""
        self.readable = False
        """The last read was answered: False before the first, and while the store fails."""
        self.counts = {"own": 0, "shared": 0, "backup": 0, "unread": 0}
        """Scrapes handed to the pool, by where they came from: this sidecar's as an owner,
        another's publication, this sidecar's as a backup (it found the publication missing or
        too old), this sidecar's because it could not read the publications."""
        self.last_error: str | None = None

    @property
    def expire_s(self) -> float:
        return max(EXPIRE_MIN_S, EXPIRE_INTERVALS * self._interval_s)

    async def read(self, endpoints: Sequence[str], *, now: float, wall: float) -> None:
        """The round's one read: the publications of ``endpoints``, and the members when due.
        Never raises: a failed read leaves every endpoint to this sidecar's own scrapes, and
        the next reads wait out a backoff (0.5 s doubling to 5 s) so that an unreachable Redis
        does not hold up every round."""
        self._found = {}
        self._forget(endpoints)
        if now < self._down_until:
            self.readable = False
            self._read = {}
            return
        # Every round for the first period (the members register as they start: a fleet
        # starting together sees itself whole within a round or two), then once a period.
        due = (
            self._first_read is None
            or now - self._first_read < self._members_every_s
            or now - self._members_read_at >= self._members_every_s
        )
        # A membership lasts two periods and two rounds (a round may take the interval and
        # its timeouts): renewed once a period, it never lapses between two renewals.
        member_s = max(self._members_every_s, MEMBERSHIP_MIN_S)
        member_until = wall + 2 * member_s + 2 * (self._interval_s + ROUND_TIMEOUTS_S)
        try:
            async with asyncio.timeout(self._timeout_s):
                raw, members = await self._store.read_scrapes(
                    endpoints,
                    members=MAX_MEMBERS if due else 0,
                    wall=wall,
                    member_until=member_until,
                )
            if len(raw) != len(endpoints):
                raise ValueError("not one publication per endpoint")
        except Exception as exc:  # the store's errors, and whatever it was answered
            self._failed(now, exc)
            return
        if not self.readable:
            log.info("shared scrapes: the publications are read again")
        self.readable = True
        self.last_error = None
        self._backoff_s = BACKOFF_FIRST_S
        read: dict[str, tuple[bytes, Published]] = {}
        refused = 0
        latest = wall + max(self._interval_s, 1.0)  # a clock that far ahead is not believed
        for endpoint, value in zip(endpoints, raw, strict=True):
            published = decode(value)
            if published is not None and published.wall <= latest:
                assert isinstance(value, bytes)  # decode said so
                read[endpoint] = (value, published)
            elif value is not None:
                refused += 1
        if refused:
            self._on_skipped("scrape", refused)
        self._read = read
        if members is not None:
            self._members_read_at = now
            if self._first_read is None:
                self._first_read = now
            await self._rank(members if isinstance(members, list) else [])
        # Endpoints new since the last ranking, and gone ones forgotten.
        for endpoint in [endpoint for endpoint in endpoints if endpoint not in self._places]:
            self._places[endpoint] = self._place(endpoint)
            await asyncio.sleep(0)

    def _forget(self, endpoints: Sequence[str]) -> None:
        """What is kept of endpoints gone from the pool, forgotten (bounded by the pool)."""
        wanted = set(endpoints)
        for kept in (self._places, self._handed, self._silent):
            if len(kept) > len(wanted):
                for endpoint in [e for e in kept if e not in wanted]:
                    del kept[endpoint]

    def _failed(self, now: float, exc: BaseException) -> None:
        if self.readable or self.last_error is None:
            log.warning(
                "shared scrapes: cannot read the publications (%s: %s); scraping every prefill "
                "endpoint here",
                type(exc).__name__,
                exc,
            )
        self.readable = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._read = {}
        self._down_until = now + self._backoff_s
        self._backoff_s = min(BACKOFF_MAX_S, 2 * self._backoff_s)
        self._on_error()

    async def _rank(self, raw: Sequence[bytes]) -> None:
        """The members as read; every endpoint ranked again when they changed."""
        weights = {self._my_weight}
        refused = 0
        for member in raw[:MAX_MEMBERS]:
            if isinstance(member, bytes) and 0 < len(member) <= MAX_ID_BYTES and member.isascii():
                weights.add(member_weight(member.decode("ascii")))
            else:
                refused += 1
        if refused:
            self._on_skipped("member", refused)
        members = frozenset(weights)
        if members == self._members:
            return
        self._members = members
        for endpoint in list(self._places):
            self._places[endpoint] = self._place(endpoint)
            # Ranking is O(members) per endpoint: let the loop breathe between endpoints.
            await asyncio.sleep(0)

    def _place(self, endpoint: str) -> int:
        ranked = owners(self._members, endpoint, 2 * self._per_endpoint)
        mine = self._my_weight
        return ranked.index(mine) if mine in ranked else 2 * self._per_endpoint

    def scrapes(self, endpoint: str, *, wall: float) -> bool:
        """Whether this sidecar scrapes ``endpoint`` itself this round: it owns it, or it
        cannot read the publications, or it is a backup and the newest publication is missing
        or too old. Anyone else waits for the publications: an endpoint the owners and the
        backups all leave alone (all of them have it ejected) is not scraped by the fleet."""
        place = self._places.get(endpoint, 0)
        if not self.readable or place < self._per_endpoint:
            return True
        if place >= 2 * self._per_endpoint:
            return False
        read = self._read.get(endpoint)
        if read is None or read[1].publisher == self._me:
            return True  # nothing readable, or it took over: its line is still the one there
        return wall - read[1].wall > FALLBACK_INTERVALS * self._interval_s

    def found(self, endpoint: str, snapshot: EngineSnapshot, *, wall: float) -> None:
        """This sidecar scraped ``endpoint``: published at the round's end (``publish``)."""
        line = encode(wall, snapshot, self._me)
        self._found[endpoint] = line
        self._handed[endpoint] = (line.encode(), wall)
        if snapshot.load is None:
            self._silent_line(endpoint, self._me)
        else:
            self._silent.pop(endpoint, None)
        if not self.readable:
            self.counts["unread"] += 1
        else:
            owner = self._places.get(endpoint, 0) < self._per_endpoint
            self.counts["own" if owner else "backup"] += 1

    def take(self, endpoint: str, *, now: float, wall: float) -> EngineSnapshot | None:
        """The publication of ``endpoint`` as a snapshot dated on this sidecar's monotonic
        clock, once; None when there is nothing new.

        What one owner alone may have seen is not taken for the engine's state: a scrape that
        went unanswered or could not reach the engine is handed, as one that found no gauges,
        only once a run of such lines holds two publishers (or ``SILENT_LINES_ALONE`` lines of
        one: an owner alone) — one owner's slow loop is not the engine's stall; a frozen engine
        is unanswered to every owner — and never as unreachable (the owner's pool ejects the
        endpoint, and the ejection reaches the others through the shared state; a reader's own
        prefills count its own failures)."""
        read = self._read.get(endpoint)
        if read is None:
            return None
        raw, published = read
        handed = self._handed.get(endpoint)
        if handed is not None and (raw == handed[0] or published.wall <= handed[1]):
            return None  # handed already, or older than what was (owners write in any order)
        self._handed[endpoint] = (raw, published.wall)
        load = published.load
        if load is None:
            lines, by = self._silent_line(endpoint, published.publisher)
            if len(by) < 2 and lines < SILENT_LINES_ALONE:
                return None
        else:
            self._silent.pop(endpoint, None)
        self.counts["shared"] += 1
        at = now - max(0.0, wall - published.wall)
        if load is not None:
            load = EngineLoad(
                waiting=load.waiting,
                running=load.running,
                kv_usage=load.kv_usage,
                at=at,
                cache_tokens=load.cache_tokens,
                itl_sum_s=load.itl_sum_s,
                itl_count=load.itl_count,
            )
        return EngineSnapshot(load=load, at=at)

    def _silent_line(self, endpoint: str, publisher: str) -> tuple[int, frozenset[str]]:
        """One more unanswered scrape of ``endpoint`` in the run, by ``publisher``."""
        lines, by = self._silent.get(endpoint, (0, frozenset()))
        run = (lines + 1, by | {publisher})
        self._silent[endpoint] = run
        return run

    async def publish(self, *, now: float) -> None:
        """This round's own scrapes, published; never raises (a failure is the next read's)."""
        found, self._found = self._found, {}
        if not found or not self.readable or now < self._publish_down_until:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._store.write_scrapes(found, expire_s=self.expire_s)
        except Exception as exc:  # Redis read-only after a failover, out of memory, ...
            if not self._publish_failing:
                log.warning(
                    "shared scrapes: cannot publish (%s: %s); the others' backups scrape "
                    "the endpoints this sidecar owns",
                    type(exc).__name__,
                    exc,
                )
            self._publish_failing = True
            self.last_error = f"publish: {type(exc).__name__}: {exc}"
            self._publish_down_until = now + self._publish_backoff_s
            self._publish_backoff_s = min(BACKOFF_MAX_S, 2 * self._publish_backoff_s)
            self._on_error()
        else:
            if self._publish_failing:
                log.info("shared scrapes: publishing again")
            self._publish_failing = False
            self._publish_backoff_s = BACKOFF_FIRST_S

    def describe(self) -> dict[str, Any]:
        """For /debug/scheduler."""
        return {
            "per_endpoint": self._per_endpoint,
            "members": len(self._members),
            "owned": sorted(e for e, place in self._places.items() if place < self._per_endpoint),
            "backup": sorted(
                e
                for e, place in self._places.items()
                if self._per_endpoint <= place < 2 * self._per_endpoint
            ),
            "readable": self.readable,
            "publishing": not self._publish_failing,
            "scrapes": dict(self.counts),
            "last_error": self.last_error,
        }
