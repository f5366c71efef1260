"""llm-d's sidecar flags: Go's syntax, the mapping onto Settings, the refusals, a real process
started with the model-service chart's decode arguments, --secure-proxy's HTTPS, and --help and
docs/migrating-from-llm-d.md in step with the flag table."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from devkit.processes import Child, Launcher, environment, free_port
from sidecar.__main__ import _help
from sidecar.config import Settings
from sidecar.llmd import FLAGS, FlagError, go_duration, go_int, help_rows, parse, translate
from tests.conftest import completion, engine_requests
from tests.processes import START_TIMEOUT_S
from tests.tlsfiles import Pki, serial_of_der

ROOT = Path(__file__).resolve().parent.parent

CHART_DECODE_ARGS = [
    "--port=8000",
    "--vllm-port=8200",
    "--connector=nixlv2",
    "--zap-encoder=json",
    "--zap-log-level=debug",
    "--secure-proxy=false",
]
"""What llm-d's model-service chart (llm-d-incubation/llm-d-modelservice, templates/_helpers.tpl,
"llm-d-modelservice.routingProxy") passes to a decode pod's routing sidecar with its default
values.yaml (routing.servicePort 8000, proxy.targetPort 8200, connector nixlv2, zapEncoder json,
zapLogLevel debug, secure false)."""

LLMD_VARIABLES = ("SIDECAR_", "OTEL_", "INFERENCE_POOL", "ENABLE_PREFILLER_SAMPLING")


def settings_of(*args: str, **environ: str) -> dict[str, Any]:
    return translate(list(args), environ).settings


def refusal(*args: str, **environ: str) -> str:
    with pytest.raises(FlagError) as caught:
        translate(list(args), environ)
    return str(caught.value)


# --- the chart's arguments -------------------------------------------------------------------


def test_the_charts_decode_arguments_map_onto_settings() -> None:
    flags = translate(CHART_DECODE_ARGS, {})
    assert flags.settings == {
        "port": 8000,
        "decode_url": "http://127.0.0.1:8200",
        "decode_urls": (),
        "connector": "nixl",
        "log_level": "INFO",
        "tls_cert_file": None,
        "tls_key_file": None,
    }
    assert not flags.self_signed
    assert any("--zap-encoder" in note for note in flags.notes)
    settings = Settings(**flags.settings)
    assert (settings.port, settings.decode_ranks, settings.connector) == (
        8000,
        ("http://127.0.0.1:8200",),
        "nixl",
    )


# --- Go's syntax -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["-port=9000"], ["--port=9000"], ["-port", "9000"], ["--port", "9000"]],
)
def test_one_dash_or_two_and_a_value_attached_or_next(args: list[str]) -> None:
    assert parse(args) == {"port": 9000}


def test_a_boolean_flag_takes_a_value_only_after_an_equals_sign() -> None:
    assert parse(["-tracing"]) == {"tracing": True}
    assert parse(["--tracing=false"]) == {"tracing": False}
    assert parse(["--tracing=0", "--tracing=T"]) == {"tracing": True}
    with pytest.raises(FlagError, match="unexpected argument 'false'"):
        parse(["--tracing", "false"])
    with pytest.raises(FlagError, match="invalid value 'yes' for --tracing"):
        parse(["--tracing=yes"])


def test_the_last_value_wins_and_lists_accumulate() -> None:
    assert parse(["--port=1", "--port=2"]) == {"port": 2}
    assert parse(["--enable-tls=prefiller", "--enable-tls", "decoder, prefiller"]) == {
        "enable-tls": ("prefiller", "decoder", "prefiller")
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prot=1"], "unknown flag --prot"),
        (["--port"], "flag needs an argument: --port"),
        (["--port=eighty"], "invalid value 'eighty' for --port"),
        (["8000"], "unexpected argument '8000'"),
        (["--port=1", "--", "x"], "unexpected argument 'x'"),
        (["---port=1"], "unexpected argument '---port=1'"),
        (["--prefill-retry-backoff=200"], "a duration such as 200ms"),
    ],
)
def test_malformed_arguments_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=re.escape(message)):
        parse(args)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("200ms", 0.2), ("1.5s", 1.5), ("1h2m", 3720.0), ("0", 0.0), ("750us", 0.00075)],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "1d", "ms", "1s2"])
def test_not_go_durations(text: str) -> None:
    assert go_duration(text) is None


# --- values as Go reads them -----------------------------------------------------------------

FULL_WIDTH_8000 = "\uff18\uff10\uff10\uff10"
"""8000 in full-width digits, which Python's int() reads and Go's strconv refuses."""

GO_INTS = [
    # strconv.ParseInt(s, 0, 64), Go's int flags: sign, base prefixes, octal 0, underscores.
    ("100", 100),
    ("+100", 100),
    ("-5", -5),
    ("0x64", 100),
    ("0X64", 100),
    ("0o144", 100),
    ("0O144", 100),
    ("0144", 100),
    ("0b1100100", 100),
    ("0B1100100", 100),
    ("1_000", 1000),
    ("0x_64", 100),
    ("0_144", 100),
    ("0", 0),
    ("00", 0),
    ("-0", 0),
    ("9223372036854775807", 2**63 - 1),
    ("-9223372036854775808", -(2**63)),
    (" 100", None),
    ("100 ", None),
    ("\t100", None),
    ("100\n", None),
    (FULL_WIDTH_8000, None),
    ("\u0661\u0660\u0660", None),  # Arabic-Indic digits
    ("08", None),  # octal
    ("0x", None),
    ("0b", None),
    ("0b2", None),
    ("0o8", None),
    ("_100", None),
    ("100_", None),
    ("1__0", None),
    ("0_", None),
    ("0x_", None),
    ("+-1", None),
    ("--1", None),
    ("+", None),
    ("", None),
    ("1e3", None),
    ("1.0", None),
    ("9223372036854775808", None),
    ("-9223372036854775809", None),
    ("0x8000000000000000", None),
]


@pytest.mark.parametrize(("text", "number"), GO_INTS)
def test_an_int_flag_reads_what_go_s_parse_int_reads(text: str, number: int | None) -> None:
    args = [f"--max-idle-conns-per-host={text}"]
    if number is None:
        with pytest.raises(FlagError, match=r"invalid value .* an integer"):
            parse(args)
    else:
        assert parse(args) == {"max-idle-conns-per-host": number}


@pytest.mark.parametrize(
    ("text", "number"),
    [
        # llm-d's ports are strings it checks with strconv.Atoi: decimal only.
        ("8000", 8000),
        ("+8000", 8000),
        ("08000", 8000),
        (" 8000", None),
        ("8000 ", None),
        (FULL_WIDTH_8000, None),
        ("0x1F40", None),
        ("0o17500", None),
        ("8_000", None),
        ("", None),
    ],
)
@pytest.mark.parametrize("flag", ["port", "model-server-port", "vllm-port"])
def test_a_port_reads_what_go_s_atoi_reads(flag: str, text: str, number: int | None) -> None:
    if number is None:
        with pytest.raises(FlagError, match=f"invalid value .* for --{flag}: a decimal integer"):
            parse([f"--{flag}={text}"])
    else:
        assert parse([f"--{flag}={text}"]) == {flag: number}


def test_the_flags_refuse_a_port_with_a_space_or_full_width_digits() -> None:
    assert "invalid value ' 8000' for --port" in refusal("--port= 8000")
    assert "for --vllm-port: a decimal integer" in refusal(f"--vllm-port={FULL_WIDTH_8000}")
    assert "invalid value ' 4' for --data-parallel-size" in refusal("--data-parallel-size", " 4")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        *[("4", 4), ("+4", 4), ("2147483647", 2**31 - 1), ("-2147483648", -(2**31))],
        *[("2147483648", None), ("0x4", None), (" 4", None), ("\uff14", None)],
    ],
)
def test_klog_s_verbosity_is_a_decimal_int32(text: str, number: int | None) -> None:
    if number is None:
        with pytest.raises(FlagError, match="for --v: a decimal integer"):
            parse([f"-v={text}"])
    else:
        assert parse([f"-v={text}"]) == {"v": number}


@pytest.mark.parametrize(
    ("text", "level"),
    [
        *[("4", "DEBUG"), ("+4", "DEBUG"), ("1", "INFO"), ("DEBUG", "INFO"), ("Error", "ERROR")],
        *[(" 4", None), ("4 ", None), ("\uff14", None), (" debug", None), ("0x4", None)],
        # Zap's own names that controller-runtime's flag does not take.
        *[("warn", None), ("dpanic", None), ("fatal", None)],
    ],
)
def test_zap_s_log_level_is_a_name_or_a_decimal_integer(text: str, level: str | None) -> None:
    if level is None:
        assert f"--zap-log-level={text}: expected" in refusal(f"--zap-log-level={text}")
    else:
        assert settings_of(f"--zap-log-level={text}")["log_level"] == level


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1.s", 1.0),
        (".5s", 0.5),
        ("+1s", 1.0),
        ("-0", 0.0),
        ("1h2m3s4ms5us6ns", 3723.004005006),
        ("1\u00b5s", 1e-6),  # the micro sign
        ("1\u03bcs", 1e-6),  # the Greek mu
        ("2562047h47m16.854775807s", (2**63 - 1) / 1e9),
        ("-2562047h47m16.854775808s", -(2**63) / 1e9),
        ("0.0000000001s", 0.0),
    ],
)
def test_more_go_durations(text: str, seconds: float) -> None:
    assert go_duration(text) == pytest.approx(seconds, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        *[" 200ms", "200ms ", "200 ms", "\uff12\uff10\uff10ms", "+-1s", "--1s", "-", ".s"],
        *["1.2.3s", "00", "1S", "1sec", "2562047h47m16.854775808s", "9223372036854775808ns"],
        "1_000ms",
    ],
)
def test_durations_go_refuses(text: str) -> None:
    assert go_duration(text) is None
    with pytest.raises(FlagError, match="a duration such as 200ms"):
        parse([f"--prefill-retry-backoff={text}"])


_GO_INT_LITERAL = re.compile(
    r"[+-]?(?:0[xX](?:_?[0-9a-fA-F])+|0[bB](?:_?[01])+|0[oO](?:_?[0-7])+|0(?:_?[0-7])*"
    r"|[1-9](?:_?[0-9])*)"
)
"""The Go specification's integer literal (what ParseInt with base 0 accepts), with a sign."""
_RADIX = {"x": 16, "b": 2, "o": 8}
_NUMBER_CHARACTERS = "0123456789_+-xXoObBaAfFzZ .\t\uff10\uff18\u0661"


