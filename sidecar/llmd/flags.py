"""llm-d's routing-sidecar flags: the table of every one, and argv read with Go's syntax.

The flags are those of ``pkg/sidecar/proxy/options.go`` in llm-d's router repository, with the
older ones of llm-d's inference-scheduler and routing-sidecar repositories and the logging flags
its charts pass (docs/migrating-from-llm-d.md names the commits read). Each entry says what the
flag maps to here, as ``--help`` and the migration guide print it (a test keeps the guide's table
equal to this one); a flag pd-sidecar accepts only at llm-d's default says why and what to use
instead.

The syntax is Go's (``flag``, and ``pflag`` for long names): ``-name`` or ``--name``, a value as
``-name=value`` or ``-name value``; a boolean flag takes a value only as ``-name=false``; a list
flag repeats or takes a comma list; the last value of a repeated scalar flag wins. A value is
read as llm-d reads it, with Go's parsers (``goparse``): a number or a duration that Go refuses
(``--port= 8000``, full-width digits) is refused here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sidecar.llmd.goparse import GO_BOOL, go_duration, go_int

Kind = Literal["bool", "int", "string", "list", "duration"]
Value = bool | int | str | float | tuple[str, ...]


class FlagError(Exception):
    """An llm-d flag that is unknown, malformed, or asks for what pd-sidecar cannot do; the
    message names it and says what to use instead."""


@dataclass(frozen=True, slots=True)
class Flag:
    name: str
    kind: Kind
    maps_to: str
    """What it becomes here, as ``--help`` and docs/migrating-from-llm-d.md print it."""
    default: Value | None = None
    """llm-d's default, where only that value is accepted (``only_default``)."""
    only_default: str = ""
    """Why any other value is refused, and what to use instead."""
    base: Literal[0, 10] = 0
    """How llm-d reads an ``int`` flag's value: 0 as Go's int flags do (``strconv.ParseInt(s,
    0, 64)``: ``0x``, ``0o``, ``0b``, octal ``0``, underscores), 10 as ``strconv.Atoi`` or
    ``ParseInt(s, 10, bits)`` do (decimal only)."""
    bits: int = 64
    """The size of the signed integer an ``int`` flag's value must fit."""


NOT_MORIIO = (
    "pd-sidecar does not implement MoRI-IO write mode or Wide-EP fan-out: remove the "
    "--moriio-* flags (vLLM's NixlConnector is --kv-connector=nixlv2)"
)
NOT_OFFLOADING = (
    "pd-sidecar does not implement the OffloadingConnector's P2P tier: remove it and use "
    "--kv-connector=nixlv2 or shared-storage"
)

