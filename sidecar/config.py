"""Settings: the only module that reads the environment.

Every field is an environment variable ``SIDECAR_<NAME>``. List settings are comma-separated
strings (not JSON). ``python -m sidecar --help`` and ``docs/configuration.md`` list them all; a test
keeps the two in step with this class.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from yarl import URL

from sidecar.endpoints import Endpoint, parse_endpoint

CONNECTOR_ALIASES = {"nixlv2": "nixl"}
"""llm-d calls vLLM's NixlConnector protocol ``nixlv2``; we accept its name as an alias."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_", frozen=True, extra="forbid")

    host: str = Field("0.0.0.0", description="Address the sidecar listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the API (0 picks a free port).")
    decode_url: str = Field(
        "http://127.0.0.1:8200",
        description="Base URL of the local decode engine (http or https, no path).",
    )
    connector: Literal["nixl"] = Field(
        "nixl",
        description="KV connector protocol spoken to the engines: nixl (vLLM NixlConnector; "
        "alias nixlv2).",
    )
    prefill_endpoints: Annotated[tuple[Endpoint, ...], NoDecode] = Field(
        (),
        description="Static prefill pool, comma-separated host:port list, used round-robin when "
        "no gateway header names a prefill server. Empty: decode locally.",
    )
    rewrite_remote_host: bool = Field(
        False,
        description="Replace remote_host in the prefill's kv_transfer_params with the prefill "
        "endpoint's host (for prefill pods that advertise localhost).",
    )
    max_body_bytes: int = Field(
        33_554_432, gt=0, description="Largest request body accepted, in bytes (over it: 413)."
    )
    debug_history: int = Field(
        1000, ge=1, description="Completed requests kept for /debug/requests."
    )
    ready_interval_s: float = Field(
        2, gt=0, description="Seconds between polls of the decode engine's /health."
    )
    connect_timeout_s: float = Field(
        2, gt=0, description="Seconds allowed to open a TCP connection to an engine."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level of the sidecar's loggers."
    )
    log_requests: bool = Field(
        False, description="Log one INFO summary line per generation request."
    )

    @field_validator("connector", mode="before")
    @classmethod
    def _connector_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            name = value.strip().lower()
            return CONNECTOR_ALIASES.get(name, name)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("prefill_endpoints", mode="before")
    @classmethod
    def _endpoint_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [item for item in (part.strip() for part in value.split(",")) if item]
        if isinstance(value, list | tuple):
            return tuple(
                item if isinstance(item, Endpoint) else parse_endpoint(item) for item in value
            )
        return value

    @field_validator("decode_url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        url = URL(value.strip())
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an http:// or https:// URL with a host")
        if url.path not in ("", "/") or url.query_string or url.fragment:
            raise ValueError("must be a base URL without path, query or fragment")
        return str(url.with_path("")).rstrip("/")


def describe_fields() -> list[tuple[str, str, str]]:
    """(environment variable, default as written in the environment, description) per setting."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, tuple):
            shown = ",".join(str(item) for item in default)
        else:
            shown = str(default)
        rows.append((f"SIDECAR_{name.upper()}", shown, field.description or ""))
    return rows


def explain(error: ValidationError) -> str:
    """One line naming each invalid variable, for the exit-status-2 message."""
    parts = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else "?"
        variable = f"SIDECAR_{field.upper()}"
        message = str(item["msg"])
        if isinstance(item.get("ctx"), dict) and "error" in item["ctx"]:
            message = str(item["ctx"]["error"])
        parts.append(f"{variable}: {message}")
    return "invalid configuration: " + "; ".join(parts)