def _literal_value(text: str) -> int:
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    digits = digits.replace("_", "")
    if len(digits) > 1 and digits[0] == "0":
        radix = _RADIX.get(digits[1].lower(), 8)
        digits = digits[2:] if radix != 8 or digits[1] in "oO" else digits[1:]
        return sign * int(digits, radix)
    return sign * int(digits)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=_NUMBER_CHARACTERS, max_size=12))
def test_go_int_accepts_exactly_go_s_integer_literals(text: str) -> None:
    """Against the grammar of Go's integer literals, independently of the parser's steps."""
    expected = None
    if _GO_INT_LITERAL.fullmatch(text) and -(2**63) <= _literal_value(text) < 2**63:
        expected = _literal_value(text)
    assert go_int(text) == expected
    decimal = re.fullmatch(r"[+-]?[0-9]+", text) and -(2**63) <= int(text) < 2**63
    assert go_int(text, base=10) == (int(text) if decimal else None)


_GO_DURATION = re.compile(
    r"[+-]?(?:0|(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+)"
)
"""time.ParseDuration's syntax (its comment's regular expression, with the units named)."""
_DURATION_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_NS = {"ns": 1, "us": 10**3, "\u00b5s": 10**3, "\u03bcs": 10**3, "ms": 10**6, "s": 10**9}
_NS |= {"m": 60 * 10**9, "h": 3600 * 10**9}


