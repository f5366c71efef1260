"""Where a request's token ids come from (issue 26): a tokenizer in the sidecar, or the engine's
``/tokenize`` on loopback. Measured on the e2e suite's model with a real vLLM.

    python bench/token_sources.py               # starts vLLM (~1 minute), 300 calls per case
    python bench/token_sources.py --calls 100

Both sources answer the same two requests: a completion prompt of about 2,000 tokens and a chat
request (a system prompt, three turns). Reported per source and request: latency p50/p99 (the
``/tokenize`` round trip on loopback, through aiohttp as the sidecar would make it; the
tokenizer's encode plus, for the chat, its template rendering), and whether the ids equal
vLLM's. For the in-sidecar tokenizer also the memory it costs (resident set before and after
loading ``tokenizer.json`` and the template, in a process of its own).

The in-sidecar tokenizer runs in vLLM's environment (the sidecar's has neither ``tokenizers``
nor ``jinja2``): ``tokenizers.Tokenizer.from_file`` on the model's ``tokenizer.json`` and the
model's ``chat_template.jinja`` rendered by jinja2 the way Hugging Face's ``transformers`` does
(a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, ``bos_token``/``eos_token``
from ``tokenizer_config.json``), and also with jinja2's defaults, to show what a template
rendered a little differently costs in correctness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e.engines import SERVED_MODEL, VllmEngine, VllmHome

_TEXT = (
    "the scheduler places each prompt where its prefix is cached and the decode batch keeps "
    "running while a prefill server computes the rest of the prompt then sends its blocks"
)
_WORDS = _TEXT.split()


def long_prompt(tokens_wanted: int) -> str:
    """Plain English of roughly ``tokens_wanted`` tokens (about one token per word and space
    for this model's byte-level vocabulary: trimmed by the caller to the count)."""
    words = [_WORDS[(i * 7) % len(_WORDS)] for i in range(tokens_wanted)]
    return " ".join(words)


def chat_request() -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant. " + long_prompt(300)},
            {"role": "user", "content": "What is prefix caching?"},
            {"role": "assistant", "content": "Reusing the KV of a prompt's known prefix."},
            {"role": "user", "content": "And why does a scheduler care?  Answer\nin two lines."},
        ],
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_TOKENIZER_SIDE = r"""
import json, resource, sys, time
def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4
model, calls = sys.argv[1], int(sys.argv[2])
cases = json.load(sys.stdin)
import tokenizers, jinja2, jinja2.sandbox
before = rss_kib()
tok = tokenizers.Tokenizer.from_file(model + "/tokenizer.json")
config = json.load(open(model + "/tokenizer_config.json"))
source = open(model + "/chat_template.jinja").read()
hf_env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
hf_template = hf_env.from_string(source)
plain_template = jinja2.Environment().from_string(source)
tok.encode("warm up")
after = rss_kib()
specials = {"bos_token": config.get("bos_token"), "eos_token": config.get("eos_token")}
out = {"rss_kib": after - before, "cases": {}}
for name, case in cases.items():
    for variant, template in (("hf", hf_template), ("plain", plain_template)):
        if "prompt" in case and variant == "plain":
            continue
        def ids():
            if "prompt" in case:
                return tok.encode(case["prompt"], add_special_tokens=True).ids
            text = template.render(messages=case["messages"], add_generation_prompt=True,
                                   **specials)
            return tok.encode(text, add_special_tokens=False).ids
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            result = ids()
            samples.append(time.perf_counter() - start)
        out["cases"][f"{name}/{variant}"] = {"samples": samples, "ids": result}
json.dump(out, sys.stdout)
"""


async def tokenize_calls(
    url: str, body: dict[str, Any], calls: int
) -> tuple[list[float], list[int]]:
    samples: list[float] = []
    ids: list[int] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(calls):
            start = time.perf_counter()
            async with http.post(f"{url}/tokenize", json=body) as response:
                answer = await response.json()
            samples.append(time.perf_counter() - start)
            ids = answer["tokens"]
    return samples, ids


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    home = VllmHome.locate()
    if (why := home.missing()) is not None:
        print(why)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="token-sources-"))
    # The e2e suite's engine as it starts it (its KV connector is idle: only /tokenize is asked).
    engine = VllmEngine(role="prefill", home=home, log_dir=log_dir)
    engine.start()
    url = engine.url
    try:
        await engine.wait_ready(300.0)
        # Trim the prompt to ~2,000 tokens by vLLM's own count.
        text = long_prompt(2000)
        _, ids = await tokenize_calls(url, {"model": SERVED_MODEL, "prompt": text}, 1)
        text = long_prompt(int(2000 * 2000 / len(ids)))
        cases: dict[str, dict[str, Any]] = {
            "completion 2k": {"model": SERVED_MODEL, "prompt": text},
            "chat": chat_request(),
        }
        engine_side: dict[str, tuple[list[float], list[int]]] = {}
        for name, body in cases.items():
            engine_side[name] = await tokenize_calls(url, body, args.calls)
        local = await asyncio.to_thread(
            subprocess.run,
            [str(home.python), "-c", _TOKENIZER_SIDE, str(home.model), str(args.calls)],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        sidecar_side = json.loads(local.stdout)
    finally:
        await engine.stop()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, {args.calls} calls each")
    print(f"{'source':38} {'tokens':>6} {'p50 µs':>9} {'p99 µs':>9}  equal to vLLM")
    for name, (samples, ids) in engine_side.items():
        print(
            f"{'vLLM /tokenize, ' + name:38} {len(ids):6d} {percentile(samples, 0.5) * 1e6:9.0f} "
            f"{percentile(samples, 0.99) * 1e6:9.0f}  (reference)"
        )
    for key, result in sidecar_side["cases"].items():
        name = key.split("/")[0]
        reference = engine_side[name][1]
        samples = result["samples"]
        print(
            f"{'tokenizers, ' + key:38} {len(result['ids']):6d} "
            f"{percentile(samples, 0.5) * 1e6:9.0f} {percentile(samples, 0.99) * 1e6:9.0f}  "
            f"{result['ids'] == reference}"
        )
    print(f"tokenizer.json + template loaded: +{sidecar_side['rss_kib']} KiB resident")
    print(
        f"median of vLLM /tokenize, chat: {statistics.median(engine_side['chat'][0]) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
