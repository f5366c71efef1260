"""llm-d's flags, translated: ``Settings`` overrides, a certificate to make, notes to log.

``__main__`` passes the overrides to ``Settings`` as keyword arguments, which pydantic-settings
ranks above the environment: a flag wins over its variable, and the rest of the program sees only
``Settings``. A value pd-sidecar cannot honour (another KV protocol, chunked decode, an encoder
stage, ...) is a ``FlagError``: exit status 2 naming the flag and what to use instead. A value that
changes nothing here (a flag at llm-d's default, a log encoding) is accepted, and what pd-sidecar
does instead is one of the ``Translation.notes`` logged at start: nothing is dropped without a
word. This module never reads the environment itself: the few variables llm-d reads beside its
flags (``INFERENCE_POOL``, ...) come in as ``environ``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from yarl import URL

from sidecar import defaults
from sidecar.fleet.endpoints import split_scheme
from sidecar.llmd.flags import BY_NAME, NOT_OFFLOADING, FlagError, Value, parse
from sidecar.llmd.goparse import GO_BOOL, go_int

LLMD_MODEL_SERVER_PORT = 8200
"""llm-d's default for --model-server-port (it was 8001 before the router repository)."""
DECODE_HOST = URL(defaults.DECODE_URL).host or "127.0.0.1"
"""llm-d calls the decode engine on localhost; pd-sidecar on its default decode URL's host."""
POOL_GROUPS = ("inference.networking.k8s.io", "inference.networking.x-k8s.io")
"""The InferencePool API groups the pool watch knows (sidecar.security.poolwatch)."""
STAGES = ("prefiller", "decoder", "encoder")
# The values controller-runtime's zap flags take (pkg/log/zap/flags.go, v0.23.3, llm-d's), in
# any case (it lowercases them).
_ZAP_LEVELS = {
    # zap's "debug" is logr's V(1), below llm-d's own debug logging (V(4)): the model-service
    # chart's default --zap-log-level=debug is per-request-free INFO here, as it is in llm-d.
    "debug": "INFO",
    "info": "INFO",
    "error": "ERROR",
    "panic": "ERROR",
}
_ZAP_ENCODERS = ("json", "console")
_ZAP_STACKTRACE_LEVELS = ("info", "error", "panic")
_ZAP_TIME_ENCODINGS = ("epoch", "millis", "nanos", "iso8601", "rfc3339", "rfc3339nano")
_ZAP_FORMATS = {
    "zap-encoder": _ZAP_ENCODERS,
    "zap-stacktrace-level": _ZAP_STACKTRACE_LEVELS,
    "zap-time-encoding": _ZAP_TIME_ENCODINGS,
}
_VERBOSE_DEBUG = 4
"""llm-d's verbosity of debug logging (logutil.DEBUG): -v 4 and above is DEBUG here."""


@dataclass(slots=True)
class Translation:
    """What the flags ask for: ``settings`` (``Settings`` keyword arguments, above the
    environment), a self-signed certificate to make, and notes to log at start."""

    settings: dict[str, Any] = field(default_factory=dict)
    self_signed: bool = False
    """Serve HTTPS with a certificate made at start (``--secure-proxy`` without ``--cert-path``)."""
    notes: list[str] = field(default_factory=list)


def translate(argv: Sequence[str], environ: Mapping[str, str]) -> Translation:
    """The ``Settings`` overrides, certificate and notes that llm-d flags ``argv`` ask for;
    ``FlagError`` for what cannot be honoured."""
    values = parse(argv)
    out = Translation()
    _refuse_non_defaults(values)
    _listener(values, environ, out)
    _connector(values, out)
    _engines(values, environ, out)
    _allowlist(values, environ, out)
    _prefill_retries(values, out)
    _logging(values, out)
    _accepted(values, environ, out)
    return out


def _refuse_non_defaults(values: Mapping[str, Value]) -> None:
    for name, value in values.items():
        flag = BY_NAME[name]
        if flag.only_default and value != flag.default:
            raise FlagError(f"--{name}={_shown(value)} cannot be honoured: {flag.only_default}")


def _shown(value: Value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float):
        return f"{value:g}s"
    return str(value)


def _port(values: Mapping[str, Value], name: str, ranks: int = 1) -> int | None:
    port = values.get(name)
    if port is None:
        return None
    assert isinstance(port, int)
    if port < 1 or port + ranks - 1 > 65535:
        what = f"{port}" if ranks == 1 else f"{port}-{port + ranks - 1}"
        raise FlagError(f"--{name}: port {what} is outside 1-65535")
    return port


