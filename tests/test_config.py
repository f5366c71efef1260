"""Settings: defaults, environment parsing, exit status 2, --help and the docs in step."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sidecar.__main__ import load_settings
from sidecar.config import (
    Settings,
    describe_fields,
    explain,
    nearest_setting,
    unknown_variables,
)
from sidecar.fleet.endpoints import Endpoint
from sidecar.inject import environment
from sidecar.inject.environment import EnvError
from tests.imports import imported

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(variables)
    return env


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SIDECAR_"):
            monkeypatch.delenv(name)
    settings = Settings()
    assert (settings.host, settings.port) == (("0.0.0.0", "::"), 8000)
    assert settings.decode_url == "http://127.0.0.1:8200"
    assert settings.connector == "nixl"
    assert settings.prefill_endpoints == ()
    assert settings.max_body_bytes == 33554432
    assert settings.debug_history == 1000
    assert settings.ready_interval_s == 2
    assert settings.rewrite_remote_host is False


def test_environment_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDECAR_PREFILL_ENDPOINTS", " p0:8000, [::1]:8001 ,http://127.0.0.3:8002")
    monkeypatch.setenv("SIDECAR_CONNECTOR", "nixlv2")
    monkeypatch.setenv("SIDECAR_DECODE_URL", "http://localhost:9000/")
    monkeypatch.setenv("SIDECAR_REWRITE_REMOTE_HOST", "true")
    settings = Settings()
    assert settings.prefill_endpoints == (
        Endpoint("p0", 8000),
        Endpoint("::1", 8001),
        Endpoint("127.0.0.3", 8002),
    )
    assert settings.connector == "nixl"
    assert settings.decode_url == "http://localhost:9000"
    assert settings.rewrite_remote_host is True


INVALID = [
    ("SIDECAR_PORT", "eighty"),
    ("SIDECAR_PORT", "70000"),
    ("SIDECAR_DECODE_URL", "ftp://engine:1"),
    ("SIDECAR_DECODE_URL", "http://engine:1/v1"),
    ("SIDECAR_DECODE_URLS", "http://rank0:8200,ftp://rank1:8201"),
    ("SIDECAR_CONNECTOR", "carrier-pigeon"),
    ("SIDECAR_PREFILL_ENDPOINTS", "p0:8000,p1"),
    ("SIDECAR_MAX_BODY_BYTES", "0"),
    ("SIDECAR_MAX_PREFILL_ANSWER_BYTES", "0"),
    ("SIDECAR_MAX_BODY_ELEMENTS", "0"),
    ("SIDECAR_BODY_BUDGET_BYTES", "1024"),  # below SIDECAR_MAX_BODY_BYTES
    ("SIDECAR_DEBUG_HISTORY", "-1"),
    ("SIDECAR_READY_INTERVAL_S", "0"),
    ("SIDECAR_CONNECT_TIMEOUT_S", "soon"),
    ("SIDECAR_ENGINE_KEEPALIVE_S", "0"),
    ("SIDECAR_REWRITE_REMOTE_HOST", "perhaps"),
    ("SIDECAR_LOG_LEVEL", "LOUD"),
    ("SIDECAR_LOG_REQUESTS", "2"),
    ("SIDECAR_GC_GEN0_THRESHOLD", "0"),
    ("SIDECAR_PREFILL_DNS", "service-without-port"),
    ("SIDECAR_SCHEDULER_POLICY", "fastest"),
    ("SIDECAR_SCHEDULER_CHOICES", "0"),
    ("SIDECAR_SPEED_HALF_LIFE_S", "0"),
    ("SIDECAR_SPEED_IDLE_HALF_LIFE_S", "0"),
    ("SIDECAR_SCHEDULER_RETEST_S", "-1"),
    ("SIDECAR_SCHEDULER_SEED", "x"),
    ("SIDECAR_DISAGG_MIN_TOKENS", "-5"),
    ("SIDECAR_DISAGG_TTFT_RATIO", "0"),
    ("SIDECAR_STATE_BACKEND", "etcd"),
    ("SIDECAR_STATE_LEASE_S", "0"),
    ("SIDECAR_SHARED_SCRAPES", "sometimes"),
    ("SIDECAR_STATE_RESERVATIONS", "both"),
    ("SIDECAR_SCRAPES_PER_ENDPOINT", "0"),
    ("SIDECAR_STATE_TIMEOUT_MS", "-1"),
    ("SIDECAR_EJECT_AFTER_FAILURES", "0"),
    ("SIDECAR_SCRAPE_INTERVAL_S", "0"),
    ("SIDECAR_DISCOVERY_INTERVAL_S", "never"),
    ("SIDECAR_PREFIX_BLOCK_TOKENS", "0"),
    ("SIDECAR_REDIS_KEY_PREFIX", ""),
    ("SIDECAR_HOST", ""),
    ("SIDECAR_HOST", "0.0.0.0,not a host"),
    ("SIDECAR_HOST", "::,[::]"),  # listed twice
    ("SIDECAR_READY_FAILURE_THRESHOLD", "0"),
    ("SIDECAR_READY_SUCCESS_THRESHOLD", "0"),
    ("SIDECAR_ADMIN_PORT", "x"),
    ("SIDECAR_PREFILL_RETRIES", "-1"),
    ("SIDECAR_PREFILL_RETRY_BACKOFF_S", "-1"),
    ("SIDECAR_PREFILL_FALLBACK", "maybe"),
    ("SIDECAR_SGLANG_BOOTSTRAP_PORT", "0"),
    ("SIDECAR_PREFILL_TIMEOUT_S", "0"),
    ("SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S", "0"),
    ("SIDECAR_STREAM_IDLE_TIMEOUT_S", "0"),
    ("SIDECAR_REQUEST_TIMEOUT_S", "-1"),
    ("SIDECAR_CLIENT_BODY_TIMEOUT_S", "0"),
    ("SIDECAR_CLIENT_HEADER_TIMEOUT_S", "0"),
    ("SIDECAR_CLIENT_KEEPALIVE_S", "-5"),
    ("SIDECAR_MAX_CONNECTIONS", "0"),
    ("SIDECAR_RELEASE_ON_DISCONNECT", "maybe"),
    ("SIDECAR_PREFILL_ALLOWED_CIDRS", "10.0.0.0/33"),
    ("SIDECAR_PREFILL_ALLOWED_HOSTS", "good.host,bad host"),
    ("SIDECAR_DRAIN_TIMEOUT_S", "-1"),
    ("SIDECAR_REDIS_URL", "http://redis:6379"),
    ("SIDECAR_REDIS_CLUSTER", "perhaps"),
    ("SIDECAR_EJECT_BASE_S", "0"),
    ("SIDECAR_EJECT_MAX_S", "0"),
    ("SIDECAR_PREFIX_CACHE_BLOCKS", "-1"),
    ("SIDECAR_PREFILL_PREFIX_INDEX", "maybe"),
    ("SIDECAR_DISAGG_STALL_WEIGHT", "-1"),
    ("SIDECAR_DISAGG_TPOT_SLO_MS", "-1"),
    ("SIDECAR_DISAGG_TPOT_SLO_MS", "inf"),
    ("SIDECAR_DISAGG_TPOT_SLO_MS", "0.05"),  # seconds typed for milliseconds
    ("SIDECAR_DISAGG_STALL_BURST_S", "-1"),
    ("SIDECAR_DISAGG_STALL_BURST_S", "inf"),
    ("SIDECAR_PREFILL_PREFIX_BLOCK_TOKENS", "0"),
    ("SIDECAR_PREFILL_CACHE_TOKENS", "-1"),
    ("SIDECAR_PREFILL_PREFIX_TRUST", "1.5"),
    ("SIDECAR_PREFIX_INDEX_MEMORY_MIB", "0"),
    ("SIDECAR_PREFIX_HASH_KEY", "short"),
    ("SIDECAR_PREFILL_ON_DISCONNECT", "later"),
    ("SIDECAR_PREFILL_HEADERS", "x-prefill-endpoint,bad header"),
    ("SIDECAR_PREFILL_HEADER_SAMPLING", "sometimes"),
    ("SIDECAR_TLS_CERT_FILE", "/etc/tls/tls.crt"),  # without its key
    ("SIDECAR_TLS_KEY_FILE", "/etc/tls/tls.key"),  # without its certificate
    ("SIDECAR_ADMIN_TLS", "perhaps"),
    ("SIDECAR_TLS_MIN_VERSION", "1.1"),
    ("SIDECAR_TLS_RELOAD_INTERVAL_S", "0"),
    ("SIDECAR_PREFILL_TLS", "perhaps"),
    ("SIDECAR_PREFILL_TLS_SERVER_NAME", "not a name"),
    ("SIDECAR_TLS_CA_FILE", "/etc/ca.pem"),  # no engine over HTTPS
    ("SIDECAR_TLS_CLIENT_CERT_FILE", "/etc/client.crt"),  # without its key
    ("SIDECAR_TLS_CLIENT_KEY_FILE", "/etc/client.key"),  # without its certificate
    ("SIDECAR_TLS_INSECURE_SKIP_VERIFY", "true"),  # no engine over HTTPS
    ("SIDECAR_RANK_PORTS", "perhaps"),
    ("SIDECAR_PREFILL_TLS_INSECURE_SKIP_VERIFY", "true"),  # the prefill engines over HTTP
    ("SIDECAR_DECODE_TLS_INSECURE_SKIP_VERIFY", "true"),  # the decode engine over HTTP
    ("SIDECAR_INFERENCE_POOL", "pd-llm"),  # no namespace
    ("SIDECAR_INFERENCE_POOL_GROUP", "example.com"),
    ("SIDECAR_KUBE_API_URL", "kubernetes.default.svc"),
    ("SIDECAR_KUBE_TOKEN_FILE", ""),
    ("SIDECAR_KUBE_CA_FILE", ""),
    ("SIDECAR_KUBE_RETRY_BASE_S", "0"),
    ("SIDECAR_KUBE_RETRY_MAX_S", "0"),
    ("SIDECAR_TRACING", "perhaps"),
    ("SIDECAR_KV_EVENTS", "perhaps"),
    ("SIDECAR_KV_EVENTS_PORT", "0"),
    ("SIDECAR_KV_EVENTS_REPLAY_PORT", "70000"),
    ("SIDECAR_KV_EVENTS_TOPIC", "t" * 257),
    ("SIDECAR_KV_EVENTS_PREFILL_DP_SIZE", "0"),
    ("SIDECAR_KV_EVENTS_DECODE_PORT", "65536"),
    ("SIDECAR_KV_EVENTS_DECODE_REPLAY_PORT", "5557"),  # the events port: they would collide
    ("SIDECAR_KV_EVENTS_CPU_WEIGHT", "1.5"),
    ("SIDECAR_KV_EVENTS_STORAGE_WEIGHT", "-0.1"),
    ("SIDECAR_KV_EVENTS_TOKENIZE_TIMEOUT_MS", "0"),
    ("SIDECAR_KV_EVENTS_MAX_BLOCKS", "1048576"),
]
"""One invalid value per setting (a test checks that none is missing)."""


@pytest.mark.parametrize(("variable", "value"), INVALID)
def test_invalid_value_exits_2_naming_the_variable(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("SIDECAR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        load_settings()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert variable in lines[0]


def test_finish_without_releases_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("SIDECAR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SIDECAR_PREFILL_ON_DISCONNECT", "finish")
    monkeypatch.setenv("SIDECAR_RELEASE_ON_DISCONNECT", "false")
    with pytest.raises(SystemExit) as exit_info:
        load_settings()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "SIDECAR_PREFILL_ON_DISCONNECT" in error
    assert "SIDECAR_RELEASE_ON_DISCONNECT=true" in error
    # Either alone is fine.
    monkeypatch.delenv("SIDECAR_RELEASE_ON_DISCONNECT")
    assert load_settings().release_on_disconnect
    monkeypatch.setenv("SIDECAR_RELEASE_ON_DISCONNECT", "false")
    monkeypatch.delenv("SIDECAR_PREFILL_ON_DISCONNECT")
    assert load_settings().prefill_on_disconnect == "auto"


CONTRADICTIONS = [
    # (two settings that contradict each other, what the line says, a second value that agrees)
    (
        {"SIDECAR_EJECT_BASE_S": "120", "SIDECAR_EJECT_MAX_S": "60"},
        "below SIDECAR_EJECT_BASE_S",
        "120",
    ),
    ({"SIDECAR_PORT": "8000", "SIDECAR_ADMIN_PORT": "8000"}, "is SIDECAR_PORT too", "8001"),
    (
        {"SIDECAR_CONNECTOR": "sglang", "SIDECAR_PREFILL_FALLBACK": "local"},
        "cannot prefill a prompt itself",
        "fail",
    ),
    (
        {
            "SIDECAR_DECODE_URL": "http://127.0.0.1:8200",
            "SIDECAR_DECODE_URLS": "http://127.0.0.1:8200,http://127.0.0.1:8201",
        },
        "are both set",
        "",
    ),
    (
        {"SIDECAR_REDIS_URL": "unix:///run/redis.sock", "SIDECAR_REDIS_CLUSTER": "true"},
        "reached over TCP",
        "false",
    ),
    (
        {"SIDECAR_REDIS_URL": "redis://redis:6379/3", "SIDECAR_REDIS_CLUSTER": "true"},
        "database 0 only",
        "false",
    ),
    (
        {"SIDECAR_TLS_CERT_FILE": "/etc/tls/tls.crt", "SIDECAR_TLS_KEY_FILE": ""},
        "a certificate needs its key",
        "/etc/tls/tls.key",
    ),
    (
        {"SIDECAR_TLS_CA_FILE": "/etc/ca.pem", "SIDECAR_PREFILL_TLS": "false"},
        "applies to engines called over HTTPS",
        "true",
    ),
    (
        {"SIDECAR_KUBE_RETRY_BASE_S": "60", "SIDECAR_KUBE_RETRY_MAX_S": "30"},
        "below SIDECAR_KUBE_RETRY_BASE_S",
        "60",
    ),
    (
        {"SIDECAR_PREFILL_ENDPOINTS": "https://127.0.0.1:8100", "SIDECAR_PREFILL_TLS": "false"},
        "set SIDECAR_PREFILL_TLS=true to call the prefill engines over HTTPS",
        "true",
    ),
    (
        {"SIDECAR_PREFILL_TLS": "true", "SIDECAR_PREFILL_ENDPOINTS": "http://127.0.0.1:8100"},
        "calls every prefill engine over HTTPS",
        "https://127.0.0.1:8100",
    ),
]


@pytest.mark.parametrize(
    ("variables", "says", "agrees"),
    CONTRADICTIONS,
    ids=[
        "eject",
        "ports",
        "sglang-local",
        "decode-url-and-urls",
        "cluster-unix",
        "cluster-db",
        "tls-key",
        "tls-ca-unused",
        "kube-retry",
        "pool-https-without-tls",
        "pool-http-with-tls",
    ],
)
def test_contradictory_settings_exit_2_naming_both(
    variables: dict[str, str],
    says: str,
    agrees: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(os.environ):
        if name.startswith("SIDECAR_"):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        load_settings()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert all(name in lines[0] for name in variables), lines
    assert says in lines[0]
    monkeypatch.setenv(list(variables)[1], agrees)
    assert isinstance(load_settings(), Settings)


def test_the_prefix_hash_key_is_a_secret_and_empty_means_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SIDECAR_PREFIX_HASH_KEY", "")
    assert Settings().prefix_hash_key is None
    monkeypatch.setenv("SIDECAR_PREFIX_HASH_KEY", "k" * 32)
    settings = Settings()
    assert settings.prefix_hash_key is not None
    assert settings.prefix_hash_key.get_secret_value() == "k" * 32
    assert "k" * 32 not in repr(settings)


def test_decode_ranks_parse_in_order() -> None:
    ranks = Settings(decode_urls=" http://127.0.0.1:8200/, https://rank1:8443 ,http://[::1]:9")
    assert ranks.decode_urls == ("http://127.0.0.1:8200", "https://rank1:8443", "http://[::1]:9")
    assert ranks.decode_ranks == ranks.decode_urls
    # One decode URL, as before: a single rank.
    assert Settings().decode_ranks == ("http://127.0.0.1:8200",)
    assert Settings(decode_url="http://engine:9000/").decode_ranks == ("http://engine:9000",)
    assert Settings(decode_urls="").decode_ranks == ("http://127.0.0.1:8200",)
    for bad in ("http://a:1,http://a:1/", "http://a:1,http://b:2/v1", "http://a:1,b:2"):
        with pytest.raises(ValidationError, match="decode_urls"):
            Settings(decode_urls=bad)
    assert Settings(redis_cluster=True, redis_url="rediss://:secret@redis:6380").redis_cluster
    assert Settings(redis_cluster=True, redis_url="redis://redis:6379/0").redis_cluster


def test_the_fallback_follows_the_connector() -> None:
    assert Settings().prefill_fallback == "local"
    assert Settings(connector="sglang").prefill_fallback == "fail"  # it cannot decode locally
    assert Settings(connector="shared-storage", prefill_fallback="fail").prefill_fallback == "fail"
    assert Settings(connector="nixlv2").connector == "nixl"
    assert Settings(connector="NIXL_PUSH").connector == "nixl-push"


def test_a_pool_entry_may_name_its_bootstrap_port() -> None:
    pool = Settings(prefill_endpoints="p0:8000#9000, [::1]:8001#9001,p2:8002").prefill_endpoints
    assert [(str(e), e.bootstrap_port) for e in pool] == [
        ("p0:8000", 9000),
        ("[::1]:8001", 9001),
        ("p2:8002", None),
    ]
    assert pool[0] == Endpoint("p0", 8000)  # the same address, whatever its bootstrap port
    for bad in ("p0:8000#", "p0:8000#0", "p0:8000#x", "p0:8000#70000"):
        with pytest.raises(ValidationError, match="bootstrap port"):
            Settings(prefill_endpoints=bad)


def test_a_pool_entry_is_host_port_or_a_url_whose_scheme_says_what_prefill_tls_does() -> None:
    address = Endpoint("127.0.0.1", 8100)
    assert Settings(prefill_endpoints="http://127.0.0.1:8100").prefill_endpoints == (address,)
    assert Settings(prefill_endpoints="127.0.0.1:8100/").prefill_endpoints == (address,)
    tls = Settings(prefill_endpoints="https://127.0.0.1:8100, p1:8100#9000", prefill_tls="true")
    assert tls.prefill_endpoints == (address, Endpoint("p1", 8100))
    assert tls.prefill_endpoints[1].bootstrap_port == 9000
    with pytest.raises(ValidationError) as caught:
        Settings(prefill_endpoints="p0:8000,https://127.0.0.1:8100")
    assert explain(caught.value) == (
        "invalid configuration: SIDECAR_PREFILL_ENDPOINTS names https://127.0.0.1:8100: set "
        "SIDECAR_PREFILL_TLS=true to call the prefill engines over HTTPS (it applies to every "
        "one of them), or write host:port"
    )
    with pytest.raises(ValidationError) as caught:
        Settings(prefill_endpoints="http://127.0.0.1:8100", prefill_tls=True)
    assert "SIDECAR_PREFILL_TLS=true calls every prefill engine over HTTPS" in explain(caught.value)
    # A wrong SIDECAR_PREFILL_TLS is reported as such, not as a scheme that disagrees with it.
    with pytest.raises(ValidationError) as caught:
        Settings(prefill_endpoints="https://127.0.0.1:8100", prefill_tls="perhaps")
    assert explain(caught.value).startswith("invalid configuration: SIDECAR_PREFILL_TLS: ")


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("http://127.0.0.1:8100/v1", "without a path (/v1)"),
        ("https://127.0.0.1:8100/v1/completions", "without a path (/v1/completions)"),
        ("ftp://127.0.0.1:8100", "expected host:port, not a URL of scheme ftp"),
        ("127.0.0.1", "missing port"),
        ("http://127.0.0.1:8100?x", "with no query string (?x)"),
    ],
)
def test_a_pool_entry_is_refused_saying_what_is_wrong_with_it(entry: str, says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(prefill_endpoints=entry, prefill_tls=entry.startswith("https"))
    message = explain(caught.value)
    assert message.startswith(f"invalid configuration: SIDECAR_PREFILL_ENDPOINTS: {entry!r}: ")
    assert says in message


@pytest.mark.parametrize(
    "entry", ["http://127.0.0.1:8100?x", "https://127.0.0.1:8100?x=1", "127.0.0.1:8100?x"]
)
def test_a_pool_entry_with_a_query_string_says_so(entry: str) -> None:
    """Whatever SIDECAR_PREFILL_TLS says: not a port error, nor a scheme that disagrees."""
    with pytest.raises(ValidationError) as caught:
        Settings(prefill_endpoints=entry)
    message = explain(caught.value)
    assert message.startswith(f"invalid configuration: SIDECAR_PREFILL_ENDPOINTS: {entry!r}: ")
    assert "with no query string" in message


def test_an_unknown_variable_is_warned_about_naming_the_nearest_setting() -> None:
    environ = {
        "SIDECAR_PREFILL_URLS": "127.0.0.1:8100",  # another proxy's word for ours
        "SIDECAR_DECODE_ENDPOINT": "http://127.0.0.1:8200",
        "SIDECAR_PREFIL_ENDPOINTS": "127.0.0.1:8100",  # a typo
        "SIDECAR_LOGLEVEL": "DEBUG",
        "SIDECAR_TLS_CERT": "/etc/tls/tls.crt",
        "SIDECAR_WIDGETS": "3",  # near nothing
        "SIDECAR_SERVICE_HOST": "127.0.0.31",  # the kubelet's, for a Service named sidecar
        "SIDECAR_PORT_8000_TCP_ADDR": "127.0.0.31",
        "SIDECAR_PORT": "8000",  # settings, whatever the case of the rest of the name
        "SIDECAR_Log_Requests": "true",
        "PATH": "/usr/bin",
    }
    assert unknown_variables(environ) == [
        "ignoring unknown variable SIDECAR_DECODE_ENDPOINT: did you mean SIDECAR_DECODE_URL?",
        "ignoring unknown variable SIDECAR_LOGLEVEL: did you mean SIDECAR_LOG_LEVEL?",
        "ignoring SIDECAR_PORT_8000_TCP_ADDR: Kubernetes sets it for a Service named sidecar "
        "(enableServiceLinks: false in the pod spec leaves it out)",
        "ignoring unknown variable SIDECAR_PREFILL_URLS: did you mean SIDECAR_PREFILL_ENDPOINTS?",
        "ignoring unknown variable SIDECAR_PREFIL_ENDPOINTS: did you mean "
        "SIDECAR_PREFILL_ENDPOINTS?",
        "ignoring SIDECAR_SERVICE_HOST: Kubernetes sets it for a Service named sidecar "
        "(enableServiceLinks: false in the pod spec leaves it out)",
        "ignoring unknown variable SIDECAR_TLS_CERT: did you mean SIDECAR_TLS_CERT_FILE?",
        "ignoring unknown variable SIDECAR_WIDGETS (see --help)",
    ]
    # Only warnings: the settings themselves load with every one of them set.
    assert unknown_variables({"SIDECAR_PORT": "8000"}) == []


def test_a_budget_below_the_largest_body_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(max_body_bytes=2048, body_budget_bytes=1024)
    message = explain(caught.value)
    assert "SIDECAR_BODY_BUDGET_BYTES (1024)" in message
    assert "SIDECAR_MAX_BODY_BYTES (2048)" in message
    assert Settings(max_body_bytes=2048, body_budget_bytes=2048).body_budget_bytes == 2048


def test_prefill_headers_parse_in_order_lowercased() -> None:
    assert Settings().prefill_headers == ("x-prefiller-host-port", "x-gateway-prefill-endpoints")
    parsed = Settings(prefill_headers="X-Prefill-Endpoint, x-prefiller-host-port")
    assert parsed.prefill_headers == ("x-prefill-endpoint", "x-prefiller-host-port")
    assert Settings(prefill_headers="").prefill_headers == ()


def test_importing_the_settings_loads_neither_aiohttp_nor_redis() -> None:
    """``config.py`` imports only the fleet's vocabulary: what reads or checks settings without
    serving (``--help``, the llm-d flags) does not load the engine client or the Redis client."""
    loaded = imported("-c", "import sidecar.config")
    assert {"pydantic_settings", "sidecar.config", "sidecar.fleet.connectors"} <= loaded
    assert "aiohttp" not in loaded
    assert "redis" not in loaded


def test_every_setting_has_an_invalid_case() -> None:
    assert {name for name, _ in INVALID} == {name for name, _, _ in describe_fields()}


@pytest.mark.system
def test_the_process_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar"],
        env=_clean_env(SIDECAR_PORT="eighty"),
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("pd-sidecar: invalid configuration: SIDECAR_PORT")


@pytest.mark.system
def test_help_lists_every_setting_with_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "--help"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    for variable, default, _ in describe_fields():
        assert re.search(rf"{variable}\s+default: {re.escape(default or '(empty)')}", result.stdout)


def test_docs_document_every_setting_with_its_default() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for variable, default, _ in describe_fields():
        row = next(
            (line for line in doc.splitlines() if line.startswith(f"| `{variable}` |")), None
        )
        assert row is not None, f"{variable} is not in docs/configuration.md"
        assert f"`{default}`" in row or (default == "" and "(empty)" in row), row


def test_the_decode_ranks_kv_event_ports_must_not_collide() -> None:
    ranks = ("http://127.0.0.1:8200", "http://127.0.0.1:8201", "http://127.0.0.1:8202")
    # vLLM puts rank r on port + r: with 5557 and 5558, rank 1's events port is rank 0's replay.
    with pytest.raises(ValidationError, match="at least the rank count apart"):
        Settings(decode_urls=ranks, kv_events_decode_port=5557, kv_events_decode_replay_port=5558)
    settings = Settings(
        decode_urls=ranks, kv_events_decode_port=5557, kv_events_decode_replay_port=5560
    )
    assert settings.kv_events_decode_replay_port == 5560
    with pytest.raises(ValidationError, match="run past 65535"):
        Settings(decode_urls=ranks, kv_events_decode_port=65534, kv_events_decode_replay_port=None)


@pytest.mark.parametrize(
    ("values", "which"),
    [
        ({"port": 8000, "decode_url": "http://localhost:8000"}, "SIDECAR_PORT"),
        ({"port": 8000, "decode_url": "http://127.0.0.1:8000"}, "SIDECAR_PORT"),
        ({"port": 8000, "decode_url": "http://[::1]:8000"}, "SIDECAR_PORT"),
        ({"port": 8000, "decode_url": "http://127.0.0.2:8000"}, "SIDECAR_PORT"),
        (
            {"port": 8000, "admin_port": 9000, "decode_url": "http://0.0.0.0:9000"},
            "SIDECAR_ADMIN_PORT",
        ),
        (
            {
                "port": 8000,
                "rank_ports": True,
                "decode_urls": "http://127.0.0.1:8200,http://127.0.0.1:8001",
            },
            "SIDECAR_RANK_PORTS",
        ),
    ],
)
def test_a_decode_engine_on_the_sidecar_s_own_port_is_refused(values, which) -> None:
    """It would be the sidecar calling itself: the engine belongs on a port of its own."""
    with pytest.raises(ValidationError) as caught:
        Settings(**values)
    assert f"is on a port of the sidecar's own ({which}" in str(caught.value)


def test_a_decode_engine_on_another_port_or_host_is_not_the_sidecar() -> None:
    Settings(port=8000, decode_url="http://localhost:8200")
    Settings(port=8000, decode_url="http://decode.example:8000")  # another host's port
    Settings(port=8000, rank_ports=True, decode_urls="http://127.0.0.1:8200,http://127.0.0.1:8002")
    Settings(port=0, decode_url="http://127.0.0.1:1")  # a free port: none of the engine's


@functools.cache
def _one_edit_variants(name: str) -> frozenset[str]:
    """``name`` with a letter dropped, added, changed, or two neighbours swapped."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789"
    head, rest = "SIDECAR_", name.removeprefix("SIDECAR_")
    out = set()
    for i in range(len(rest) + 1):
        out |= {rest[:i] + c + rest[i:] for c in letters}
        if i < len(rest):
            out.add(rest[:i] + rest[i + 1 :])
            out |= {rest[:i] + c + rest[i + 1 :] for c in letters}
        if i + 1 < len(rest):
            out.add(rest[:i] + rest[i + 1] + rest[i] + rest[i + 2 :])
    return frozenset(head + variant for variant in out if variant != rest)