def _duration_ns(text: str) -> int:
    """Exact nanoseconds of a duration matching ``_GO_DURATION``, each part's fraction
    truncated to the nanosecond as Go does."""
    total = 0
    for whole, fraction, unit in _DURATION_PART.findall(text.lstrip("+-")):
        total += int(whole or "0") * _NS[unit]
        total += int(fraction or "0") * _NS[unit] // 10 ** len(fraction)
    return -total if text.startswith("-") else total


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="0123456789.+- nsuµμmhd\uff10", max_size=10))
def test_go_duration_accepts_exactly_go_s_syntax(text: str) -> None:
    expected = None
    if _GO_DURATION.fullmatch(text) and -(2**63) <= _duration_ns(text) < 2**63:
        expected = _duration_ns(text) / 1e9
    seconds = go_duration(text)
    assert (seconds is None) == (expected is None)
    if seconds is not None:
        assert seconds == pytest.approx(expected, rel=1e-12, abs=1e-9)


# --- the mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "connector"),
    [
        (["--kv-connector=nixlv2"], "nixl"),
        (["--kv-connector=sglang"], "sglang"),
        (["--kv-connector=shared-storage"], "shared-storage"),
        (["--connector=lmcache"], "shared-storage"),
        (["--connector=sglang", "--kv-connector=nixlv2"], "nixl"),
    ],
)
def test_connector_names(args: list[str], connector: str) -> None:
    assert settings_of(*args)["connector"] == connector


def test_data_parallel_ranks_sit_on_consecutive_ports() -> None:
    settings = settings_of("--model-server-port=8300", "--data-parallel-size=3")
    assert settings["decode_urls"] == (
        "http://127.0.0.1:8300",
        "http://127.0.0.1:8301",
        "http://127.0.0.1:8302",
    )
    assert Settings(**settings).decode_ranks == settings["decode_urls"]
    assert settings["rank_ports"] is True  # served on --port + r, as llm-d
    # llm-d's default model-server port; --model-server-port wins over --vllm-port.
    assert settings_of("--data-parallel-size=2")["decode_urls"][0] == "http://127.0.0.1:8200"
    assert settings_of("--vllm-port=1", "--model-server-port=2")["decode_url"].endswith(":2")
    assert "decode_url" not in settings_of("--port=8000")


def test_data_parallel_ranks_and_a_decode_url_variable_conflict() -> None:
    message = refusal("--data-parallel-size=2", SIDECAR_DECODE_URL="http://127.0.0.1:9")
    assert "unset SIDECAR_DECODE_URL" in message
    assert "outside 1-65535" in refusal("--vllm-port=65535", "--data-parallel-size=2")
    assert "1 or more" in refusal("--data-parallel-size=0")


def test_tls_stages() -> None:
    both = settings_of("--enable-tls=prefiller,decoder", "--vllm-port=8200")
    assert both["prefill_tls"] is True
    assert both["decode_url"] == "https://127.0.0.1:8200"
    assert settings_of("--prefiller-use-tls")["prefill_tls"] is True
    assert settings_of("--decoder-use-tls")["decode_url"].startswith("https://")
    assert settings_of("--enable-tls=decoder")["prefill_tls"] is False
    assert "no encoder stage" in refusal("--enable-tls=encoder")
    assert "stages are prefiller, decoder, encoder" in refusal("--enable-tls=prefill")


