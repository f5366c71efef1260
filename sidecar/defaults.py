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

SPEED_IDLE_HALF_LIFE_S = 5.0
"""``SIDECAR_SPEED_IDLE_HALF_LIFE_S``' default: while an endpoint that stalled shows idle in its
scrapes (nothing waiting, nothing running), the evidence behind its speed estimate weighs half
as much after this long, its best measured speed's line regaining the rest. Twelve half-lives
in a minute: a 5 s stall's evidence then weighs 1/4096 (at 10 s, 1/64 of it still predicts 20 %
slower than the endpoint that did not stall; docs/scheduling.md)."""

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

TPOT_SLO_S = 0.050
"""``SIDECAR_DISAGG_TPOT_SLO_MS``' default, in seconds: the decodes' TPOT SLO the stall budget
protects (``sidecar.scheduling.decider``). 50 ms (20 tokens/s, a stream well ahead of a reader)
is the TPOT bound of the simulator's workloads and of DistServe-style constant SLOs for chat
(docs/benchmarks.md); an operator sets the SLO it serves to."""

TPOT_AIM = 0.8
"""What the stall budget aims the decodes' mean TPOT at, as a share of the SLO: the SLO bounds
each request's own mean, and a request that runs while more than the average share of stalls
falls on its engine sees more than the average; aiming at 0.8 × the SLO leaves a fifth of it
for that spread."""

STALL_BURST_S = 3.0
"""``SIDECAR_DISAGG_STALL_BURST_S``' default: the most stall a rank's budget holds, and so the
longest local prefill (in its compute seconds) allowed while decodes run there. One stall of B
seconds on an answer of n tokens adds B ÷ n to its TPOT: 3 s on a 200-token answer stepping at
35 ms adds 15 ms, to the 50 ms SLO; under Mooncake's tail-TBT bounds it is the 30 longest gaps
of a 300-token answer at a 25 ms step within 125 ms. Chosen among 1 s, 2 s, 3 s and no bound on
the conversation trace with seeds 11 and 12, which no result is judged on (at 80 % of capacity,
attainment 76, 91, 92 and 90 %; docs/benchmarks.md); 1 s, derived from a 100 ms tail-TBT bound
alone, sent remote most of the trace's long prompts that the decodes had room for."""
