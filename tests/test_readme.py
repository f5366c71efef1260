"""The README's hand-run recipe works as written (its ports swapped for free ones)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.processes import free_port
from tests.tools import program

README = Path(__file__).resolve().parent.parent / "README.md"
RECIPE_PORTS = ("8100", "8200", "8000")


def recipe() -> str:
    text = README.read_text()
    section = text[text.index("## Try it by hand") :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "no sh block under 'Try it by hand'"
    return match.group(1)


def runnable(ports: dict[str, int]) -> str:
    """The recipe with this environment's Python and ``ports`` for its own."""
    script = recipe()
    assert ". .venv/bin/activate" in script
    script = script.replace(". .venv/bin/activate", f'PATH="{Path(sys.executable).parent}:$PATH"')
    for port in RECIPE_PORTS:
        assert f":{port}" in script or f"port {port}" in script, port
        script = re.sub(rf"\b{port}\b", str(ports[port]), script)
    return script


async def run_recipe(script: str) -> tuple[int | None, str, str]:
    """Its status, stdout and stderr; its background jobs killed with it."""
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-e",
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # the recipe's background jobs go with it, whatever happens
        env={k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 45)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, out.decode(), err.decode()


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_the_recipe_with_its_ports_taken_ends_in_one_line_each() -> None:
    """Every port of the recipe taken (bound, as by a run left behind): each emulator and the
    sidecar say so in one line, the wait for readiness ends with the sidecar, and the recipe
    stops at its first curl, refused, in seconds."""
    program("curl", "curl")
    taken = []
    for _ in RECIPE_PORTS:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        taken.append(sock)
    try:
        ports = dict(zip(RECIPE_PORTS, (sock.getsockname()[1] for sock in taken), strict=True))
        started = time.monotonic()
        status, _, err = await run_recipe(runnable(ports))
        took = time.monotonic() - started
    finally:
        for sock in taken:
            sock.close()
    assert status not in (0, None), err
    assert "Traceback" not in err, err
    refused = [line for line in err.splitlines() if "address already in use" in line]
    assert (
        sorted(line.split(":", 1)[0] for line in refused if "emulator" in line)
        == ["python -m sidecar.emulator"] * 2
    ), err
    assert [line for line in refused if f"{ports['8000']} (SIDECAR_PORT)" in line], err
    assert took < 15, (took, err)


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_the_readme_recipe_runs() -> None:
    program("curl", "curl")
    status, out, err = await run_recipe(runnable({port: free_port() for port in RECIPE_PORTS}))
    assert status == 0, err[-2000:]
    lines = out.splitlines()
    assert "data: [DONE]" in lines
    listed = orjson.loads(lines[-1])
    [record] = listed["recent"]
    assert (record["decision"], record["state"], record["status"]) == ("remote", "completed", 200)
