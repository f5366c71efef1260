"""The README's hand-run recipe works as written (its ports swapped for free ones)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
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


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_the_readme_recipe_runs() -> None:
    program("curl", "curl")
    script = recipe()
    assert ". .venv/bin/activate" in script
    script = script.replace(". .venv/bin/activate", f'PATH="{Path(sys.executable).parent}:$PATH"')
    for port in RECIPE_PORTS:
        assert f":{port}" in script or f"port {port}" in script, port
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
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
    assert process.returncode == 0, err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert "data: [DONE]" in lines
    listed = orjson.loads(lines[-1])
    [record] = listed["recent"]
    assert (record["decision"], record["state"], record["status"]) == ("remote", "completed", 200)
