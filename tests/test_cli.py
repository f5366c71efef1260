"""The programs as an operator first meets them: a reader that goes away, a port already taken,
an extra not installed. Each ends in one line on stderr and a status, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sidecar.__main__ import check_kv_events
from sidecar.config import Settings


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(variables)
    return env


def _run(
    *args: str, stdout: int | None = None, **variables: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=_env(**variables),
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.system
@pytest.mark.parametrize(
    "args",
    [
        ("-m", "sidecar", "--help"),
        ("-m", "sidecar", "--version"),
    ],
)
def test_help_into_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    """``--help | head``: the reader is gone before the help is written (its end closed before
    the program starts, so every write fails): status 0, nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = _run(*args, stdout=write)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.system
def test_the_emulator_on_a_taken_port_says_so_in_one_line(taken: int) -> None:
    for flags, says in [
        (("--port", str(taken)), f"cannot listen on 127.0.0.1:{taken} (--port): address "),
        (
            ("--port", "0", "--side-channel-port", str(taken)),
            f"cannot listen on 127.0.0.1:{taken} (--side-channel-port): address ",
        ),
    ]:
        result = _run("-m", "sidecar.emulator", "--host", "127.0.0.1", *flags)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("python -m sidecar.emulator: "), result.stderr
        assert says in result.stderr
        assert "in use" in result.stderr


@pytest.mark.system
def test_the_serving_port_taken_names_the_engine_port_and_the_fix(taken: int) -> None:
    """The engine left on the pod's serving port, nothing where SIDECAR_DECODE_URL says: the
    sidecar's bind error says to move the engine to the port SIDECAR_DECODE_URL names."""
    result = _run(
        "-m",
        "sidecar",
        SIDECAR_HOST="127.0.0.1",
        SIDECAR_PORT=str(taken),
        SIDECAR_DECODE_URL="http://127.0.0.9:1",
    )
    assert result.returncode == 1, result.stderr
    error = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(error) == 1, result.stderr
    assert error[0].endswith(
        f"cannot listen on 127.0.0.1:{taken} (SIDECAR_PORT): address already in use; nothing "
        "listens at SIDECAR_DECODE_URL (http://127.0.0.9:1): if the decode engine is on port "
        f"{taken}, move it to 1 (vLLM --port 1), the sidecar takes the pod's serving port "
        "(docs/deploy.md)"
    ), error
    assert "Traceback" not in result.stderr


@pytest.mark.system
def test_kv_events_without_the_extra_exit_2_in_one_line() -> None:
    """The whole program, msgpack not importable, as without the extra."""
    code = (
        "import sys; sys.modules['msgpack'] = None\n"
        "from sidecar.__main__ import main\n"
        "sys.argv[1:] = []\n"
        "main()\n"
    )
    result = _run("-c", code, SIDECAR_KV_EVENTS="true", SIDECAR_PORT="0")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "pd-sidecar: SIDECAR_KV_EVENTS=true needs msgpack (the kvevents extra), which is not "
        "installed: the image has it; from a checkout of the source: pip install '.[kvevents]'\n"
    )


def test_the_kv_events_check_names_no_package_index(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "msgpack", None)
    check_kv_events(Settings(kv_events=False))  # off: nothing to check
    with pytest.raises(SystemExit) as exit_info:
        check_kv_events(Settings(kv_events=True))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "pip install '.[kvevents]'" in error
    assert "pd-sidecar[" not in error