def _listener(values: Mapping[str, Value], environ: Mapping[str, str], out: Translation) -> None:
    port = _port(values, "port")
    if port is not None:
        out.settings["port"] = port
    _tls_version(values, out)
    secure, cert_path = _secure(values), values.get("cert-path")
    if secure is False:
        out.settings["tls_cert_file"] = None
        out.settings["tls_key_file"] = None
        if cert_path:
            out.notes.append(f"--cert-path={cert_path} is unused: --secure-proxy=false")
    elif cert_path:
        directory = str(cert_path).rstrip("/") or "/"
        out.settings["tls_cert_file"] = f"{directory}/tls.crt"
        out.settings["tls_key_file"] = f"{directory}/tls.key"
    elif secure is True and _env_certificate(environ):
        out.notes.append(
            "--secure-proxy: serving HTTPS with SIDECAR_TLS_CERT_FILE and SIDECAR_TLS_KEY_FILE "
            "(no self-signed certificate)"
        )
    elif secure is True:
        out.self_signed = True
        out.notes.append(
            "--secure-proxy without --cert-path: serving HTTPS with a self-signed certificate "
            "made at start (clients cannot verify it; mount a Secret and pass --cert-path)"
        )
    elif not _env_certificate(environ):
        out.notes.append(
            "no --secure-proxy: serving plain HTTP (llm-d's sidecar would serve HTTPS with a "
            "self-signed certificate; pass --secure-proxy=true for that)"
        )


def _secure(values: Mapping[str, Value]) -> Value | None:
    """--secure-serving, or its older name --secure-proxy (llm-d binds both to one switch)."""
    given = {name: values[name] for name in ("secure-serving", "secure-proxy") if name in values}
    if len(set(given.values())) > 1:
        raise FlagError(
            "--secure-serving and --secure-proxy (its older name) say different things: give "
            "--secure-serving alone"
        )
    return next(iter(given.values()), None)


_TLS_VERSIONS = {"VersionTLS12": "1.2", "VersionTLS13": "1.3"}


def _tls_version(values: Mapping[str, Value], out: Translation) -> None:
    version = values.get("tls-min-version")
    if version is None or version == "":
        return
    if version in ("VersionTLS10", "VersionTLS11"):
        raise FlagError(
            f"--tls-min-version={version} cannot be honoured: pd-sidecar serves TLS 1.2 at "
            "least (llm-d refuses it too): VersionTLS12 or VersionTLS13"
        )
    if version not in _TLS_VERSIONS:
        raise FlagError(f"--tls-min-version={version}: expected VersionTLS12 or VersionTLS13")
    out.settings["tls_min_version"] = _TLS_VERSIONS[str(version)]


def _env_certificate(environ: Mapping[str, str]) -> bool:
    """Whether the operator gave the listener a certificate through the environment (an
    incomplete pair is ``Settings``' to refuse)."""
    names = ("SIDECAR_TLS_CERT_FILE", "SIDECAR_TLS_KEY_FILE")
    return any(environ.get(name, "").strip() for name in names)


_CONNECTORS = {"nixlv2": "nixl", "sglang": "sglang", "shared-storage": "shared-storage"}
_OLD_CONNECTORS = {"lmcache": "shared-storage"}
"""Older llm-d's lmcache protocol (prefill with max_tokens 1, then the untouched request to the
decode) is the one pd-sidecar calls shared-storage."""
_REFUSED_CONNECTORS = {
    "mooncake": "pd-sidecar does not speak vLLM's MooncakeConnector protocol: run the engines "
    "with NixlConnector (--kv-connector=nixlv2); SGLang engines, whatever their transfer "
    "backend (Mooncake included), are --kv-connector=sglang",
    "offloading": NOT_OFFLOADING,
    "nixl": "llm-d's first NIXL protocol (before vLLM's NixlConnector v2) is gone from vLLM: "
    "use --kv-connector=nixlv2",
}


def _connector(values: Mapping[str, Value], out: Translation) -> None:
    # llm-d: --kv-connector wins; the older --connector applies when it is not given.
    name = "kv-connector" if "kv-connector" in values else "connector"
    if name not in values:
        return
    text = str(values[name]).strip().lower()
    if text in _REFUSED_CONNECTORS:
        raise FlagError(f"--{name}={text} cannot be honoured: {_REFUSED_CONNECTORS[text]}")
    known = _CONNECTORS | (_OLD_CONNECTORS if name == "connector" else {})
    if text not in known:
        raise FlagError(f"--{name}={text}: expected one of {', '.join(known)}")
    out.settings["connector"] = known[text]