FLAGS: tuple[Flag, ...] = (
    # llm-d's ports are string flags, checked with strconv.Atoi: decimal only.
    Flag("port", "int", "SIDECAR_PORT", base=10),
    Flag("model-server-port", "int", "SIDECAR_DECODE_URL=http://127.0.0.1:PORT", base=10),
    Flag(
        "vllm-port",
        "int",
        "SIDECAR_DECODE_URL=http://127.0.0.1:PORT (as --model-server-port)",
        base=10,
    ),
    Flag(
        "data-parallel-size",
        "int",
        "SIDECAR_DECODE_URLS (the model-server port + r), SIDECAR_RANK_PORTS=true (--port + r)",
    ),
    Flag(
        "kv-connector",
        "string",
        "SIDECAR_CONNECTOR: nixlv2 -> nixl, sglang, shared-storage; mooncake, offloading refused",
    ),
    Flag(
        "connector",
        "string",
        "SIDECAR_CONNECTOR (as --kv-connector; lmcache -> shared-storage, nixl refused)",
    ),
    Flag(
        "ec-connector",
        "string",
        "refused unless empty (no encoder stage)",
        default="",
        only_default="pd-sidecar has no encoder stage (E/P/D): leave --ec-connector empty and "
        "let the prefill and decode engines encode multimodal inputs themselves",
    ),
    Flag(
        "mooncake-bootstrap-port",
        "int",
        "refused unless 8998 (no mooncake connector)",
        default=8998,
        only_default="it is used only by --kv-connector=mooncake, which pd-sidecar does not "
        "support: remove it (SGLang's bootstrap port is SIDECAR_SGLANG_BOOTSTRAP_PORT)",
    ),
    Flag(
        "p2p-connector-port",
        "int",
        "refused unless 7777 (no offloading P2P tier)",
        default=7777,
        only_default=NOT_OFFLOADING,
    ),
    Flag(
        "enable-p2p-pull",
        "bool",
        "refused unless false (no offloading P2P tier)",
        default=False,
        only_default=NOT_OFFLOADING,
    ),
    Flag(
        "enable-ssrf-protection",
        "bool",
        "SIDECAR_INFERENCE_POOL=the pool (true); false adds no allowlist",
    ),
    Flag("inference-pool", "string", "SIDECAR_INFERENCE_POOL, with --enable-ssrf-protection"),
    Flag(
        "inference-pool-namespace",
        "string",
        "SIDECAR_INFERENCE_POOL's namespace, with --enable-ssrf-protection",
    ),
    Flag(
        "inference-pool-name",
        "string",
        "SIDECAR_INFERENCE_POOL's name, with --enable-ssrf-protection",
    ),
    Flag(
        "pool-group",
        "string",
        "SIDECAR_INFERENCE_POOL_GROUP: inference.networking.k8s.io or its x-k8s.io group",
    ),
    Flag("enable-prefiller-sampling", "bool", "SIDECAR_PREFILL_HEADER_SAMPLING"),
    Flag(
        "enable-speculative-prefill",
        "bool",
        "refused unless false (no speculative next-turn prefill)",
        default=False,
        only_default="pd-sidecar does not warm the KV cache with a predicted next turn: remove "
        "it (a continuation is sent back to the decode rank holding its history)",
    ),
    Flag(
        "enable-tls",
        "list",
        "prefiller: SIDECAR_PREFILL_TLS=true; decoder: https:// SIDECAR_DECODE_URL(S)",
    ),
    Flag("prefiller-use-tls", "bool", "SIDECAR_PREFILL_TLS (as --enable-tls=prefiller)"),
    Flag("decoder-use-tls", "bool", "https:// SIDECAR_DECODE_URL(S) (as --enable-tls=decoder)"),
    Flag(
        "tls-insecure-skip-verify",
        "list",
        "SIDECAR_{PREFILL,DECODE}_TLS_INSECURE_SKIP_VERIFY: true named, false not named",
    ),
    Flag(
        "prefiller-tls-insecure-skip-verify",
        "bool",
        "as --tls-insecure-skip-verify=prefiller",
    ),
    Flag(
        "decoder-tls-insecure-skip-verify",
        "bool",
        "as --tls-insecure-skip-verify=decoder",
    ),
    Flag(
        "tls-min-version",
        "string",
        "SIDECAR_TLS_MIN_VERSION: VersionTLS12 -> 1.2, VersionTLS13 -> 1.3",
    ),
    Flag(
        "tls-cipher-suites",
        "list",
        "refused unless empty (OpenSSL's default TLS 1.2 suites)",
        default=(),
        only_default="pd-sidecar's listener uses OpenSSL's default TLS 1.2 cipher suites, which "
        "Go's names do not select: remove it (--tls-min-version=VersionTLS13 leaves TLS 1.3's "
        "suites only)",
    ),
    Flag(
        "secure-serving",
        "bool",
        "as --secure-proxy (llm-d's newer name)",
    ),
    Flag(
        "secure-proxy",
        "bool",
        "true: HTTPS on SIDECAR_PORT (self-signed without --cert-path or SIDECAR_TLS_CERT_FILE)",
    ),
    Flag(
        "cert-path",
        "string",
        "SIDECAR_TLS_CERT_FILE=DIR/tls.crt, SIDECAR_TLS_KEY_FILE=DIR/tls.key",
    ),
    Flag(
        "max-idle-conns-per-host",
        "int",
        "accepted: idle engine connections close after SIDECAR_ENGINE_KEEPALIVE_S",
    ),
    Flag("prefill-max-retries", "int", "SIDECAR_PREFILL_RETRIES"),
    Flag("prefill-retry-backoff", "duration", "SIDECAR_PREFILL_RETRY_BACKOFF_S"),
    Flag(
        "decode-chunk-size",
        "int",
        "refused unless 0 (no chunked decode)",
        default=0,
        only_default="pd-sidecar does not implement chunked decode: leave --decode-chunk-size "
        "at 0 (limit a request's length with its max_tokens)",
    ),
    Flag(
        "configuration",
        "string",
        "refused unless empty",
        default="",
        only_default="pd-sidecar reads no inline YAML configuration: pass each setting as its "
        "own flag, or as a SIDECAR_* variable (docs/configuration.md)",
    ),
    Flag(
        "configuration-file",
        "string",
        "refused unless empty",
        default="",
        only_default="pd-sidecar reads no YAML configuration file: pass each setting as its "
        "own flag, or as a SIDECAR_* variable (docs/configuration.md)",
    ),
    Flag("tracing", "bool", "SIDECAR_TRACING"),
    Flag(
        "metrics-port",
        "int",
        "SIDECAR_ADMIN_PORT (when above 0), plain HTTP unless SIDECAR_ADMIN_TLS is set",
    ),
    Flag(
        "metrics-cert-dir",
        "string",
        "SIDECAR_ADMIN_TLS=true when it is --cert-path's directory; another refused",
    ),
    Flag("moriio-write-mode", "bool", "refused unless false (no MoRI-IO)", False, NOT_MORIIO),
    Flag(
        "moriio-decode-notify-port", "int", "refused unless 61005 (no MoRI-IO)", 61005, NOT_MORIIO
    ),
    Flag("moriio-local-pod-ip", "string", "refused unless empty (no MoRI-IO)", "", NOT_MORIIO),
    Flag(
        "moriio-decode-handshake-port", "int", "refused unless 6301 (no MoRI-IO)", 6301, NOT_MORIIO
    ),
    Flag(
        "moriio-parallel-dispatch", "bool", "refused unless false (no MoRI-IO)", False, NOT_MORIIO
    ),
    Flag(
        "moriio-parallel-decode-wait-timeout",
        "duration",
        "refused unless 30s (no MoRI-IO)",
        30.0,
        NOT_MORIIO,
    ),
    Flag(
        "moriio-prefill-handshake-port",
        "int",
        "refused unless 6301 (no MoRI-IO)",
        6301,
        NOT_MORIIO,
    ),
    Flag(
        "moriio-prefill-notify-port", "int", "refused unless 61005 (no MoRI-IO)", 61005, NOT_MORIIO
    ),
    Flag("moriio-tp-size", "int", "refused unless 1 (no MoRI-IO)", 1, NOT_MORIIO),
    Flag("moriio-dp-size", "int", "refused unless 1 (no MoRI-IO)", 1, NOT_MORIIO),
    Flag("moriio-remote-hosts", "list", "refused unless empty (no MoRI-IO)", (), NOT_MORIIO),
    Flag("moriio-dp-size-local", "int", "refused unless 0 (no MoRI-IO)", 0, NOT_MORIIO),
    Flag("moriio-decode-hosts", "list", "refused unless empty (no MoRI-IO)", (), NOT_MORIIO),
    # klog's -v: strconv.ParseInt(s, 10, 32).
    Flag("v", "int", "SIDECAR_LOG_LEVEL: 4 and above DEBUG, else INFO", base=10, bits=32),
    Flag(
        "zap-log-level",
        "string",
        "SIDECAR_LOG_LEVEL: debug, info -> INFO (wins over -v, --zap-devel)",
    ),
    Flag("zap-devel", "bool", "SIDECAR_LOG_LEVEL=INFO (true, without --zap-log-level or -v)"),
    Flag("zap-encoder", "string", "accepted: pd-sidecar's log lines are text"),
    Flag("zap-stacktrace-level", "string", "accepted: a logged exception carries its traceback"),
    Flag("zap-time-encoding", "string", "accepted: log lines begin with a local time"),
)
"""Every flag of llm-d's sidecar, in the order of its options.go, then the logging flags."""

