"""The injected sidecar, its engine ``preStop`` and the pod's grace period, from ``sidecar.yaml``.

``sidecar.yaml`` (package data) is the one definition; the kustomize component repeats it and a test
keeps the two equal. ``render(options)`` returns it with the command's options applied; with the
default options it is the file itself.

The termination arithmetic (docs/deploy.md, "Termination"): the engine waits ``drain_s`` in its
``preStop`` before it gets SIGTERM, then has 5 s to exit; only then is the sidecar stopped, and it
shuts down within its drain timeout + 1 s. So the grace period is ``preStop + drain + 5``, where
``preStop`` is the longest the engine's handler runs: the wait, or more when the engine had a hook
of its own (``prestop``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import yaml
import yarl

from sidecar.defaults import DECODE_URL
from sidecar.inject.prestop import ENGINE_PRESTOP_S

CONTAINER_NAME = "pd-sidecar"
"""The container's name: how a second injection recognizes the first."""
ENGINE_EXIT_S = 5
"""What the grace period leaves the engine to exit after SIGTERM, before the sidecar is stopped."""

Container = dict[str, Any]

_DEFAULT_DECODE_URL = yarl.URL(DECODE_URL)
assert _DEFAULT_DECODE_URL.port is not None
DEFAULT_ENGINE_PORT: int = _DEFAULT_DECODE_URL.port
"""The engine's port that the sidecar reaches without a ``SIDECAR_DECODE_URL``: its default's."""


@dataclass(frozen=True, slots=True)
class Options:
    """What ``python -m sidecar.inject`` may change; the defaults are ``sidecar.yaml``'s."""

    image: str
    sidecar_port: int
    """The pod's serving port: the engine's before injection, the sidecar's after."""
    engine_port: int
    admin_port: int
    drain_s: int
    """``SIDECAR_DRAIN_TIMEOUT_S``, and the engine's ``preStop`` wait."""
    tls_secret: str | None = None
    """A ``kubernetes.io/tls`` Secret: the sidecar serves HTTPS with its certificate."""
    engine_prestop_s: int = ENGINE_PRESTOP_S
    """The longest the engine's own ``preStop`` command runs (a command kept, not a wait)."""
    env: tuple[tuple[str, str], ...] = ()
    """More variables of the sidecar (name, value), after those above; checked by
    ``environment.check``."""


@dataclass(frozen=True, slots=True)
class Rendered:
    container: Container
    engine_pre_stop: dict[str, Any]
    grace_period_s: int
    volumes: list[dict[str, Any]]
    """Volumes the pod gets (the TLS Secret's)."""


def grace_period_s(pre_stop_s: int, drain_s: int) -> int:
    """The least ``terminationGracePeriodSeconds`` that covers the engine's wait and exit and the
    sidecar's whole shutdown."""
    return pre_stop_s + drain_s + ENGINE_EXIT_S


def load() -> dict[str, Any]:
    """``sidecar.yaml`` as shipped in the package."""
    text = files("sidecar.inject").joinpath("sidecar.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


def pod_labels() -> dict[str, str]:
    """The labels an injected pod gets (the PodMonitor of manifests/monitoring/ selects them)."""
    labels = load()["podLabels"]
    assert isinstance(labels, dict)
    return {str(key): str(value) for key, value in labels.items()}


def _env(container: Container, name: str) -> str:
    for item in container["env"]:
        if item["name"] == name:
            return str(item["value"])
    raise KeyError(name)


def defaults() -> Options:
    """The options that render ``sidecar.yaml`` unchanged."""
    container = load()["container"]
    return Options(
        image=container["image"],
        sidecar_port=int(_env(container, "SIDECAR_PORT")),
        engine_port=DEFAULT_ENGINE_PORT,
        admin_port=int(_env(container, "SIDECAR_ADMIN_PORT")),
        drain_s=int(_env(container, "SIDECAR_DRAIN_TIMEOUT_S")),
    )


def render(options: Options, *, port_name: str | None = None) -> Rendered:
    """The sidecar container with ``options`` applied; ``port_name`` renames its serving port (to
    the name the engine's port had, which a Service may target)."""
    data = load()
    container: Container = copy.deepcopy(data["container"])
    container["image"] = options.image
    for port in container["ports"]:
        if port["name"] == "http":
            port["containerPort"] = options.sidecar_port
            if port_name:
                port["name"] = port_name
        elif port["name"] == "admin":
            port["containerPort"] = options.admin_port
    values = {
        "SIDECAR_PORT": str(options.sidecar_port),
        "SIDECAR_ADMIN_PORT": str(options.admin_port),
        "SIDECAR_DRAIN_TIMEOUT_S": str(options.drain_s),
    }
    for item in container["env"]:
        item["value"] = values.get(item["name"], item["value"])
    if options.engine_port != DEFAULT_ENGINE_PORT:
        # Only then: the default reaches the engine, and leaves SIDECAR_DECODE_URLS settable.
        url = f"http://127.0.0.1:{options.engine_port}"
        container["env"].append({"name": "SIDECAR_DECODE_URL", "value": url})
    for name, value in options.env:
        for item in container["env"]:
            if item["name"] == name:
                item["value"] = value
                break
        else:
            container["env"].append({"name": name, "value": value})
    for probe in ("livenessProbe", "readinessProbe"):
        container[probe]["httpGet"]["port"] = options.sidecar_port
    volumes = []
    if options.tls_secret is not None:
        tls = data["tls"]
        # First, as the component's strategic merge puts them: both give the same pod.
        container["env"] = [*copy.deepcopy(tls["env"]), *container["env"]]
        container["volumeMounts"] = [
            {"name": tls["volume"], "mountPath": tls["mountPath"], "readOnly": True}
        ]
        for probe in ("livenessProbe", "readinessProbe"):
            container[probe]["httpGet"]["scheme"] = "HTTPS"
        volumes.append({"name": tls["volume"], "secret": {"secretName": options.tls_secret}})
    pre_stop = copy.deepcopy(data["enginePreStop"])
    pre_stop["exec"]["command"][-1] = str(options.drain_s)
    return Rendered(
        container=container,
        engine_pre_stop=pre_stop,
        grace_period_s=grace_period_s(options.drain_s, options.drain_s),
        volumes=volumes,
    )
