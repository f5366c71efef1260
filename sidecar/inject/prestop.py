"""The engine's one ``preStop`` handler: the sidecar's wait, composed with a hook the engine had.

Kubernetes runs one ``preStop`` handler per container (``exec``, ``httpGet`` or ``sleep``), counts
the grace period from the moment the pod is deleted, and sends SIGTERM when the handler returns.
The sidecar needs the engine to keep serving for ``drain_s`` seconds from that moment
(docs/deploy.md, "Termination"). So, for the engine's own hook:

- none: ``exec: sleep <drain_s>``;
- a wait (``exec: sleep N``, ``sh -c "sleep N"``, the built-in ``sleep: {seconds: N}``): one wait of
  ``max(N, drain_s)`` in the same form, since both ask only that the engine keep serving that long;
- any other command: one ``exec`` that waits ``drain_s``, then runs the command as it was written
  (``sh -c 'sleep D; exec "$@"' engine-prestop <command...>``: no quoting is changed), but for its
  loopback calls to the serving port (``127.0.0.1:8000``, ``localhost:8000``, ``[::1]:8000``),
  which would reach the sidecar now: they name the engine's new port. Any other mention of the
  serving port is left as written, with a warning. The command still runs just before the
  engine's SIGTERM, as it did without the sidecar; how long it runs cannot be known, so the grace
  period counts ``command_s`` for it (``--engine-prestop-s``, ``ENGINE_PRESTOP_S`` by default);
- ``httpGet``: cannot share one handler with a wait without a tool in the engine's image: refused,
  saying what to write instead. ``tcpSocket`` is no lifecycle handler Kubernetes runs: refused.

``PreStop.run_s`` is the longest the handler runs; the grace period is
``run_s + drain_s + ENGINE_EXIT_S`` (``template.grace_period_s``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

ENGINE_PRESTOP_S = 10
"""What the grace period counts for an engine's own preStop command unless told
(``--engine-prestop-s``): a drain call or a flush, not a command that returns at once."""
WRAPPER_NAME = "engine-prestop"
"""``$0`` of the composed shell: what ``ps`` shows while it runs."""
_SLEEP_ARG = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_SLEEP_SCRIPT = re.compile(r"^\s*(?:exec\s+)?sleep\s+(\S+)\s*;?\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})

Hook = dict[str, Any]


class PreStopError(Exception):
    """The engine's hook cannot be composed with the wait; the message says what to write."""


@dataclass(frozen=True, slots=True)
class PreStop:
    hook: Hook
    """The engine's ``lifecycle.preStop`` after injection."""
    run_s: int
    """The longest the hook runs: the engine's SIGTERM comes at most this long after deletion."""
    note: str | None
    """What became of the engine's own hook (for stderr), None when it had none."""


def ours(drain_s: int) -> Hook:
    """The wait alone, as ``sidecar.yaml`` writes it."""
    return {"exec": {"command": ["sleep", str(drain_s)]}}