BY_NAME = {flag.name: flag for flag in FLAGS}


def parse(argv: Sequence[str]) -> dict[str, Value]:
    """The flags in ``argv`` by name, with Go's syntax (module docstring); ``FlagError`` for an
    unknown flag, a missing or malformed value, or an argument that is no flag."""
    values: dict[str, Value] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            if i < len(args):
                raise FlagError(f"unexpected argument {args[i]!r} (see --help)")
            break
        if not arg.startswith("-") or arg == "-" or arg.startswith("---"):
            raise FlagError(f"unexpected argument {arg!r} (see --help)")
        name, eq, text = arg.lstrip("-").partition("=")
        flag = BY_NAME.get(name)
        if flag is None:
            raise FlagError(f"unknown flag {arg.partition('=')[0]} (see --help)")
        if flag.kind == "bool" and not eq:
            text = "true"
        elif not eq:
            if i >= len(args):
                raise FlagError(f"flag needs an argument: --{name}")
            text = args[i]
            i += 1
        value = _value(flag, text)
        previous = values.get(name)
        if flag.kind == "list" and isinstance(previous, tuple) and isinstance(value, tuple):
            value = previous + value
        values[name] = value
    return values


def _value(flag: Flag, text: str) -> Value:
    if flag.kind == "bool":
        if text not in GO_BOOL:
            raise FlagError(f"invalid value {text!r} for --{flag.name}: true or false")
        return GO_BOOL[text]
    if flag.kind == "int":
        number = go_int(text, base=flag.base, bits=flag.bits)
        if number is None:
            what = "a decimal integer" if flag.base == 10 else "an integer"
            raise FlagError(f"invalid value {text!r} for --{flag.name}: {what}")
        return number
    if flag.kind == "duration":
        seconds = go_duration(text)
        if seconds is None:
            raise FlagError(
                f"invalid value {text!r} for --{flag.name}: a duration such as 200ms or 1.5s"
            )
        return seconds
    if flag.kind == "list":
        return tuple(item.strip() for item in text.split(",") if item.strip())
    return text


def help_rows() -> list[tuple[str, str]]:
    """(flag as typed, what it maps to) for ``--help``."""
    rows = []
    for flag in FLAGS:
        dashes = "-" if len(flag.name) == 1 else "--"
        typed = (
            f"{dashes}{flag.name}" if flag.kind == "bool" else f"{dashes}{flag.name}=<{flag.kind}>"
        )
        rows.append((typed, flag.maps_to))
    return rows