KNOWN = sorted(name for name, _, _ in describe_fields())


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(KNOWN), pick=st.randoms(use_true_random=False))
def test_a_setting_with_one_edit_is_answered_with_that_setting(name, pick) -> None:
    """Every known name with one edit (after the prefix): the hint is that name, unless the
    edit made another known name, or one edit from another one too (``SIDECAR_DECODE_URS`` is
    one from ``_URL`` and from ``_URLS``): then it is one of those."""
    typed = pick.choice(sorted(_one_edit_variants(name)))
    if typed in KNOWN:
        return  # a setting itself: not unknown
    also = [other for other in KNOWN if other != name and typed in _one_edit_variants(other)]
    answer = nearest_setting(typed)
    assert answer == name if not also else answer in [name, *also], (typed, answer, also)
    assert unknown_variables({typed: "1"}) == [
        f"ignoring unknown variable {typed}: did you mean {answer}?"
    ]


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("SIDECAR_REDIS_URI", "SIDECAR_REDIS_URL"),
        ("SIDECAR_DECODE_ULR", "SIDECAR_DECODE_URL"),
        ("SIDECAR_STATE_BACKEN", "SIDECAR_STATE_BACKEND"),
        ("SIDECAR_PREFILL_ENDPOINST", "SIDECAR_PREFILL_ENDPOINTS"),
        ("sidecar_log_levl", "SIDECAR_LOG_LEVEL"),
    ],
)
def test_the_typos_an_operator_made_are_answered(typed: str, meant: str) -> None:
    """The running sidecar and ``inject --env`` give the same hint."""
    assert nearest_setting(typed) == meant
    with pytest.raises(EnvError, match=f"did you mean {meant}\\?"):
        environment.check([{"name": typed.upper(), "value": "x"}])


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("prefill_endpoints", "p0:8000;p1:8000", "'p0:8000;p1:8000': the items of a list are"),
        ("prefill_endpoints", "p0:8000 p1:8000", "separated by commas (a,b), not by ';' or spaces"),
        ("prefill_endpoints", '["p0:8000", "p1:8000"]', "is written as a JSON list: give the"),
        ("prefill_allowed_cidrs", "127.0.0.0/8; ::1/128", "separated by commas (a,b)"),
        ("host", "0.0.0.0 ::", "separated by commas (a,b)"),
    ],
)
def test_a_list_written_otherwise_than_with_commas_says_commas(variable, value, says) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**{variable: value})
    message = explain(caught.value)
    assert message.startswith(f"invalid configuration: SIDECAR_{variable.upper()}: "), message
    assert says in message


