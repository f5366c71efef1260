"""The emulator's own endpoints under /emulator/ (KV state, request log and fault injection), and
the engines' admin paths it serves (SGLang's /abort_request, vLLM's /reset_prefix_cache)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.faults import FaultSpec
from sidecar.emulator.generation import read_json
from sidecar.emulator.keys import CONFIG, ENGINE, FAULTS, KV, POLLS, PUSH, REQUEST_LOG


async def get_kv(request: web.Request) -> web.Response:
    """KV state; sglang rooms computed and not yet claimed count as staged."""
    kv = request.app[KV]
    engine = request.app[ENGINE]
    config = request.app[CONFIG]
    staged = [
        {"request_id": s.request_id, "blocks": s.blocks, "age_s": s.age_s}
        for s in kv.snapshot()  # sweeps expiry first
    ]
    rooms = engine.rooms
    if rooms is not None:
        staged += [
            {"request_id": r.request_id, "blocks": r.blocks, "age_s": r.age_s, "room": r.room}
            for r in rooms.snapshot()
        ]
    store_blocks = await asyncio.to_thread(engine.store.count) if engine.store else 0
    return web.json_response(
        {
            "engine_id": kv.engine_id,
            "kv_protocol": config.kv_protocol,
            "disaggregation_mode": config.disaggregation_mode,
            "staged_requests": len(staged),
            "staged_blocks": sum(s["blocks"] for s in staged),
            "pulled_total": kv.pulled_total + (rooms.claimed_total if rooms else 0),
            "expired_total": kv.expired_total + (rooms.timed_out_total if rooms else 0),
            "failed_pulls_total": engine.failed_pulls_total,
            "rejected_pulls_total": kv.rejected_total,
            "registrations_waiting": request.app[PUSH].waiting,
            "rooms_waiting": engine.rooms_waiting,
            "claims_waiting": rooms.claims_waiting if rooms else 0,
            "store_blocks": store_blocks,
            "prefix_cache_blocks": len(engine.prefix_cache),
            "prefix_cache_evicted_total": engine.prefix_cache.evicted_total,
            "kv_events": engine.events.snapshot(),
            "staged": staged,
        }
    )


async def post_abort(request: web.Request) -> web.Response:
    """SGLang's ``POST /abort_request {"rid": ...}``: cancel the running requests with that rid."""
    body = await read_json(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise EmulatorError(400, "rid must be a string")
    return web.json_response({"aborted": request.app[ENGINE].abort(rid)})


async def post_reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's ``POST /reset_prefix_cache`` (served with ``VLLM_SERVER_DEV_MODE=1``, in
    ``vllm/entrypoints/serve/cache/api_router.py``): forget every cached block; 200, no body.
    Staged KV is not touched, and the counters keep counting."""
    request.app[ENGINE].reset_prefix_cache()  # publishes AllBlocksCleared (KV events)
    return web.Response(status=200)


async def get_requests(request: web.Request) -> web.Response:
    entries = request.app[REQUEST_LOG].entries()
    return web.json_response({"requests": [e.to_json() for e in entries]})


async def delete_requests(request: web.Request) -> web.Response:
    request.app[REQUEST_LOG].clear()
    return web.json_response({"cleared": True})


async def get_polls(request: web.Request) -> web.Response:
    """How many ``/metrics`` and ``/health`` requests the engine served since it started."""
    polls: dict[str, int] = request.app[POLLS]
    return web.json_response(polls)


async def get_faults(request: web.Request) -> web.Response:
    board = request.app[FAULTS]
    return web.json_response(
        {"faults": board.pending(), "held": board.held, "padding_sent": board.padding_sent}
    )


async def post_fault(request: web.Request) -> web.Response:
    try:
        spec = FaultSpec.from_json(await read_json(request))
        request.app[FAULTS].add(spec)
    except ValueError as exc:
        raise EmulatorError(400, str(exc)) from exc
    return web.json_response({"fault": spec.to_json()}, status=201)


async def delete_faults(request: web.Request) -> web.Response:
    request.app[FAULTS].clear()
    return web.json_response({"cleared": True})


async def post_release(request: web.Request) -> web.Response:
    board = request.app[FAULTS]
    held = board.held
    board.release()
    return web.json_response({"released": held})


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/emulator/kv", get_kv)
    app.router.add_get("/emulator/requests", get_requests)
    app.router.add_delete("/emulator/requests", delete_requests)
    app.router.add_get("/emulator/polls", get_polls)
    app.router.add_get("/emulator/faults", get_faults)
    app.router.add_post("/emulator/faults", post_fault)
    app.router.add_delete("/emulator/faults", delete_faults)
    app.router.add_post("/emulator/release", post_release)
    app.router.add_post("/abort_request", post_abort)
    app.router.add_post("/reset_prefix_cache", post_reset_prefix_cache)
