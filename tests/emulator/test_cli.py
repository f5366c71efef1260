"""``python -m sidecar.emulator`` as a process: starts, serves, exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import aiohttp
import pytest

from sidecar.emulator.config import config_from_args


@pytest.mark.system
async def test_module_runs_and_stops_on_sigterm(session: aiohttp.ClientSession) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.emulator",
        "--port",
        "0",
        "--model",
        "cli-model",
        "--fault",
        "status:503:1",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        async with asyncio.timeout(10):
            line = (await process.stderr.readline()).decode()
        match = re.search(r"at (http://\S+) \(side channel \S+:(\d+)", line)
        assert match, line
        url = match.group(1)
        body = {"model": "cli-model", "prompt": "hi", "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 503  # the fault armed on the command line
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_protocol_flags_parse() -> None:
    config = config_from_args(
        [
            "--kv-protocol",
            "sglang",
            "--disaggregation-mode",
            "prefill",
            "--bootstrap-timeout-s",
            "2.5",
            "--waiting-timeout-s",
            "3",
            "--push-registration-timeout-s",
            "4",
        ]
    )
    assert (config.kv_protocol, config.disaggregation_mode) == ("sglang", "prefill")
    assert (config.bootstrap_timeout_s, config.waiting_timeout_s) == (2.5, 3.0)
    assert config.push_registration_timeout_s == 4.0
    stored = config_from_args(
        ["--kv-protocol", "shared-storage", "--kv-store", "/tmp/kv", "--kv-store-max-blocks", "9"]
    )
    assert (stored.kv_store, stored.kv_store_max_blocks) == ("/tmp/kv", 9)
    assert config_from_args([]).kv_store is None


def test_sglang_without_a_role_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--kv-protocol", "sglang"])
    assert exit_info.value.code == 2
    assert "disaggregation_mode" in capsys.readouterr().err