PREFILL_SKIP, DECODE_SKIP = "prefill_tls_insecure_skip_verify", "decode_tls_insecure_skip_verify"
HTTPS_DECODE = {"SIDECAR_DECODE_URL": "https://127.0.0.1:8443"}


@pytest.mark.parametrize(
    ("args", "environ", "skips"),
    [
        (["--enable-tls=prefiller", "--tls-insecure-skip-verify=prefiller"], {}, (True, None)),
        (["--enable-tls=decoder", "--tls-insecure-skip-verify=decoder"], {}, (None, True)),
        (
            ["--enable-tls=prefiller,decoder", "--tls-insecure-skip-verify=prefiller,decoder"],
            {},
            (True, True),
        ),
        (["--prefiller-use-tls", "--prefiller-tls-insecure-skip-verify"], {}, (True, None)),
        # One stage named of two over TLS: the other is verified.
        (
            ["--enable-tls=prefiller,decoder", "--tls-insecure-skip-verify=prefiller"],
            {},
            (True, False),
        ),
        (
            ["--enable-tls=prefiller,decoder", "--decoder-tls-insecure-skip-verify"],
            {},
            (False, True),
        ),
        # TLS turned on by a variable counts: the decode engine stays verified...
        (
            ["--enable-tls=prefiller", "--tls-insecure-skip-verify=prefiller"],
            HTTPS_DECODE,
            (True, False),
        ),
        (
            ["--decoder-use-tls", "--decoder-tls-insecure-skip-verify"],
            {"SIDECAR_PREFILL_TLS": "true"},
            (False, True),
        ),
        # ... and a stage over TLS by a variable can be the one named.
        (["--tls-insecure-skip-verify=prefiller"], {"SIDECAR_PREFILL_TLS": "true"}, (True, None)),
        (["--tls-insecure-skip-verify=decoder"], HTTPS_DECODE, (None, True)),
        # A stage over plain HTTP has nothing to verify.
        (["--enable-tls=prefiller", "--tls-insecure-skip-verify=decoder"], {}, (False, None)),
        (["--enable-tls=prefiller"], {}, (None, None)),
    ],
)
def test_skipping_verification_covers_the_stages_named(
    args: list[str], environ: dict[str, str], skips: tuple[bool | None, bool | None]
) -> None:
    flags = translate(args, environ)
    assert (flags.settings.get(PREFILL_SKIP), flags.settings.get(DECODE_SKIP)) == skips
    assert "tls_insecure_skip_verify" not in flags.settings


@pytest.mark.parametrize(
    ("args", "environ", "note"),
    [
        (["--tls-insecure-skip-verify=prefiller"], {"SIDECAR_PREFILL_TLS": "true"}, False),
        (["--tls-insecure-skip-verify=decoder"], HTTPS_DECODE, False),
        (["--tls-insecure-skip-verify=decoder"], {}, True),
    ],
)
def test_the_plain_http_note_follows_the_effective_settings(
    args: list[str], environ: dict[str, str], note: bool
) -> None:
    notes = translate(args, environ).notes
    assert any("not called over TLS" in text for text in notes) is note


def test_the_stage_settings_win_over_the_global_one() -> None:
    with_env = Settings(
        prefill_tls=True,
        decode_url="https://127.0.0.1:8443",
        tls_insecure_skip_verify=True,
        **settings_of(
            "--tls-insecure-skip-verify=prefiller", **HTTPS_DECODE, SIDECAR_PREFILL_TLS="1"
        ),
    )
    assert (with_env.prefill_skip_verify, with_env.decode_skip_verify) == (True, False)
    assert Settings(prefill_tls=True, tls_insecure_skip_verify=True).prefill_skip_verify


def test_secure_proxy() -> None:
    assert translate(["--secure-proxy"], {}).self_signed
    assert translate(["--secure-proxy=true"], {}).settings == {}
    with_cert = settings_of("--secure-proxy", "--cert-path=/etc/certs/")
    assert (with_cert["tls_cert_file"], with_cert["tls_key_file"]) == (
        "/etc/certs/tls.crt",
        "/etc/certs/tls.key",
    )
    assert settings_of("--cert-path=/c")["tls_cert_file"] == "/c/tls.crt"
    assert settings_of("--secure-proxy=false", "--cert-path=/c")["tls_cert_file"] is None
    plain = translate(["--port=1"], {})
    assert not plain.self_signed
    assert any("plain HTTP" in note for note in plain.notes)


def test_secure_proxy_serves_the_operators_certificate_from_the_environment() -> None:
    """SIDECAR_TLS_CERT_FILE / _KEY_FILE set: --secure-proxy alone uses them, no self-signed
    certificate replaces them."""
    environ = {"SIDECAR_TLS_CERT_FILE": "/c/tls.crt", "SIDECAR_TLS_KEY_FILE": "/c/tls.key"}
    flags = translate(["--secure-proxy=true"], environ)
    assert not flags.self_signed
    assert "tls_cert_file" not in flags.settings
    assert any("SIDECAR_TLS_CERT_FILE" in note for note in flags.notes)


