"""llm-d's sidecar flags: Go's syntax, the mapping onto Settings, the refusals, a real process
started with the model-service chart's decode arguments, --secure-proxy's HTTPS, and --help and
docs/migrating-from-llm-d.md in step with the flag table."""

from __future__ import annotations

import asyncio
import re
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

from devkit.processes import Child, Launcher, environment, free_port
from sidecar.__main__ import _help
from sidecar.config import Settings
from sidecar.llmd import FLAGS, FlagError, go_duration, help_rows, parse, translate
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
    [["-port=9000"], ["--port=9000"], ["-port", "9000"], ["--port", "9000"], ["--port=0x2328"]],
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
        (["--zap-log-level=warn"], "WARNING"),
        (["--zap-log-level=4"], "DEBUG"),
        (["--zap-log-level=3"], "INFO"),
    ],
)
def test_log_levels(args: list[str], level: str) -> None:
    assert settings_of(*args)["log_level"] == level


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