def compose(
    existing: Any, drain_s: int, command_s: int, *, serving_port: int, engine_port: int
) -> PreStop:
    """The engine's handler with the sidecar's wait in it; ``command_s`` is the longest the
    engine's own command (not a wait) runs. Raises ``PreStopError``."""
    if existing is None or existing == ours(drain_s):
        return PreStop(ours(drain_s), drain_s, None)
    if not isinstance(existing, dict) or len(existing) != 1:
        raise PreStopError(
            "has a preStop hook the injector cannot read (one of exec, httpGet or sleep "
            "expected): fix or remove it"
        )
    waited = wait_s(existing)
    if waited is not None:
        shown = _show(existing)
        if waited >= drain_s:
            note = f"its preStop {shown} is kept: it covers the sidecar's {drain_s} s drain"
            return PreStop(existing, math.ceil(waited), note)
        note = f"its preStop {shown} now waits {drain_s} s, the sidecar's drain (--drain-s)"
        return PreStop(_with_wait(existing, drain_s), drain_s, note)
    if "exec" in existing:
        command = [str(token) for token in (existing["exec"] or {}).get("command") or []]
        if not command:
            raise PreStopError("has a preStop exec hook without a command: remove it")
        script = f'sleep {drain_s}; exec "$@"'
        loopback = re.compile(rf"(?<![\w.-])(127\.0\.0\.1|localhost|\[::1\]):{serving_port}(?!\d)")
        moved = [loopback.sub(rf"\g<1>:{engine_port}", token) for token in command]
        hook = {"exec": {"command": ["sh", "-c", script, WRAPPER_NAME, *moved]}}
        note = (
            f"keeps its preStop command ({_show(existing)}), run after the sidecar's "
            f"{drain_s} s wait: the grace period counts {command_s} s for it "
            f"(--engine-prestop-s, {ENGINE_PRESTOP_S} s unless given: raise it if the command "
            "may run longer)"
        )
        if moved != command:
            note += (
                f"; its loopback calls to port {serving_port}, the sidecar's now, go to "
                f"{engine_port}, the engine's"
            )
        if any(re.search(rf":{serving_port}(?!\d)", token) for token in moved):
            note += (
                f"; it names port {serving_port}, the sidecar's now: the engine listens on "
                f"{engine_port}"
            )
        return PreStop(hook, drain_s + command_s, note)
    if "httpGet" in existing:
        get = existing["httpGet"] or {}
        path = str(get.get("path") or "/")
        raise PreStopError(
            f"has an httpGet preStop hook (GET {path}): a container has one preStop handler "
            f"and the sidecar needs a {drain_s} s wait in it. Write both as one exec, e.g. "
            f"command: [sh, -c, 'sleep {drain_s}; curl -fsS "
            f"http://127.0.0.1:{engine_port}{path}'] (the engine's new port; any HTTP client "
            "its image has), and inject again"
        )
    if "tcpSocket" in existing:
        raise PreStopError(
            "has a tcpSocket preStop hook, which Kubernetes does not run (it fails when the pod "
            "stops): remove it"
        )
    kind = next(iter(existing))
    raise PreStopError(f"has a preStop hook of a kind the injector does not know ({kind})")


def wait_s(hook: Hook) -> float | None:
    """Seconds of a hook that only waits, None for any other."""
    if "sleep" in hook:
        seconds = (hook["sleep"] or {}).get("seconds")
        return float(seconds) if isinstance(seconds, int) and seconds >= 0 else None
    command = [str(token) for token in ((hook.get("exec") or {}).get("command") or [])]
    if len(command) == 2 and PurePosixPath(command[0]).name == "sleep":
        return _sleep_arg(command[1])
    if len(command) == 3 and PurePosixPath(command[0]).name in _SHELLS and command[1] == "-c":
        match = _SLEEP_SCRIPT.match(command[2])
        return _sleep_arg(match.group(1)) if match else None
    return None


def _sleep_arg(text: str) -> float | None:
    """``sleep``'s argument in seconds (coreutils and busybox: a number, optionally s/m/h/d)."""
    match = _SLEEP_ARG.match(text)
    return float(match.group(1)) * _UNIT_S[match.group(2)] if match else None


def _with_wait(hook: Hook, seconds: int) -> Hook:
    """The same wait, in the same form, of ``seconds``."""
    if "sleep" in hook:
        return {"sleep": {**hook["sleep"], "seconds": seconds}}
    command = [str(token) for token in hook["exec"]["command"]]
    if len(command) == 2:
        command[1] = str(seconds)
    else:
        command[2] = f"sleep {seconds}"
    return {"exec": {**hook["exec"], "command": command}}


def _show(hook: Hook) -> str:
    if "sleep" in hook:
        return f"sleep: {{seconds: {hook['sleep'].get('seconds')}}}"
    return "exec: [" + ", ".join(str(token) for token in hook["exec"]["command"]) + "]"