def test_secure_serving_is_secure_proxys_newer_name() -> None:
    assert translate(["--secure-serving"], {}).self_signed
    assert settings_of("--secure-serving=false", "--cert-path=/c")["tls_cert_file"] is None
    assert translate(["--secure-serving", "--secure-proxy=true"], {}).self_signed
    assert "give --secure-serving alone" in refusal("--secure-serving", "--secure-proxy=false")


@pytest.mark.parametrize(
    ("args", "version"),
    [
        (["--tls-min-version=VersionTLS13"], "1.3"),
        (["--tls-min-version=VersionTLS12"], "1.2"),
        (["--tls-min-version="], None),
    ],
)
def test_tls_min_version(args: list[str], version: str | None) -> None:
    assert settings_of(*args).get("tls_min_version") == version


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-min-version=VersionTLS11"], "TLS 1.2 at least"),
        (["--tls-min-version=1.3"], "expected VersionTLS12 or VersionTLS13"),
        (["--tls-cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"], "OpenSSL's default"),
        (["--enable-speculative-prefill"], "predicted next turn"),
        (["--metrics-port=9090", "--metrics-cert-dir=/m"], "the same directory as --cert-path"),
    ],
)
def test_newer_flags_refused_with_a_reason(args: list[str], message: str) -> None:
    assert message in refusal(*args)


def test_a_metrics_cert_dir_that_is_the_cert_path_serves_the_metrics_port_over_https() -> None:
    settings = settings_of("--cert-path=/c/", "--metrics-port=9090", "--metrics-cert-dir=/c")
    assert (settings["admin_port"], settings["admin_tls"]) == (9090, True)
    unused = translate(["--cert-path=/c", "--metrics-cert-dir=/c"], {})
    assert "admin_tls" not in unused.settings
    assert any("unused without --metrics-port" in note for note in unused.notes)


@pytest.mark.parametrize(
    ("args", "entries", "message"),
    [
        (["--enable-tls=decoder"], "https://127.0.0.1:1", "add --enable-tls=prefiller"),
        (["--prefiller-use-tls=false"], "https://127.0.0.1:1", "--prefiller-use-tls without"),
        (["--enable-tls=prefiller"], "http://127.0.0.1:1", "--enable-tls calls every prefill"),
    ],
)
def test_pool_entry_schemes_against_the_flags_name_the_flag(
    args: list[str], entries: str, message: str
) -> None:
    """The flag wins over SIDECAR_PREFILL_TLS, so telling the user to set it would not help."""
    text = refusal(*args, SIDECAR_PREFILL_ENDPOINTS=entries)
    assert message in text
    assert "SIDECAR_PREFILL_TLS=true" not in text


@pytest.mark.parametrize(
    ("args", "environ", "pool"),
    [
        (["--enable-ssrf-protection", "--inference-pool=team/pool"], {}, "team/pool"),
        (["--enable-ssrf-protection", "--inference-pool=pool"], {}, "default/pool"),
        (["--enable-ssrf-protection"], {"INFERENCE_POOL": "team/pool"}, "team/pool"),
        (["--enable-ssrf-protection", "--inference-pool=a/b"], {"INFERENCE_POOL": "c/d"}, "a/b"),
        (
            ["-enable-ssrf-protection", "-inference-pool-namespace=ns", "-inference-pool-name=p"],
            {},
            "ns/p",
        ),
        (
            ["--enable-ssrf-protection"],
            {"INFERENCE_POOL_NAMESPACE": "ns", "INFERENCE_POOL_NAME": "p"},
            "ns/p",
        ),
        (["--enable-ssrf-protection=false", "--inference-pool=a/b"], {}, None),
    ],
)
def test_ssrf_protection_follows_the_inference_pool(
    args: list[str], environ: dict[str, str], pool: str | None
) -> None:
    assert settings_of(*args, **environ).get("inference_pool") == pool


def test_ssrf_protection_without_a_pool_or_with_another_group_is_refused() -> None:
    assert "needs its InferencePool" in refusal("--enable-ssrf-protection")
    assert "inference.networking.k8s.io" in refusal("--pool-group=example.com")
    older = settings_of("--pool-group=inference.networking.x-k8s.io")
    assert "inference_pool" not in older
    assert older["inference_pool_group"] == "inference.networking.x-k8s.io"


@pytest.mark.parametrize(
    ("args", "level"),
    [
        (["-v=5"], "DEBUG"),
        (["-v", "2"], "INFO"),
        # zap's debug is V(1), below llm-d's debug logging (V(4)): the chart's default.
        (["--zap-log-level=debug"], "INFO"),
        (["--zap-devel"], "INFO"),
        (["--zap-devel", "-v=4"], "DEBUG"),
        (["--zap-log-level=info", "--zap-devel", "-v=9"], "INFO"),
        (["--zap-log-level=error"], "ERROR"),
        (["--zap-log-level=panic"], "ERROR"),
        (["--zap-log-level=4"], "DEBUG"),
        (["--zap-log-level=3"], "INFO"),
    ],
)
def test_log_levels(args: list[str], level: str) -> None:
    assert settings_of(*args)["log_level"] == level


