"""The decode send: a shared part of every connector.

Sends one body to the local decode engine — the rank the request was placed on — and returns
once the engine's answer has started — status line, headers and the first body byte — so that a
connector knows, when ``send`` returns, whether the engine took the request (and, for KV-pulling
protocols, the KV) or refused it. The wait is bounded by ``SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S``
and the request's deadline (504).

A rank that cannot even be connected to got nothing of the request: it goes to another ready rank
instead (each at most once, under the same deadline), so a rank that just died costs no request
before its next ``/health`` poll marks it unready. With one rank there is nowhere else: 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sidecar.body import Wire
from sidecar.config import Settings
from sidecar.connectors.exchange import Answer, Exchange, Patch
from sidecar.engines.upstream import Body, EngineAnswer, Engines
from sidecar.errors import EngineConnectTimeout, EngineNotConnected, EngineRefused, EngineTimeout
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks, RankClaim
from sidecar.tasks import OnFailure

logger = logging.getLogger("sidecar.connectors.decode")


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """The settings the decode send uses, under their own names (``from_settings``)."""

    decode_first_byte_timeout_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> DecodeOptions:
        return cls(decode_first_byte_timeout_s=settings.decode_first_byte_timeout_s)


class DecodeSend:
    def __init__(
        self, options: DecodeOptions, *, engines: Engines, ranks: DecodeRanks, metrics: Metrics
    ) -> None:
        self._first_byte_timeout_s = options.decode_first_byte_timeout_s
        self._engines = engines
        self._ranks = ranks
        self._metrics = metrics

    def release_urls(self, ex: Exchange) -> list[str]:
        """Where a release of ``ex``'s staged KV may go, in order: the rank its decode leg went
        to while it is ready, the other ready ranks (any rank can pull the KV), and that rank
        last when it is not ready."""
        rank = ex.placement.rank.rank
        others = self._ranks.candidates(exclude=[rank])
        order = [rank, *others] if rank.ready or not self._ranks.ready else [*others, rank]
        return [r.url + ex.path for r in order]

    async def send(self, ex: Exchange, data: Wire, patch: Patch | None = None) -> Answer:
        loop = asyncio.get_running_loop()
        by = loop.time() + self._first_byte_timeout_s
        if ex.deadline is not None:
            by = min(by, ex.deadline)
        rank = ex.placement.rank
        # The span ends at the first byte (the relay has its own).
        leg = ex.trace.leg("decode", rank.url + ex.path)
        try:
            upstream, first = await on_a_rank(
                self._ranks,
                rank,
                self._engines,
                self._metrics,
                "POST",
                ex.path,
                headers=leg.headers(ex.headers),
                data=data,
                by=by,
                limit=f"{self._first_byte_timeout_s:g}s "
                "(SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S or SIDECAR_REQUEST_TIMEOUT_S)",
                sending=ex.progress.decode_sent,
            )
        except BaseException as exc:
            leg.ended_by(exc, attributes={"pd_sidecar.decode_rank": rank.index})
            raise
        status = upstream.status
        leg.end(
            "first_byte",
            status=status,
            error=f"decode answered {status}" if status >= 400 else None,
            attributes={"pd_sidecar.decode_rank": rank.index},
        )
        ex.progress.first_byte()
        return Answer(upstream, first, patch)


async def on_a_rank(
    ranks: DecodeRanks,
    claim: RankClaim,
    engines: Engines,
    metrics: Metrics,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str],
    data: Body,
    by: float,
    limit: str,
    sending: Callable[[], None] | None = None,
) -> tuple[EngineAnswer, bytes]:
    """``started`` on the claimed rank; on another ready one (the claim moves there) when the
    claimed rank turned unready since the request was placed (a remote prefill takes a while), or
    cannot be connected to, unless the request named its rank (``RankClaim.pinned``). With no
    other rank to go to, a rank whose connection timed out is tried once more: nothing was sent,
    and a lost SYN or a full listen queue passes. ``sending`` is called before each attempt."""
    tried: list[DecodeRank] = []
    again = True
    while True:
        rank = claim.rank
        # A pinned request goes to the rank it named, or fails, as in llm-d.
        if not rank.ready and ranks.ready and not claim.pinned:  # nothing was sent to it yet
            other = ranks.least_loaded(exclude=[*tried, rank])
            if other is not None:
                logger.info(
                    "decode rank %d turned unready; sent to rank %d", rank.index, other.index
                )
                claim.move(other)
                rank = other
        if sending is not None:
            sending()
        metrics.decode_rank_requests_by(str(rank.index)).inc()
        try:
            return await started(
                engines, method, rank.url + path, headers=headers, data=data, by=by, limit=limit
            )
        except EngineNotConnected as exc:
            tried.append(rank)
            if isinstance(exc, EngineRefused):
                ranks.lost(rank)  # no process listens there: whatever it cached is gone
            # Else the rank keeps its index, this prompt (claimed there) included: a later turn
            # may be steered to it and recompute. Rarer and cheaper than forgetting the rank.
            other = None if claim.pinned else ranks.least_loaded(exclude=tried)
            if other is None:
                if not (again and isinstance(exc, EngineConnectTimeout)):
                    raise
                again = False
                logger.warning("decode rank %d: %s; trying it once more", rank.index, exc.message)
                continue
            logger.warning(
                "decode rank %d: %s; sent to rank %d instead", rank.index, exc.message, other.index
            )
            claim.move(other)


async def started(
    engines: Engines,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    data: Body,
    by: float,
    limit: str,
) -> tuple[EngineAnswer, bytes]:
    """Send to the decode engine; its answer and first body chunk by loop time ``by``, else
    ``EngineTimeout`` naming ``limit`` (the time and the setting that set it)."""
    try:
        async with asyncio.timeout_at(by):
            upstream = await engines.requests.send(
                method, url, headers=headers, data=data, role="the decode engine"
            )
            with OnFailure(upstream.close):
                first = await upstream.first_chunk()
    except TimeoutError:
        raise EngineTimeout(f"the decode engine sent nothing within {limit}") from None
    return upstream, first