def _stages(values: Mapping[str, Value], flag: str, prefiller: str, decoder: str) -> set[str]:
    """The stages a list flag and its two older boolean flags name."""
    stages = set(values.get(flag, ()))  # type: ignore[arg-type]
    unknown = sorted(stages - set(STAGES))
    if unknown:
        raise FlagError(f"--{flag}={','.join(unknown)}: stages are {', '.join(STAGES)}")
    if values.get(prefiller):
        stages.add("prefiller")
    if values.get(decoder):
        stages.add("decoder")
    return stages


def _engines(values: Mapping[str, Value], environ: Mapping[str, str], out: Translation) -> None:
    tls = _stages(values, "enable-tls", "prefiller-use-tls", "decoder-use-tls")
    if "encoder" in tls:
        raise FlagError(
            "--enable-tls=encoder cannot be honoured: pd-sidecar has no encoder stage; name "
            "prefiller and decoder only"
        )
    tls_given = any(name in values for name in ("enable-tls", "prefiller-use-tls"))
    if tls_given:
        out.settings["prefill_tls"] = "prefiller" in tls
        _pool_schemes(values, environ, "prefiller" in tls)
    _decode_ranks(values, environ, "decoder" in tls, out)
    _skip_verify(values, environ, out)


def _pool_schemes(values: Mapping[str, Value], environ: Mapping[str, str], https: bool) -> None:
    """SIDECAR_PREFILL_ENDPOINTS entries written as URLs must say what the flags say of the
    prefill stage; the refusal names the flag, which wins over SIDECAR_PREFILL_TLS."""
    wanted = "https" if https else "http"
    entries = [item.strip() for item in environ.get("SIDECAR_PREFILL_ENDPOINTS", "").split(",")]
    wrong = [
        item
        for item in entries
        if (scheme := split_scheme(item)[0]) in ("http", "https") and scheme != wanted
    ]
    if not wrong:
        return
    flag = "--enable-tls" if "enable-tls" in values else "--prefiller-use-tls"
    if https:
        raise FlagError(
            f"SIDECAR_PREFILL_ENDPOINTS names {', '.join(wrong)} but {flag} calls every prefill "
            "engine over HTTPS: write https:// or host:port"
        )
    raise FlagError(
        f"SIDECAR_PREFILL_ENDPOINTS names {', '.join(wrong)}, but {flag} without prefiller "
        "calls the prefill engines over plain HTTP: add --enable-tls=prefiller, or write "
        "host:port"
    )


def _decode_ranks(
    values: Mapping[str, Value], environ: Mapping[str, str], https: bool, out: Translation
) -> None:
    ranks = values.get("data-parallel-size", 1)
    assert isinstance(ranks, int)
    if ranks < 1:
        raise FlagError(f"--data-parallel-size must be 1 or more, not {ranks}")
    # llm-d: --model-server-port wins over the older --vllm-port.
    name = "model-server-port" if "model-server-port" in values else "vllm-port"
    port = _port(values, name, ranks)
    if port is None and "data-parallel-size" not in values and not https:
        return  # the decode engine is left to SIDECAR_DECODE_URL(S)
    base = LLMD_MODEL_SERVER_PORT if port is None else port
    if base + ranks - 1 > 65535:
        raise FlagError(f"--data-parallel-size={ranks}: rank ports run past 65535")
    scheme = "https" if https else "http"
    urls = tuple(f"{scheme}://{DECODE_HOST}:{base + rank}" for rank in range(ranks))
    if ranks == 1:
        out.settings["decode_url"] = urls[0]
        out.settings["decode_urls"] = ()
        return
    if environ.get("SIDECAR_DECODE_URL", "").strip():
        raise FlagError(
            f"--data-parallel-size={ranks} names the decode ranks, and SIDECAR_DECODE_URL one "
            "engine: unset SIDECAR_DECODE_URL"
        )
    out.settings["decode_urls"] = urls
    # As llm-d: rank r served on --port + r, rank 0 on --port.
    out.settings["rank_ports"] = True