@pytest.mark.parametrize(
    "arg",
    [
        "--zap-encoder=JSON",
        "--zap-encoder=Console",
        "--zap-stacktrace-level=PANIC",
        "--zap-time-encoding=nanos",
        "--zap-time-encoding=RFC3339Nano",
    ],
)
def test_the_zap_format_flags_take_controller_runtime_s_values_in_any_case(arg: str) -> None:
    assert any(note.startswith(arg.split("=")[0]) for note in translate([arg], {}).notes)


@pytest.mark.parametrize(
    "arg",
    ["--zap-encoder=text", "--zap-time-encoding=nano", "--zap-stacktrace-level=warn"],
)
def test_the_zap_format_flags_refuse_what_controller_runtime_refuses(arg: str) -> None:
    name, value = arg.split("=")
    assert f"{name}={value}: expected one of" in refusal(arg)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--zap-encoder=json"], "--zap-encoder:"),
        (["--zap-time-encoding=iso8601"], "--zap-time-encoding:"),
        (
            ["--zap-encoder=console", "--zap-stacktrace-level=error"],
            "--zap-encoder, --zap-stacktrace-level:",
        ),
    ],
)
def test_the_zap_note_names_only_the_flags_given(args: list[str], named: str) -> None:
    notes = [note for note in translate(args, {}).notes if note.startswith("--zap")]
    assert len(notes) == 1
    assert notes[0].startswith(named)


def test_retries_tracing_and_metrics_port() -> None:
    settings = settings_of(
        "--prefill-max-retries=3",
        "--prefill-retry-backoff=250ms",
        "--tracing",
        "--metrics-port=9090",
    )
    assert settings == {
        "prefill_retries": 3,
        "prefill_retry_backoff_s": 0.25,
        "tracing": True,
        "admin_port": 9090,
        "admin_tls": False,
    }
    assert "admin_port" not in settings_of("--metrics-port=0")
    # The operator's SIDECAR_ADMIN_TLS decides when it is set.
    assert "admin_tls" not in settings_of("--metrics-port=9090", SIDECAR_ADMIN_TLS="true")


@pytest.mark.parametrize(("sampling", "spread"), [(True, True), (False, False)])
async def test_sampling_spreads_prefills_over_the_hosts_the_header_names(
    http, start_sidecar_with, start_engine, sampling: bool, spread: bool
) -> None:
    """SIDECAR_PREFILL_HEADER_SAMPLING (--enable-prefiller-sampling): one of the header's hosts
    at random; without it, always the first."""
    first, second = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(prefill_header_sampling=sampling, scheduler_seed=7)
    header = {"x-prefiller-host-port": f"{first.endpoint}, {second.endpoint}"}
    for _ in range(12):
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(), headers=header
        ) as response:
            assert response.status == 200
            await response.read()
    counts = [len(await engine_requests(http, engine)) for engine in (first, second)]
    assert sum(counts) == 12
    assert (min(counts) > 0) is spread


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "names", "instead"),
    [
        (["--kv-connector=mooncake"], "--kv-connector=mooncake", "--kv-connector=nixlv2"),
        (["--kv-connector=offloading"], "--kv-connector=offloading", "nixlv2"),
        (["--connector=nixl"], "--connector=nixl", "--kv-connector=nixlv2"),
        (["--ec-connector=ec-nixl"], "--ec-connector=ec-nixl", "leave --ec-connector empty"),
        (["--decode-chunk-size=512"], "--decode-chunk-size=512", "leave --decode-chunk-size at 0"),
        (["--configuration={port: 8085}"], "--configuration=", "SIDECAR_* variable"),
        (["--configuration-file=/etc/c.yaml"], "--configuration-file=", "SIDECAR_* variable"),
        (["--moriio-write-mode"], "--moriio-write-mode=true", "remove the --moriio-* flags"),
        (["--moriio-remote-hosts=a,b"], "--moriio-remote-hosts=a,b", "remove the --moriio-*"),
        (["--mooncake-bootstrap-port=9000"], "--mooncake-bootstrap-port=9000", "remove it"),
        (["--enable-p2p-pull"], "--enable-p2p-pull=true", "nixlv2 or shared-storage"),
        (["--kv-connector=nixl-push"], "--kv-connector=nixl-push", "nixlv2, sglang"),
    ],
)
def test_a_value_that_cannot_be_honoured_names_the_flag_and_what_to_use(
    args: list[str], names: str, instead: str
) -> None:
    message = refusal(*args)
    assert names in message
    assert instead in message


@pytest.mark.parametrize(
    ("args", "environ", "sampling"),
    [
        (["--enable-prefiller-sampling"], {}, True),
        (["--port=1"], {"ENABLE_PREFILLER_SAMPLING": "true"}, True),
        (["--enable-prefiller-sampling=false"], {"ENABLE_PREFILLER_SAMPLING": "true"}, False),
        (["--port=1"], {"ENABLE_PREFILLER_SAMPLING": "maybe"}, None),
        (["--port=1"], {}, None),
    ],
)
def test_prefiller_sampling_from_the_flag_or_llmds_variable(
    args: list[str], environ: dict[str, str], sampling: bool | None
) -> None:
    assert settings_of(*args, **environ).get("prefill_header_sampling") is sampling


