"""The engines as the sidecar reaches and watches them: the HTTP client boundary and the engines'
pools (``upstream``: where aiohttp's and asyncio's errors become the sidecar's own), one monitor
that polls each engine — every decode rank's ``/health`` and ``/metrics``, every prefill
endpoint's ``/metrics`` and, while it is probed after an ejection, its ``/health`` — and publishes
what it found as immutable snapshots (``monitor``; ``snapshot``: pure, no I/O; ``scrape``: vLLM's
load gauges parsed), and readiness read from them (``readiness``)."""
