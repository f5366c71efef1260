"""Injection into one pod spec: find the engine, move it, add the sidecar — or say why not.

The engine is the one container of ``containers`` that serves the pod's serving port
(``Options.sidecar_port``): a ``containerPort`` of that number, or a ``--port`` of that value in its
``command`` or ``args`` (``--port 8000``, ``--port=8000``, or inside a ``sh -c`` script). Injection:

- the engine moves to ``engine_port``: its ``--port`` rewritten (or ``--port <engine_port>``
  appended to an exec-form command line that has none), its ``containerPort`` renamed ``engine``
  and renumbered (added when it had none), its probes that named the old port follow it;
- the sidecar is put first in ``initContainers`` and takes the serving port, under the name the
  engine's port had (so a Service's named ``targetPort`` now reaches the sidecar), else ``http``;
- the engine gets the ``preStop`` wait, composed with a hook it had (``prestop``);
  ``terminationGracePeriodSeconds`` is raised to cover it.

A pod that already has the native sidecar is left as it is. Everything else this cannot do safely
is an ``InjectError`` naming the container and what is wrong.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from sidecar.inject.prestop import PreStopError, compose
from sidecar.inject.template import CONTAINER_NAME, Options, grace_period_s, render

ENGINE_PORT_NAME = "engine"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
KNOWN_PROXIES = (
    # (what to look for in a container's name or image, what it is)
    ("istio-proxy", "Istio's sidecar"),
    ("istio/proxyv2", "Istio's sidecar"),
    ("linkerd-proxy", "Linkerd's sidecar"),
    ("linkerd2-proxy", "Linkerd's sidecar"),
    ("envoyproxy/", "an Envoy proxy"),
    ("routing-sidecar", "llm-d's routing sidecar"),
    ("routing-proxy", "llm-d's routing sidecar"),
)
"""Proxies that would already sit in front of the engine (or intercept the pod's traffic)."""
_PORT_FLAG = re.compile(r"(?<![\w-])--port(?:=|\s+)(\S+)")

Spec = dict[str, Any]
Container = dict[str, Any]


class InjectError(Exception):
    """Why a document cannot be injected; the message names the object and the container."""


def already_injected(spec: Spec) -> bool:
    return any(c.get("name") == CONTAINER_NAME for c in spec.get("initContainers") or [])


def inject_pod_spec(spec: Spec, options: Options) -> list[str]:
    """Inject in place and return what is worth saying about it (the engine's own ``preStop``);
    raises ``InjectError`` (message without the object's name) and leaves ``spec`` untouched
    when it cannot."""
    containers: list[Container] = spec.get("containers") or []
    init_containers: list[Container] = spec.get("initContainers") or []
    _refuse_proxies([*init_containers, *containers])
    if any(c.get("name") == CONTAINER_NAME for c in containers):
        raise InjectError(
            f"container {CONTAINER_NAME!r} is a regular container, not the native sidecar: "
            "remove it and inject again"
        )
    port = options.sidecar_port
    engine = _find_engine(containers, init_containers, port)
    who = f"engine container {engine.get('name')!r}"
    for other in [*init_containers, *containers]:
        taken = _ports_of(other)
        if other is not engine and options.engine_port in taken:
            raise InjectError(
                f"container {other.get('name')!r} already uses port {options.engine_port}, "
                "the engine's new port (--engine-port)"
            )
        if options.admin_port in taken:
            raise InjectError(
                f"container {other.get('name')!r} uses port {options.admin_port}, the sidecar's "
                "admin port (--admin-port)"
            )
    if options.engine_port in _declared_ports(engine) or options.engine_port in flag_ports(engine):
        raise InjectError(f"{who} already uses port {options.engine_port} (--engine-port)")
    unreadable = [value for value in _flag_values(engine) if not value.isdigit()]
    if unreadable:
        raise InjectError(f"{who} runs with --port {unreadable[0]}, which is not a number")
    flags = flag_ports(engine)
    if flags and flags != {port}:
        shown = ", ".join(str(p) for p in sorted(flags))
        raise InjectError(f"{who} declares containerPort {port} but runs with --port {shown}")
    lifecycle = engine.get("lifecycle") or {}
    rendered = render(options, port_name=_serving_port_name(engine, port))
    try:
        pre_stop = compose(
            lifecycle.get("preStop"),
            options.drain_s,
            options.engine_prestop_s,
            serving_port=port,
            engine_port=options.engine_port,
        )
    except PreStopError as exc:
        raise InjectError(f"{who} {exc}") from None
    taken_names = {item["name"] for item in rendered.container["ports"]} | {ENGINE_PORT_NAME}
    for other in [*init_containers, *containers]:
        port_names = {
            str(item.get("name"))
            for item in other.get("ports") or []
            if item.get("name") and (other is not engine or item.get("containerPort") != port)
        }
        if port_names & taken_names:
            clash = sorted(port_names & taken_names)[0]
            raise InjectError(
                f"container {other.get('name')!r} has a port named {clash!r}, a name the "
                "injection gives to the sidecar's or the engine's port"
            )
    if not flags:
        _check_can_append_port(engine)
    volumes: list[dict[str, Any]] = spec.get("volumes") or []
    for volume in rendered.volumes:
        if any(v.get("name") == volume["name"] for v in volumes):
            raise InjectError(
                f"the pod already has a volume named {volume['name']!r}, the name the "
                "injection gives to the TLS Secret's (--tls-secret)"
            )
    # Every refusal is above: from here on the spec changes.
    _move_engine(engine, port, options.engine_port)
    engine.setdefault("lifecycle", {})["preStop"] = pre_stop.hook
    spec["initContainers"] = [rendered.container, *init_containers]
    if rendered.volumes:
        spec["volumes"] = [*rendered.volumes, *volumes]  # first, as kustomize merges them
    needed = grace_period_s(pre_stop.run_s, options.drain_s)
    grace = spec.get("terminationGracePeriodSeconds")
    if not isinstance(grace, int) or grace < needed:
        spec["terminationGracePeriodSeconds"] = needed
    return [f"{who}: {pre_stop.note}"] if pre_stop.note else []


def _find_engine(
    containers: list[Container], init_containers: list[Container], port: int
) -> Container:
    """The one main container serving ``port``; a native sidecar serving it is another proxy."""
    for container in init_containers:
        if port in _ports_of(container):
            raise InjectError(
                f"init container {container.get('name')!r} already serves port {port}: "
                "the engine is behind another proxy"
            )
    engines = [c for c in containers if port in _ports_of(c)]
    if not engines:
        names = ", ".join(repr(c.get("name")) for c in containers) or "none"
        raise InjectError(
            f"no container serves port {port} (no containerPort {port}, no --port {port}; "
            f"containers: {names}); name the pod's serving port with --sidecar-port"
        )
    if len(engines) > 1:
        names = " and ".join(repr(c.get("name")) for c in engines)
        raise InjectError(f"containers {names} both claim port {port}")
    return engines[0]


def _refuse_proxies(containers: list[Container]) -> None:
    for container in containers:
        where = f"{container.get('name', '')} {container.get('image', '')}".lower()
        for needle, what in KNOWN_PROXIES:
            if needle in where:
                raise InjectError(
                    f"container {container.get('name')!r} (image {container.get('image')!r}) "
                    f"looks like {what}: the engine is already behind another proxy"
                )


def _command_line(container: Container) -> list[str]:
    return [str(t) for t in (container.get("command") or []) + (container.get("args") or [])]


def _is_shell(container: Container) -> bool:
    line = _command_line(container)
    return bool(line) and PurePosixPath(line[0]).name in SHELLS and "-c" in line


def _flag_values(container: Container) -> list[str]:
    """The values of ``--port`` on the command line (exec form or inside a shell script)."""
    values: list[str] = []
    line = _command_line(container)
    for i, token in enumerate(line):
        if token == "--port" and i + 1 < len(line):
            values.append(line[i + 1])
        elif token.startswith("--port="):
            values.append(token.removeprefix("--port="))
        elif any(ch.isspace() for ch in token):
            values.extend(_PORT_FLAG.findall(token))
    return values


def flag_ports(container: Container) -> set[int]:
    return {int(value) for value in _flag_values(container) if value.isdigit()}


def _declared_ports(container: Container) -> set[int]:
    return {int(p["containerPort"]) for p in container.get("ports") or [] if "containerPort" in p}


def _ports_of(container: Container) -> set[int]:
    return _declared_ports(container) | flag_ports(container)


def _serving_port_name(engine: Container, port: int) -> str | None:
    for item in engine.get("ports") or []:
        if item.get("containerPort") == port and item.get("name"):
            return str(item["name"])
    return None


def _check_can_append_port(engine: Container) -> None:
    name = engine.get("name")
    if _is_shell(engine):
        raise InjectError(
            f"engine container {name!r} runs a shell script without --port: add --port to the "
            "script so that it can be moved"
        )
    if not engine.get("command") and not engine.get("args"):
        raise InjectError(
            f"engine container {name!r} has no command or args: --port cannot be added without "
            "replacing its image's default command; give it args with --port"
        )


def _move_engine(engine: Container, old: int, new: int) -> None:
    old_name = _serving_port_name(engine, old)
    moved = False
    for key in ("command", "args"):
        tokens = engine.get(key)
        if not tokens:
            continue
        out = [str(t) for t in tokens]
        for i, token in enumerate(out):
            if token == "--port" and i + 1 < len(out) and out[i + 1] == str(old):
                out[i + 1] = str(new)
                moved = True
            elif token == f"--port={old}":
                out[i] = f"--port={new}"
                moved = True
            elif any(ch.isspace() for ch in token):
                pattern = re.compile(rf"(?<![\w-])(--port(?:=|\s+)){old}(?!\d)")
                out[i], count = pattern.subn(rf"\g<1>{new}", token)
                moved = moved or count > 0
        engine[key] = out
    if not moved:
        engine["args"] = [*(engine.get("args") or []), "--port", str(new)]
    ports: list[dict[str, Any]] = engine.get("ports") or []
    for item in ports:
        if item.get("containerPort") == old:
            item["containerPort"] = new
            item["name"] = ENGINE_PORT_NAME
            break
    else:
        ports.append({"name": ENGINE_PORT_NAME, "containerPort": new})
    engine["ports"] = ports
    for hook in _handlers(engine):
        for kind in ("httpGet", "tcpSocket", "grpc"):
            action = hook.get(kind)
            if not isinstance(action, dict) or "port" not in action:
                continue
            value = action["port"]
            if value == old or value == str(old):
                action["port"] = new
            elif old_name is not None and value == old_name:
                action["port"] = ENGINE_PORT_NAME


def _handlers(container: Container) -> list[dict[str, Any]]:
    lifecycle = container.get("lifecycle") or {}
    found = [container.get(key) for key in ("livenessProbe", "readinessProbe", "startupProbe")]
    found += [lifecycle.get("postStart"), lifecycle.get("preStop")]
    return [handler for handler in found if isinstance(handler, dict)]