def _skip_verify(values: Mapping[str, Value], environ: Mapping[str, str], out: Translation) -> None:
    """Each stage the flags name skips verification, each stage they do not name verifies (as
    in llm-d): the stage settings, over SIDECAR_TLS_INSECURE_SKIP_VERIFY, so that naming one
    stage never widens to the other. Whether a stage is called over TLS is decided on the
    effective settings, the environment included."""
    names = (
        "tls-insecure-skip-verify",
        "prefiller-tls-insecure-skip-verify",
        "decoder-tls-insecure-skip-verify",
    )
    if not any(name in values for name in names):
        return
    skip = _stages(values, *names)
    over_tls = {
        stage
        for stage, https in (
            ("prefiller", _prefill_tls(out, environ)),
            ("decoder", _decode_tls(out, environ)),
        )
        if https
    }
    idle = sorted(skip - over_tls - {"encoder"})
    if idle:
        out.notes.append(
            f"--tls-insecure-skip-verify={','.join(idle)}: that stage is not called over TLS, "
            "there is no certificate to verify"
        )
    for stage, setting in (
        ("prefiller", "prefill_tls_insecure_skip_verify"),
        ("decoder", "decode_tls_insecure_skip_verify"),
    ):
        # A stage over plain HTTP gets no setting: Settings refuses one it cannot apply.
        if stage in over_tls:
            out.settings[setting] = stage in skip


def _prefill_tls(out: Translation, environ: Mapping[str, str]) -> bool:
    """Whether the prefill engines are called over TLS: the flags' word, else the variable's."""
    if "prefill_tls" in out.settings:
        return bool(out.settings["prefill_tls"])
    return _env_bool(environ.get("SIDECAR_PREFILL_TLS", ""))


def _decode_tls(out: Translation, environ: Mapping[str, str]) -> bool:
    """Whether a decode rank is called over TLS: the flags' URLs, else the variables'."""
    if "decode_url" in out.settings or "decode_urls" in out.settings:
        urls = [out.settings.get("decode_url", ""), *out.settings.get("decode_urls", ())]
    else:
        urls = [
            environ.get("SIDECAR_DECODE_URL", ""),
            *environ.get("SIDECAR_DECODE_URLS", "").split(","),
        ]
    return any(str(url).strip().lower().startswith("https://") for url in urls)


def _env_bool(text: str) -> bool:
    """A boolean variable as pydantic reads it (a value it refuses is Settings' to report)."""
    try:
        return TypeAdapter(bool).validate_python(text.strip() or False)
    except ValidationError:
        return False


def _allowlist(values: Mapping[str, Value], environ: Mapping[str, str], out: Translation) -> None:
    group = values.get("pool-group")
    if group is not None and group not in POOL_GROUPS:
        raise FlagError(
            f"--pool-group={group} cannot be honoured: pd-sidecar watches InferencePools of "
            f"{' and '.join(POOL_GROUPS)} only"
        )
    if group is not None:
        out.settings["inference_pool_group"] = group
    if not values.get("enable-ssrf-protection"):
        pool_flags = ("inference-pool", "inference-pool-namespace", "inference-pool-name")
        given = [f"--{name}" for name in pool_flags if name in values]
        if given:
            out.notes.append(
                f"{', '.join(given)}: used only with --enable-ssrf-protection (as in llm-d)"
            )
        return
    # llm-d: --inference-pool (or INFERENCE_POOL) wins over the older namespace and name.
    pool = str(values.get("inference-pool", environ.get("INFERENCE_POOL", ""))).strip()
    if pool:
        namespace, sep, name = pool.partition("/")
        if not sep:
            namespace, name = "default", pool
    else:
        namespace = str(
            values.get("inference-pool-namespace", environ.get("INFERENCE_POOL_NAMESPACE", ""))
        ).strip()
        name = str(
            values.get("inference-pool-name", environ.get("INFERENCE_POOL_NAME", ""))
        ).strip()
    if not namespace or not name:
        raise FlagError(
            "--enable-ssrf-protection needs its InferencePool: --inference-pool (namespace/name, "
            "or a name in the default namespace) or the INFERENCE_POOL variable"
        )
    out.settings["inference_pool"] = f"{namespace}/{name}"


def _prefill_retries(values: Mapping[str, Value], out: Translation) -> None:
    retries = values.get("prefill-max-retries")
    if retries is not None:
        assert isinstance(retries, int)
        if retries < 0:
            raise FlagError(f"--prefill-max-retries must be 0 or more, not {retries}")
        out.settings["prefill_retries"] = retries
    backoff = values.get("prefill-retry-backoff")
    if backoff is not None:
        assert isinstance(backoff, float)
        if backoff < 0:
            raise FlagError(f"--prefill-retry-backoff must not be negative, not {backoff:g}s")
        out.settings["prefill_retry_backoff_s"] = backoff
        out.notes.append(
            f"--prefill-retry-backoff={backoff:g}s: the first retry waits that long and each "
            "next one twice the one before (llm-d waits the same before every retry)"
        )