def test_commas_with_spaces_and_bracketed_ipv6_are_lists() -> None:
    settings = Settings(prefill_endpoints=" p0:8000 , [fd00::1]:8000,")
    assert [str(endpoint) for endpoint in settings.prefill_endpoints] == [
        "p0:8000",
        "[fd00::1]:8000",
    ]


def test_a_decode_engine_on_an_address_the_sidecar_does_not_listen_on_is_not_the_sidecar() -> None:
    """Listening on one address alone, the sidecar does not take another's port 8200."""
    Settings(host="127.0.0.5", port=8200, decode_url="http://127.0.0.1:8200")
    with pytest.raises(ValidationError, match="is on a port of the sidecar's own"):
        Settings(host="127.0.0.1", port=8200, decode_url="http://localhost:8200")


def test_counters_need_the_redis_backend_and_a_prefix_for_their_tags() -> None:
    assert Settings().state_reservations == "script"
    with pytest.raises(ValidationError, match="SIDECAR_STATE_RESERVATIONS=counters needs"):
        Settings(state_reservations="counters")
    with pytest.raises(ValidationError, match="without spaces or braces"):
        Settings(state_reservations="counters", state_backend="redis", redis_key_prefix="{a}")
    with pytest.raises(ValidationError, match="at most 300 bytes"):
        Settings(state_reservations="counters", state_backend="redis", redis_key_prefix="é" * 151)
    settings = Settings(state_reservations="counters", state_backend="redis")
    assert settings.state_reservations == "counters"


def test_shared_scrapes_need_the_redis_backend() -> None:
    with pytest.raises(ValidationError, match="SIDECAR_SHARED_SCRAPES needs"):
        Settings(shared_scrapes=True)
    settings = Settings(shared_scrapes=True, state_backend="redis")
    assert (settings.shared_scrapes, settings.scrapes_per_endpoint) == (True, 2)