@pytest.mark.parametrize(
    "flag", [flag for flag in FLAGS if flag.only_default], ids=lambda flag: flag.name
)
def test_a_refused_flag_at_llmds_default_is_accepted(flag: Any) -> None:
    default = flag.default
    if isinstance(default, bool):
        text = str(default).lower()
    elif isinstance(default, tuple):
        text = ",".join(default)
    elif isinstance(default, float):
        text = f"{default:g}s"
    else:
        text = str(default)
    assert translate([f"--{flag.name}={text}"], {}).settings == {}


# --- --help and the migration guide ----------------------------------------------------------


def _guide_rows() -> dict[str, str]:
    """The migration guide's flag table: flag as typed -> its "maps to" cell."""
    doc = (ROOT / "docs" / "migrating-from-llm-d.md").read_text()
    rows = {}
    for line in doc.splitlines():
        match = re.match(r"^\| `(-{1,2}[a-z0-9-]+)` \| (.*?) \|", line)
        if match:
            rows[match[1]] = match[2].replace("\\|", "|").strip("`")
    return rows


def test_the_guide_maps_every_flag_as_the_code_does() -> None:
    guide = _guide_rows()
    expected = {typed.split("=")[0]: maps_to for typed, maps_to in help_rows()}
    assert guide == expected


def test_help_lists_every_flag_with_what_it_maps_to() -> None:
    text = _help()
    for typed, maps_to in help_rows():
        assert re.search(rf"^  {re.escape(typed)}\s+-> {re.escape(maps_to)}$", text, re.M), typed


def test_the_charts_values_override_swaps_the_image_only() -> None:
    override = yaml.safe_load((ROOT / "manifests" / "llm-d" / "values-override.yaml").read_text())
    component = (ROOT / "manifests" / "components" / "pd-sidecar" / "sidecar.yaml").read_text()
    image = re.search(r"^\s+image: (\S+)$", component, re.M)
    assert image is not None
    assert override == {"routing": {"proxy": {"image": image[1]}}}


# --- real processes --------------------------------------------------------------------------


@asynccontextmanager
async def sidecar_with_flags(
    args: Sequence[str], *, scheme: str = "http", **variables: str
) -> AsyncIterator[tuple[Child, str]]:
    """``python -m sidecar ARGS`` (llm-d's environment variables and ours dropped, ``variables``
    set), once /health answers 200 over ``scheme`` (any certificate accepted)."""
    port = args_port(args)
    url = f"{scheme}://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(url + "/health", ssl=False) as response,
            ):
                return response.status == 200
        except aiohttp.ClientError:
            return False

    env = environment({"SIDECAR_HOST": "127.0.0.1", **variables}, drop=LLMD_VARIABLES)
    async with Launcher(prefix="pd-sidecar-test-") as launcher:
        child = await launcher.start(
            "sidecar",
            [sys.executable, "-m", "sidecar", *args],
            env=env,
            url=url,
            ready=healthy,
            timeout_s=START_TIMEOUT_S,
        )
        yield child, url


def args_port(args: Sequence[str]) -> int:
    return int(next(arg.split("=", 1)[1] for arg in args if arg.startswith("--port=")))


@pytest.mark.system
async def test_the_charts_arguments_run_the_sidecar_and_win_over_variables(http, decode) -> None:
    port = free_port()
    args = [
        arg.replace("8000", str(port)).replace("8200", str(port_of(decode.url)))
        for arg in CHART_DECODE_ARGS
    ]
    # Every variable below is contradicted by a flag: the sidecar only works if the flags win.
    async with (
        sidecar_with_flags(
            args,
            SIDECAR_PORT=str(free_port()),
            SIDECAR_DECODE_URL="http://127.0.0.9:1",
            SIDECAR_CONNECTOR="sglang",
            SIDECAR_LOG_LEVEL="ERROR",
            SIDECAR_LOG_REQUESTS="true",
        ) as (child, url),
        http.post(url + "/v1/completions", json=completion()) as response,
    ):
        assert response.status == 200
        assert (await response.json())["choices"]
        # Read while the process runs: its log goes with the launcher's directory.
        log = await logged(child, "decision=local")  # INFO: --zap-log-level=debug beat ERROR
    assert "llm-d flag: --zap-encoder" in log