def _logging(values: Mapping[str, Value], out: Translation) -> None:
    level: str | None = None
    verbosity = values.get("v")
    if isinstance(verbosity, int):
        level = "DEBUG" if verbosity >= _VERBOSE_DEBUG else "INFO"
    if values.get("zap-devel") and level is None:
        level = _ZAP_LEVELS["debug"]  # zap's development mode: its debug level, V(1)
    zap_level = values.get("zap-log-level")
    if zap_level is not None:
        level = _zap_level(str(zap_level))
    if level is not None:
        out.settings["log_level"] = level
    for name, allowed in _ZAP_FORMATS.items():
        value = values.get(name)
        if value is not None and str(value).lower() not in allowed:
            raise FlagError(f"--{name}={value}: expected one of {', '.join(allowed)}")
    given = [f"--{name}" for name in _ZAP_FORMATS if name in values]
    if given:
        out.notes.append(
            f"{', '.join(given)}: pd-sidecar writes its own text log lines (time, level, "
            "logger, message; a logged exception with its traceback)"
        )


def _metrics_cert_dir(values: Mapping[str, Value], out: Translation) -> None:
    """llm-d serves --metrics-port over HTTPS with the certificate of --metrics-cert-dir;
    pd-sidecar's admin port can serve the listener's certificate only."""
    directory = str(values.get("metrics-cert-dir", "")).rstrip("/")
    if not directory:
        return
    cert_path = str(values.get("cert-path", "")).rstrip("/")
    if directory != cert_path or _secure(values) is False:
        raise FlagError(
            f"--metrics-cert-dir={values['metrics-cert-dir']} cannot be honoured: pd-sidecar's "
            "admin port serves the listener's certificate only (SIDECAR_ADMIN_TLS): pass the "
            "same directory as --cert-path, or remove it for plain HTTP"
        )
    if "admin_port" in out.settings:
        out.settings["admin_tls"] = True
    else:
        out.notes.append(
            f"--metrics-cert-dir={values['metrics-cert-dir']}: unused without --metrics-port "
            "(the metrics are served on --port)"
        )


def _zap_level(text: str) -> str:
    # controller-runtime: a level name in any case, else strconv.Atoi's decimal integer.
    lowered = text.lower()
    if lowered in _ZAP_LEVELS:
        return _ZAP_LEVELS[lowered]
    verbosity = go_int(text, base=10)
    if verbosity is None:
        raise FlagError(
            f"--zap-log-level={text}: expected debug, info, error, panic or an integer above 0"
        )
    if verbosity <= 0:
        raise FlagError(f"--zap-log-level={text}: an integer level must be above 0")
    return "DEBUG" if verbosity >= _VERBOSE_DEBUG else "INFO"


def _accepted(values: Mapping[str, Value], environ: Mapping[str, str], out: Translation) -> None:
    """Flags honoured as they stand, or with a difference worth a note."""
    if values.get("tracing") is not None:
        out.settings["tracing"] = values["tracing"]
    metrics = values.get("metrics-port")
    if isinstance(metrics, int) and metrics:
        out.settings["admin_port"] = _port(values, "metrics-port")
        # llm-d's metrics port is plain HTTP, whatever --secure-proxy says; an operator's own
        # SIDECAR_ADMIN_TLS still decides.
        if not environ.get("SIDECAR_ADMIN_TLS", "").strip():
            out.settings["admin_tls"] = False
    _metrics_cert_dir(values, out)
    if "max-idle-conns-per-host" in values:
        out.notes.append(
            "--max-idle-conns-per-host: pd-sidecar keeps every idle engine connection, each "
            "closed after SIDECAR_ENGINE_KEEPALIVE_S"
        )
    # llm-d reads ENABLE_PREFILLER_SAMPLING as the flag's default (strconv.ParseBool; a value
    # it cannot parse is no default).
    sampling = values.get("enable-prefiller-sampling")
    if sampling is None:
        sampling = GO_BOOL.get(environ.get("ENABLE_PREFILLER_SAMPLING", "").strip())
    if sampling is not None:
        out.settings["prefill_header_sampling"] = sampling
