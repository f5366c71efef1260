"""``python -m sidecar.demo`` (``make demo``): P/D disaggregation on one machine, no GPU.

Starts a prefill emulator, a decode emulator and the sidecar on free loopback ports, sends one
streamed chat request through the sidecar with the prefill server named in the gateway header,
prints the answer as it streams, then the request's ``/debug/requests`` record and the KV state of
the prefill engine (its staged blocks were pulled by the decode engine).
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import orjson

from sidecar.config import Settings
from sidecar.emulator import EmulatorConfig, start_emulator
from sidecar.server.runner import start_sidecar

PROMPT = "Explain in one paragraph why LLM serving splits prefill from decode."


async def demo() -> None:
    # A visible latency model: prefill costs per prompt token, decode per output token.
    prefill = await start_emulator(EmulatorConfig(port=0, prefill_s_per_token=0.002))
    decode = await start_emulator(EmulatorConfig(port=0, decode_s_per_token=0.05))
    sidecar = await start_sidecar(
        Settings(host="127.0.0.1", port=0, decode_url=decode.url, ready_interval_s=0.2)
    )
    try:
        print(f"prefill engine  {prefill.url}")
        print(f"decode engine   {decode.url}")
        print(f"sidecar         {sidecar.url}\n")
        async with aiohttp.ClientSession() as http:
            await _stream_chat(http, sidecar.url, prefill.endpoint)
            record = await _get(http, f"{sidecar.url}/debug/requests/demo-1")
            kv = await _get(http, f"{prefill.url}/emulator/kv")
        print("\n\n/debug/requests/demo-1:")
        print(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode())
        print(
            f"\nprefill engine KV: {kv['pulled_total']} request(s) pulled by the decode engine, "
            f"{kv['staged_blocks']} block(s) still staged"
        )
    finally:
        await sidecar.close()
        await decode.close()
        await prefill.close()


async def _stream_chat(http: aiohttp.ClientSession, sidecar_url: str, prefill: str) -> None:
    body = {
        "model": "emulated-model",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "stream": True,
    }
    headers = {"x-prefiller-host-port": prefill, "x-request-id": "demo-1"}
    print(f"POST /v1/chat/completions  (x-prefiller-host-port: {prefill})\n> {PROMPT}\n< ", end="")
    async with http.post(
        f"{sidecar_url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices", []):
                sys.stdout.write(choice.get("delta", {}).get("content") or "")
                sys.stdout.flush()


async def _get(http: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with http.get(url) as response:
        response.raise_for_status()
        payload: dict[str, object] = await response.json()
        return payload


def main() -> None:
    asyncio.run(demo())


if __name__ == "__main__":
    main()
