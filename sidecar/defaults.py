"""Defaults of settings that other modules use as their own defaults too: values, no imports.

``config.py`` builds ``Settings`` from them and the modules that need them import them from here,
never the other way round, so that ``import sidecar.config`` loads no engine client (aiohttp) and
the pure modules (the scheduling policies the simulator runs, the injector) load no pydantic.
Defaults that nothing else uses stay in ``Settings`` itself.
"""

from __future__ import annotations

DECODE_URL = "http://127.0.0.1:8200"
"""``SIDECAR_DECODE_URL``'s default: the local decode engine (the injector moves the engine to
this port)."""

DRAIN_TIMEOUT_S: float = 30
"""``SIDECAR_DRAIN_TIMEOUT_S``' default (the injector's check counts it for a sidecar that does
not set it)."""

PREFILLER_HOST_PORT = "x-prefiller-host-port"
GATEWAY_PREFILL_ENDPOINTS = "x-gateway-prefill-endpoints"
PREFILL_HEADERS = (PREFILLER_HOST_PORT, GATEWAY_PREFILL_ENDPOINTS)
"""``SIDECAR_PREFILL_HEADERS``' default: where a gateway names the prefill server, in order of
precedence (protocol.md §2). Other names are opt-in."""

ENGINE_KEEPALIVE_S: float = 4
"""``SIDECAR_ENGINE_KEEPALIVE_S``' default: below the 5 s after which vLLM's and SGLang's
servers (uvicorn) close an idle connection. Past the engine's timeout, a request can go out on a
connection whose close is already on its way back: the engine never reads it, and the sidecar
sees "closed without an answer" (a KV release lost, a decode leg failed). Under it, the sidecar
drops an idle connection before the engine can (aiohttp checks the idle time when it hands a
connection out)."""

QOE_CHOICES = 8
"""``SIDECAR_SCHEDULER_CHOICES``' default, the candidates ``qoe`` compares: every endpoint of a
pool of up to 8, a random 8 of a larger one. Two (best of two random) kept sidecars that decided
on the same stale view from all picking one endpoint; since each decision reads the others'
reservations one round trip old, the full comparison is better in every simulated scenario, the
memory backend's included (docs/scheduling.md, "Results")."""

SPEED_HALF_LIFE_S = 60.0
"""``SIDECAR_SPEED_HALF_LIFE_S``' default: without a new observation, the evidence behind an
endpoint's speed estimate weighs half as much after this long, the prior regaining the rest
(a published speed: half-way back to the prior; docs/scheduling.md)."""

RETEST_S = 15.0
"""``SIDECAR_SCHEDULER_RETEST_S``' default: an available endpoint unmeasured for this long (no
prefill from this sidecar, no new speed published by another) takes its next remote prefill
when only its speed estimate keeps it away."""

STALL_WEIGHT = 0.1
"""``SIDECAR_DISAGG_STALL_WEIGHT``' default: what one second of stall on one running decode
counts for, in seconds of a new request's time to first token, when the decider weighs a local
prefill (every decode running on the engine waits while it computes; counted only against a
prefill server with nothing queued). A tenth: a request's time-to-first-token budget (about 1 s)
is about a tenth of its decode's (some 200 tokens at 50 ms). In the simulator it raises goodput
on mixed and shared-system-prompt workloads and leaves the standard one unchanged
(docs/benchmarks.md)."""

STALL_SHARE = 0.05
"""``SIDECAR_DISAGG_STALL_SHARE``' default: the share of their time the decodes running on a
decode engine may spend stalled by local prefills (the rate at which a rank's stall budget
refills). A decode stalled a share ``f`` of its time has a TPOT of ``step / (1 - f)``: with a
full batch's step of some 40 ms, 5 % keeps it at 42 ms, under a 50 ms TPOT; spread evenly, it
adds half a step to the mean of a decode's longest 10 % of gaps (the tail TBT)."""

STALL_BURST_S = 1.0
"""``SIDECAR_DISAGG_STALL_BURST_S``' default: the most stall a rank's budget holds, and so the
longest local prefill (in its compute seconds) allowed while decodes run there. A decode of 200
tokens has 20 gaps in its longest 10 %; at a 50 ms step under a 100 ms tail-TBT bound they
absorb 20 × 50 ms = 1 s of stall once."""
