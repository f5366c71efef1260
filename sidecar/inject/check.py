"""``python -m sidecar.inject --check``: what an injected manifest would break in a cluster, found
before it gets there.

``kubectl kustomize`` and schema validation accept a pod in which two containers take one port,
or whose grace period is shorter than the engine's wait and the sidecar's drain; in the cluster,
one container then fails to bind and the other waits for ever, or the drain is cut by SIGKILL.
For every workload of a YAML stream that carries the sidecar (a native sidecar named
``pd-sidecar``), ``check_text`` lists:

- a port two running containers declare (``containers`` and the native sidecars among
  ``initContainers``: plain init containers have exited before the others start), by number and
  protocol, or a port name two of them declare (a Service's named ``targetPort`` is ambiguous);
- a container whose command line listens (``--port``) on a port the sidecar serves: the engine
  left on the pod's serving port;
- a ``terminationGracePeriodSeconds`` (Kubernetes' default: 30) shorter than the engine's
  ``preStop`` wait + ``SIDECAR_DRAIN_TIMEOUT_S`` + the engine's exit (``grace_period_s``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import yaml
from yarl import URL

from sidecar.defaults import DECODE_URL, DRAIN_TIMEOUT_S
from sidecar.inject.documents import describe, pod_spec, workloads
from sidecar.inject.pod import Container, Spec, flag_ports
from sidecar.inject.prestop import wait_s
from sidecar.inject.template import CONTAINER_NAME, grace_period_s

DEFAULT_GRACE_S = 30
"""``terminationGracePeriodSeconds`` when a pod does not set it (Kubernetes' default)."""


def check_text(text: str) -> tuple[int, list[str]]:
    """(workloads carrying the sidecar, one line per problem naming its workload) of a YAML
    stream; ``yaml.YAMLError`` when it is not YAML."""
    checked, problems = 0, []
    for document in yaml.safe_load_all(text):
        for workload in workloads(document):
            spec = pod_spec(workload)
            if spec is None or _sidecar(spec) is None:
                continue
            checked += 1
            problems += [f"{describe(workload)}: {problem}" for problem in check_pod_spec(spec)]
    return checked, problems


def check_pod_spec(spec: Spec) -> list[str]:
    """What is wrong with an injected pod spec (see the module's docstring)."""
    sidecar = _sidecar(spec)
    assert sidecar is not None
    running = [*(spec.get("containers") or []), *_native_sidecars(spec)]
    return [*_shared_ports(running), *_engine_on_our_port(spec, sidecar), *_grace(spec, sidecar)]


def _sidecar(spec: Spec) -> Container | None:
    return next((c for c in _native_sidecars(spec) if c.get("name") == CONTAINER_NAME), None)


def _native_sidecars(spec: Spec) -> list[Container]:
    return [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]


def _ports(container: Container) -> Iterator[dict[str, Any]]:
    yield from (p for p in container.get("ports") or [] if isinstance(p, dict))


def _number(value: object) -> int | None:
    """A port number as the API takes it (an integer), else None: the API server refuses the
    rest, and schema validation says so."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _shared_ports(running: list[Container]) -> list[str]:
    numbers: dict[tuple[int, str], list[str]] = {}
    names: dict[str, list[str]] = {}
    for container in running:
        name = str(container.get("name"))
        for port in _ports(container):
            number = _number(port.get("containerPort"))
            if number is not None:
                key = (number, str(port.get("protocol", "TCP")))
                numbers.setdefault(key, []).append(name)
            if port.get("name"):
                names.setdefault(str(port["name"]), []).append(name)
    problems = [
        f"containers {' and '.join(map(repr, owners))} both declare containerPort {number}"
        f"{'' if protocol == 'TCP' else '/' + protocol}: in the pod one of them cannot bind it"
        for (number, protocol), owners in numbers.items()
        if len(owners) > 1
    ]
    problems += [
        f"containers {' and '.join(map(repr, owners))} both name a port {name!r}: a Service's "
        "targetPort by that name is ambiguous"
        for name, owners in names.items()
        if len(owners) > 1
    ]
    return problems


def _engine_on_our_port(spec: Spec, sidecar: Container) -> list[str]:
    ours = {n for p in _ports(sidecar) if (n := _number(p.get("containerPort"))) is not None}
    ranks = _env(sidecar, "SIDECAR_DECODE_URLS")
    decode = (ranks or "").split(",")[0].strip() or _env(sidecar, "SIDECAR_DECODE_URL")
    engine_port = URL(decode or DECODE_URL).port
    return [
        f"container {container.get('name')!r} listens on --port {port}, a port of the sidecar: "
        f"move it to the port the sidecar's decode URL names ({engine_port})"
        for container in spec.get("containers") or []
        for port in sorted(flag_ports(container) & ours)
    ]


def _grace(spec: Spec, sidecar: Container) -> list[str]:
    drain_s = math.ceil(_seconds(_env(sidecar, "SIDECAR_DRAIN_TIMEOUT_S"), DRAIN_TIMEOUT_S))
    waits = [
        wait_s(hook)
        for container in spec.get("containers") or []
        for hook in [((container.get("lifecycle") or {}).get("preStop"))]
        if isinstance(hook, dict)
    ]
    wait = math.ceil(max((w for w in waits if w is not None), default=0))
    needed = grace_period_s(wait, drain_s)
    grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    if isinstance(grace, int) and grace >= needed:
        return []
    return [
        f"terminationGracePeriodSeconds {grace} is shorter than the drain needs: {needed} (the "
        f"engine's preStop wait {wait} s + SIDECAR_DRAIN_TIMEOUT_S {drain_s} s + "
        f"{needed - wait - drain_s} s for the engine to exit)"
    ]


def _seconds(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:  # not the sidecar's to run: --env and the sidecar's start refuse it
        return default


def _env(container: Container, name: str) -> str | None:
    for item in container.get("env") or []:
        if isinstance(item, dict) and item.get("name") == name and "value" in item:
            return str(item["value"])
    return None
