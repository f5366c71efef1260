"""The sidecar's environment in the injected pod: ``--env`` and the options that are settings.

What the command is given is checked as the sidecar would check it at start, so that a typo or a
bad value fails here, with exit status 2, rather than in a crash-looping pod: a ``SIDECAR_`` name
that is no setting is refused with the nearest one, and the values are validated by the sidecar's
own ``Settings`` (from these values only, never from the injector's own environment). Other names
(``OTEL_*`` for tracing, ...) are passed as given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "SIDECAR_"
OWNED = {
    "SIDECAR_PORT": "--sidecar-port",
    "SIDECAR_ADMIN_PORT": "--admin-port",
    "SIDECAR_DRAIN_TIMEOUT_S": "--drain-s (it sets the engine's wait and the grace period too)",
    "SIDECAR_DECODE_URL": "--engine-port (it moves the engine too)",
    "SIDECAR_TLS_CERT_FILE": "--tls-secret (it mounts the Secret too)",
    "SIDECAR_TLS_KEY_FILE": "--tls-secret (it mounts the Secret too)",
}
"""Variables an option of the command sets, because it changes the pod along with them."""
ALLOWLISTS = (
    "SIDECAR_INFERENCE_POOL",
    "SIDECAR_PREFILL_ALLOWED_CIDRS",
    "SIDECAR_PREFILL_ALLOWED_HOSTS",
)
"""Any one of them restricts the prefill servers a request header may name."""
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
"""What Kubernetes accepts as an environment variable's name."""


class EnvError(Exception):
    """An environment the sidecar would refuse at start; the message names the variable."""


def parse(items: Sequence[str]) -> list[tuple[str, str]]:
    """``--env NAME=VALUE`` arguments as (name, value), in order."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise EnvError(f"--env {item!r}: expected NAME=VALUE")
        if name in OWNED:
            raise EnvError(f"--env {name}: the command sets it; use {OWNED[name]}")
        pairs.append((name, value))
    return pairs


def merge(given: Sequence[tuple[str, str, str]]) -> tuple[tuple[str, str], ...]:
    """(name, value, which option gave it) as (name, value); a name given twice is refused."""
    seen: dict[str, str] = {}
    for name, _, where in given:
        if name in seen:
            also = "" if seen[name] == where else f" and {where}"
            raise EnvError(f"{name} is given twice (by {seen[name]}{also})")
        seen[name] = where
    return tuple((name, value) for name, value, _ in given)


def check(env: Sequence[Mapping[str, Any]]) -> None:
    """Validate the sidecar container's ``env`` (literal values; ``valueFrom`` ones are only
    named) as the sidecar's Settings would; raises ``EnvError``."""
    # Imported here: pydantic costs the injector most of a second, and only --env needs it.
    from pydantic import ValidationError
    from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

    from sidecar.config import Settings, explain, nearest_setting

    class Given(Settings):
        """Settings from the values passed in, not from this process's environment."""

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings,)

    known = {PREFIX + field.upper(): field for field in Settings.model_fields}
    values: dict[str, Any] = {}
    for item in env:
        name = str(item["name"])
        if not name.startswith(PREFIX):
            continue
        if name not in known:
            near = nearest_setting(name, known)
            hint = f"; did you mean {near}?" if near else " (python -m sidecar --help)"
            raise EnvError(f"{name} is not a setting of the sidecar{hint}")
        if "value" in item:
            values[known[name]] = item["value"]
    try:
        Given(**values)
    except ValidationError as exc:
        raise EnvError(explain(exc)) from None


def notes(env: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the sidecar will do with this environment that a new user may not expect."""
    names = {str(item["name"]): item.get("value") for item in env}
    out = []
    headers = names.get("SIDECAR_PREFILL_HEADERS")
    if not any(name in names for name in ALLOWLISTS) and (headers is None or headers.strip()):
        out.append(
            "the sidecar will call any prefill server a request header names (no "
            "--inference-pool, no SIDECAR_PREFILL_ALLOWED_CIDRS or _HOSTS): safe only behind a "
            "gateway that removes that header from clients' requests (docs/deploy.md)"
        )
    if "SIDECAR_INFERENCE_POOL" in names:
        out.append(
            "SIDECAR_INFERENCE_POOL: the pod's service account needs get, list and watch on "
            "inferencepools and pods (manifests/overlays/gateway/rbac.yaml)"
        )
    return out