async def logged(child: Child, text: str, within_s: float = 10.0) -> str:
    """The child's log once it shows ``text`` (the process writes it after answering)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while text not in (log := child.log()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{text!r} not logged within {within_s} s: {log[-2000:]}")
        await asyncio.sleep(0.05)
    return log


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.system
async def test_secure_proxy_serves_https_with_a_self_signed_certificate(decode) -> None:
    port = free_port()
    args = [f"--port={port}", f"--vllm-port={port_of(decode.url)}", "--secure-proxy"]
    async with sidecar_with_flags(args, scheme="https") as (child, url):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health", ssl=context) as response:
                assert response.status == 200
            # Verified, it fails: nobody signed it.
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.get(url + "/health")
        # The certificate it serves, from a TLS connection of our own (aiohttp gives a
        # response's connection back to its pool once the body is read).
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        await writer.wait_closed()
        assert "self-signed certificate" in child.log()
    cert = x509.load_der_x509_certificate(der)
    assert cert.issuer == cert.subject


def files_with_the_key_of(cert: x509.Certificate, roots: Sequence[Path]) -> list[Path]:
    """The files under ``roots`` that hold the private key of ``cert``, whatever their name."""
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wanted = cert.public_key().public_bytes(*spki)
    found = []
    for root in roots:
        for directory, _, names in os.walk(root):
            for name in names:
                path = Path(directory, name)
                try:
                    data = path.read_bytes() if path.stat().st_size < 65536 else b""
                    key = serialization.load_pem_private_key(data, password=None)
                except (OSError, ValueError, TypeError):
                    continue  # unreadable, large, or no private key in PEM
                if key.public_key().public_bytes(*spki) == wanted:
                    found.append(path)
    return found


def key_roots(temporary: Path) -> list[Path]:
    """Where a sidecar given ``TMPDIR=temporary`` could write a file: that directory, the
    shared-memory tmpfs, and what earlier versions named under /tmp."""
    return [temporary, Path("/dev/shm"), *Path("/tmp").glob("pd-sidecar-tls-*")]


def sample(metrics: str, series: str) -> float:
    return float(next(line for line in metrics.splitlines() if line.startswith(series)).split()[-1])


@pytest.mark.system
async def test_secure_proxy_leaves_no_private_key_at_rest(decode, tmp_path: Path) -> None:
    """The self-signed key exists in the process's memory only: no file holds it while the
    sidecar serves (its temporary directory, /dev/shm where it went on a read-only root) nor
    after a SIGKILL, as an OOM kill ends it; and however often the TLS files are checked, no
    reload of it is tried, let alone failed."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    port, interval_s = free_port(), 0.01
    args = [f"--port={port}", f"--vllm-port={port_of(decode.url)}", "--secure-proxy"]
    loop = asyncio.get_running_loop()
    async with sidecar_with_flags(
        args,
        scheme="https",
        TMPDIR=str(temporary),
        SIDECAR_TLS_RELOAD_INTERVAL_S=str(interval_s),
    ) as (child, url):
        served = loop.time()
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        cert = x509.load_der_x509_certificate(
            writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        )
        writer.close()
        await writer.wait_closed()
        roots = key_roots(temporary)
        assert files_with_the_key_of(cert, roots) == []
        # Twenty intervals of the file watch at least: what it would do, it has done.
        await asyncio.sleep(max(0.0, served + 20 * interval_s - loop.time()))
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/metrics", ssl=False) as response,
        ):
            metrics = await response.text()
        for outcome in ("failed", "reloaded"):
            series = f'pd_sidecar_tls_reloads_total{{files="listener",outcome="{outcome}"}}'
            assert sample(metrics, series) == 0
        assert " ERROR " not in child.log()
        child.kill()
        assert await child.wait() == -signal.SIGKILL
        assert files_with_the_key_of(cert, roots) == []
    assert list(temporary.iterdir()) == []


@pytest.mark.system
async def test_the_metrics_port_is_plain_http_under_secure_proxy(decode) -> None:
    """As llm-d's: --secure-proxy makes --port HTTPS, --metrics-port stays HTTP."""
    port, metrics = free_port(), free_port()
    args = [
        f"--port={port}",
        f"--vllm-port={port_of(decode.url)}",
        "--secure-proxy",
        f"--metrics-port={metrics}",
    ]
    async with (
        sidecar_with_flags(args, scheme="https"),
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{metrics}/metrics") as response,
    ):
        assert response.status == 200
        assert "pd_sidecar_" in await response.text()


@pytest.mark.system
async def test_secure_proxy_keeps_a_certificate_given_by_variables(decode, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    cert_file, key_file, serial = pki.issue("127.0.0.1")
    port = free_port()
    args = [f"--port={port}", f"--vllm-port={port_of(decode.url)}", "--secure-proxy=true"]
    async with sidecar_with_flags(
        args, scheme="https", SIDECAR_TLS_CERT_FILE=cert_file, SIDECAR_TLS_KEY_FILE=key_file
    ):
        # Verified with the operator's CA: the served certificate is theirs.
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=pki.client_context())
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        await writer.wait_closed()
    assert serial_of_der(der) == serial


@pytest.mark.system
def test_a_refused_flag_exits_2_before_anything_starts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "--port=8000", "-kv-connector", "mooncake"],
        env=environment({}, drop=LLMD_VARIABLES),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("pd-sidecar: --kv-connector=mooncake cannot be honoured")


@pytest.mark.system
@pytest.mark.parametrize(
    ("command", "usage"),
    [("pd-sidecar", "usage: pd-sidecar "), ("-m", "usage: python -m sidecar ")],
)
def test_help_names_the_command_as_it_was_typed(tmp_path: Path, command: str, usage: str) -> None:
    """The console script prints its own name; ``python -m sidecar`` the module's."""
    if command == "-m":
        argv = [sys.executable, "-m", "sidecar", "--help"]
    else:
        # What the console script is: a file of that name calling main().
        script = tmp_path / command
        script.write_text("from sidecar.__main__ import main\nmain()\n")
        argv = [sys.executable, str(script), "--help"]
    result = subprocess.run(
        argv,
        env=environment({"PYTHONPATH": str(ROOT)}, drop=LLMD_VARIABLES),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.startswith(usage)
