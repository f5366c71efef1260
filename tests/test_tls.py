"""TLS on every hop: the sidecar's listener (HTTPS, TLS 1.2 at least, its certificate rotated as
Kubernetes rotates a Secret), and the engines' legs (HTTPS to prefill and decode, a CA bundle,
mTLS, an untrusted certificate). Certificates are made by the tests (``tests/tlsfiles.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.llmd import translate
from sidecar.security.tls import ServerTls, memory_files
from sidecar.server.runner import RunningSidecar
from tests.conftest import StartEmulator, StartSidecar, chat, engine_requests, eventually
from tests.processes import free_port, sidecar_process
from tests.tlsfiles import Pki, SecretDir, serial_of_der

HEADER = "x-prefiller-host-port"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
async def trusting(pki: Pki) -> AsyncIterator[aiohttp.ClientSession]:
    """A client that trusts the tests' CA (and keeps its connections alive)."""
    connector = aiohttp.TCPConnector(ssl=pki.client_context())
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


def secret_with(directory: Path, cert: tuple[str, str, int]) -> SecretDir:
    secret = SecretDir(directory)
    secret.write({"tls.crt": cert[0], "tls.key": cert[1]})
    return secret


def listener_settings(secret: SecretDir) -> dict[str, Any]:
    return {
        "tls_cert_file": secret.file("tls.crt"),
        "tls_key_file": secret.file("tls.key"),
        "tls_reload_interval_s": 0.02,
    }


class TlsConnection:
    """One raw TLS connection to a sidecar: the certificate its handshake got, and HTTP/1.1
    keep-alive requests on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        ssl_object = writer.get_extra_info("ssl_object")
        self.serial = serial_of_der(ssl_object.getpeercert(binary_form=True))

    @classmethod
    async def open(cls, context: ssl.SSLContext, url: str) -> TlsConnection:
        host, port = url.removeprefix("https://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
        return cls(reader, writer)

    async def get(self, path: str) -> int:
        """The status of ``GET path`` on this connection (which stays open)."""
        self._writer.write(f"GET {path} HTTP/1.1\r\nHost: sidecar\r\n\r\n".encode())
        head = await self._reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await self._reader.readexactly(length)
        return int(head.split(b" ", 2)[1])

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await self._writer.wait_closed()


async def serial_on_a_new_connection(pki: Pki, url: str) -> int:
    connection = await TlsConnection.open(pki.client_context(), url)
    try:
        assert await connection.get("/health") == 200
        return connection.serial
    finally:
        await connection.close()


async def metric(http: aiohttp.ClientSession, sidecar: RunningSidecar, sample: str) -> float:
    async with http.get(sidecar.admin_url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- the listener ------------------------------------------------------------------------------


async def served_serial(context: ssl.SSLContext, pki: Pki) -> int:
    """The serial of the certificate a server with ``context`` presents in a handshake."""

    async def close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0, ssl=context)
    async with server:
        port = server.sockets[0].getsockname()[1]
        connection = await TlsConnection.open(pki.client_context(), f"https://127.0.0.1:{port}")
        await connection.close()
    return connection.serial


def issued_pair(pki: Pki) -> tuple[bytes, bytes, int]:
    cert_file, key_file, serial = pki.issue("127.0.0.1")
    return Path(cert_file).read_bytes(), Path(key_file).read_bytes(), serial


def load_through_memory_files(
    pair: tuple[bytes, bytes], memfd: bool
) -> tuple[ssl.SSLContext, list[str], bool]:
    """A server context loaded from ``memory_files``; what their paths pointed to; whether any
    of the paths still opens once the block is over."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with memory_files(*pair, memfd=memfd) as paths:
        targets = [os.readlink(path) for path in paths]
        context.load_cert_chain(*paths)
    return context, targets, any(os.path.exists(path) for path in paths)


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "pipe"])
async def test_memory_files_hand_openssl_a_pair_no_file_system_holds(pki: Pki, memfd: bool) -> None:
    cert_pem, key_pem, serial = issued_pair(pki)
    context, targets, still_open = load_through_memory_files((cert_pem, key_pem), memfd)
    assert not still_open  # closed once read
    # An anonymous file or a pipe: nothing that a directory lists.
    assert all(target.startswith("/memfd:" if memfd else "pipe:") for target in targets)
    assert await served_serial(context, pki) == serial


async def test_a_pair_in_memory_has_no_files_to_watch_and_stays_on_reload(pki: Pki) -> None:
    cert_pem, key_pem, serial = issued_pair(pki)
    tls = ServerTls.in_memory(cert_pem, key_pem)
    assert tls.files == ()
    await tls.reload()
    assert await served_serial(tls.context, pki) == serial


async def test_the_listener_serves_https_from_tls_1_2(
    start_sidecar_with: StartSidecar, pki: Pki, tmp_path: Path, trusting: aiohttp.ClientSession
) -> None:
    cert = pki.issue("127.0.0.1", "localhost")
    secret = secret_with(tmp_path / "secret", cert)
    sidecar = await start_sidecar_with(**listener_settings(secret))
    assert sidecar.url.startswith("https://")
    async with trusting.get(sidecar.url + "/health") as response:
        assert response.status == 200
    assert await serial_on_a_new_connection(pki, sidecar.url) == cert[2]

    # Clients whose library allows any version: offering TLS 1.2 at most is served, offering
    # 1.1 at most is refused by the server.
    def offering(maximum: ssl.TLSVersion) -> ssl.SSLContext:
        context = pki.client_context()
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # naming TLS 1.0/1.1 warns
            context.minimum_version = ssl.TLSVersion.TLSv1
            context.maximum_version = maximum
        return context

    connection = await TlsConnection.open(offering(ssl.TLSVersion.TLSv1_2), sidecar.url)
    assert await connection.get("/health") == 200
    await connection.close()
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        await TlsConnection.open(offering(ssl.TLSVersion.TLSv1_1), sidecar.url)
    # Plain HTTP on the TLS port is no request at all.
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session:
            await session.get(sidecar.url.replace("https://", "http://") + "/health")


async def test_a_tls_1_3_minimum_refuses_a_tls_1_2_client(
    start_sidecar_with: StartSidecar, pki: Pki, tmp_path: Path
) -> None:
    """SIDECAR_TLS_MIN_VERSION=1.3 (llm-d's --tls-min-version=VersionTLS13)."""
    secret = secret_with(tmp_path / "secret", pki.issue("127.0.0.1"))
    sidecar = await start_sidecar_with(
        **listener_settings(secret), **translate(["--tls-min-version=VersionTLS13"], {}).settings
    )

    def offering(maximum: ssl.TLSVersion) -> ssl.SSLContext:
        context = pki.client_context()
        context.maximum_version = maximum
        return context

    connection = await TlsConnection.open(offering(ssl.TLSVersion.TLSv1_3), sidecar.url)
    assert await connection.get("/health") == 200
    await connection.close()
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        await TlsConnection.open(offering(ssl.TLSVersion.TLSv1_2), sidecar.url)


async def test_the_admin_port_serves_https_too_unless_told_otherwise(
    start_sidecar_with: StartSidecar, pki: Pki, tmp_path: Path, trusting: aiohttp.ClientSession
) -> None:
    secret = secret_with(tmp_path / "secret", pki.issue("127.0.0.1"))
    both = await start_sidecar_with(**listener_settings(secret), admin_port=0)
    assert both.admin_url.startswith("https://")
    async with trusting.get(both.admin_url + "/metrics") as response:
        assert response.status == 200
    plain = await start_sidecar_with(**listener_settings(secret), admin_port=0, admin_tls=False)
    assert plain.url.startswith("https://")
    assert plain.admin_url.startswith("http://")
    async with trusting.get(plain.admin_url + "/metrics") as response:
        assert response.status == 200


async def test_a_rotation_done_the_kubernetes_way_is_picked_up_without_restart(
    start_sidecar_with: StartSidecar, pki: Pki, tmp_path: Path, trusting: aiohttp.ClientSession
) -> None:
    first, second = pki.issue("127.0.0.1"), pki.issue("127.0.0.1")
    secret = secret_with(tmp_path / "secret", first)
    sidecar = await start_sidecar_with(**listener_settings(secret))
    before = await TlsConnection.open(pki.client_context(), sidecar.url)  # stays open
    assert before.serial == first[2]
    assert await before.get("/health") == 200

    secret.write({"tls.crt": second[0], "tls.key": second[1]})

    async def rotated() -> bool:
        return await serial_on_a_new_connection(pki, sidecar.url) == second[2]

    await eventually(rotated)
    # The connection opened before the rotation carries on, with its certificate.
    assert await before.get("/health") == 200
    await before.close()
    assert await metric(trusting, sidecar, 'pd_sidecar_tls_reloads_total{files="listener",'
                        'outcome="reloaded"}') == 1  # fmt: skip


async def test_a_bad_new_pair_keeps_the_old_certificate(
    start_sidecar_with: StartSidecar,
    pki: Pki,
    tmp_path: Path,
    trusting: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, second, third = (pki.issue("127.0.0.1") for _ in range(3))
    secret = secret_with(tmp_path / "secret", first)
    sidecar = await start_sidecar_with(**listener_settings(secret))
    failed = 'pd_sidecar_tls_reloads_total{files="listener",outcome="failed"}'
    with caplog.at_level(logging.ERROR, logger="sidecar.security.tls"):
        # A certificate with another certificate's key: OpenSSL refuses the pair.
        secret.write({"tls.crt": second[0], "tls.key": first[1]})

        async def refused() -> bool:
            return await metric(trusting, sidecar, failed) == 1

        await eventually(refused)
    assert "key values mismatch" in caplog.text
    assert "kept the previous ones" in caplog.text
    assert await serial_on_a_new_connection(pki, sidecar.url) == first[2]

    secret.write({"tls.crt": third[0], "tls.key": third[1]})

    async def recovered() -> bool:
        return await serial_on_a_new_connection(pki, sidecar.url) == third[2]

    await eventually(recovered)
    assert await metric(trusting, sidecar, failed) == 1


async def test_certificate_files_that_do_not_load_stop_the_start(
    start_sidecar_with: StartSidecar, tmp_path: Path
) -> None:
    from sidecar.security.tls import TlsFilesError

    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TlsFilesError, match=r"missing\.pem.*no such file"):
        await start_sidecar_with(tls_cert_file=missing, tls_key_file=missing)


# --- the engines ---------------------------------------------------------------------------------


async def https_engine(start_engine: StartEmulator, pki: Pki, *names: str, **config: Any) -> Any:
    cert = pki.issue(*(names or ("127.0.0.1",)))
    return await start_engine(tls_cert_file=cert[0], tls_key_file=cert[1], **config)


async def last_record(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> dict[str, Any]:
    async with http.get(sidecar.admin_url + "/debug/requests?limit=1") as response:
        return dict((await response.json())["recent"][0])


async def test_both_engine_legs_and_the_client_leg_over_tls(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    trusting: aiohttp.ClientSession,
) -> None:
    prefill = await https_engine(start_engine, pki)
    decode = await https_engine(start_engine, pki)
    secret = secret_with(tmp_path / "secret", pki.issue("127.0.0.1"))
    sidecar = await start_sidecar_with(
        **listener_settings(secret),
        decode_url=decode.url,
        prefill_tls=True,
        tls_ca_file=pki.ca_file,
    )
    assert decode.url.startswith("https://")
    body = chat(max_tokens=4)
    headers = {HEADER: prefill.endpoint}
    async with trusting.post(
        sidecar.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
    record = await last_record(trusting, sidecar)
    assert record["decision"] == "remote"
    assert record["fallback_reason"] is None
    for engine in (prefill, decode):
        async with trusting.get(engine.url + "/emulator/requests") as response:
            assert len((await response.json())["requests"]) == 1


async def test_mtls_the_client_certificate_opens_an_engine_that_requires_one(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    http: aiohttp.ClientSession,
) -> None:
    prefill = await https_engine(start_engine, pki, tls_client_ca_file=pki.ca_file)
    client_cert = pki.issue("pd-sidecar.test")
    common = {"prefill_tls": True, "tls_ca_file": pki.ca_file}
    without = await start_sidecar_with(**common)
    with_cert = await start_sidecar_with(
        **common, tls_client_cert_file=client_cert[0], tls_client_key_file=client_cert[1]
    )
    headers = {HEADER: prefill.endpoint}
    for sidecar, decision in ((without, "local"), (with_cert, "remote")):
        async with http.post(
            sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2), headers=headers
        ) as response:
            assert response.status == 200, await response.text()
        assert (await last_record(http, sidecar))["decision"] == decision


async def test_an_untrusted_prefill_certificate_is_a_failed_prefill(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stranger = Pki(tmp_path / "stranger", "stranger")
    prefill = await https_engine(start_engine, stranger)
    local = await start_sidecar_with(prefill_tls=True, tls_ca_file=pki.ca_file)
    headers = {HEADER: prefill.endpoint}
    with caplog.at_level(logging.WARNING, logger="sidecar.connectors.prefill"):
        async with http.post(
            local.url + "/v1/chat/completions", json=chat(max_tokens=2), headers=headers
        ) as response:
            assert response.status == 200, await response.text()
    record = await last_record(http, local)
    assert record["decision"] == "local"
    assert record["fallback_reason"] == "prefill_unreachable"
    said = f"the certificate of the prefill engine at {prefill.endpoint} did not verify"
    assert said in caplog.text
    assert "unable to get local issuer certificate" in caplog.text

    failing = await start_sidecar_with(
        prefill_tls=True, tls_ca_file=pki.ca_file, prefill_fallback="fail"
    )
    async with http.post(
        failing.url + "/v1/chat/completions", json=chat(max_tokens=2), headers=headers
    ) as response:
        assert response.status == 503
        assert said in (await response.json())["error"]["message"]


async def test_an_untrusted_decode_certificate_answers_503_saying_so(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    decode = await https_engine(start_engine, Pki(tmp_path / "stranger", "stranger"))
    sidecar = await start_sidecar_with(decode_url=decode.url, tls_ca_file=pki.ca_file)
    # A request sent before the first /health poll is judged meets the certificate itself.
    async with http.post(sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2)) as response:
        assert response.status == 503
        error = (await response.json())["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert error["message"].startswith(
        (
            f"the certificate of the decode engine at {decode.endpoint} did not verify: ",
            f"the decode engine is down, nothing was sent: the certificate of decode engine at "
            f"{decode.endpoint} did not verify: ",
        )
    )
    await eventually(lambda: _not_ready(http, sidecar))  # its /health does not verify either
    async with http.post(sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2)) as response:
        assert response.status == 503
        error = (await response.json())["error"]
    assert error["message"].startswith(
        f"the decode engine is down, nothing was sent: the certificate of decode engine at "
        f"{decode.endpoint} did not verify: "
    )


async def _not_ready(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> bool:
    async with http.get(sidecar.url + "/ready") as response:
        return response.status == 503


async def test_what_a_prefill_certificate_is_verified_against(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    http: aiohttp.ClientSession,
) -> None:
    """A header naming a host name is called at the checked address, but verified against the
    name; an IP target is verified against the IP, or against SIDECAR_PREFILL_TLS_SERVER_NAME."""
    by_name = await https_engine(start_engine, pki, "localhost")
    by_service = await https_engine(start_engine, pki, "prefill.llm.svc")
    pinning = await start_sidecar_with(
        prefill_tls=True,
        tls_ca_file=pki.ca_file,
        prefill_allowed_cidrs="127.0.0.0/8,::1/128",
    )
    named = await start_sidecar_with(
        prefill_tls=True, tls_ca_file=pki.ca_file, prefill_tls_server_name="prefill.llm.svc"
    )
    cases = [
        (pinning, f"localhost:{by_name.port}", "remote"),  # pinned to 127.0.0.1, verified as name
        (pinning, f"127.0.0.1:{by_name.port}", "local"),  # the certificate has no IP address
        (named, f"127.0.0.1:{by_service.port}", "remote"),
        (named, f"127.0.0.1:{by_name.port}", "local"),  # not issued for prefill.llm.svc
    ]
    for sidecar, target, decision in cases:
        async with http.post(
            sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2), headers={HEADER: target}
        ) as response:
            assert response.status == 200, await response.text()
        assert (await last_record(http, sidecar))["decision"] == decision, target


async def test_the_engines_ca_bundle_is_reloaded_when_it_changes(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    """A CA bundle that changes (rotated like a Secret) verifies new connections."""
    new_ca = Pki(tmp_path / "new", "new")
    prefill = await https_engine(start_engine, new_ca)
    bundle = SecretDir(tmp_path / "ca")
    bundle.write({"ca.crt": pki.ca_file})
    sidecar = await start_sidecar_with(
        prefill_tls=True, tls_ca_file=bundle.file("ca.crt"), tls_reload_interval_s=0.02
    )
    headers = {HEADER: prefill.endpoint}

    async def decided() -> str:
        async with http.post(
            sidecar.url + "/v1/chat/completions", json=chat(max_tokens=2), headers=headers
        ) as response:
            assert response.status == 200
        return str((await last_record(http, sidecar))["decision"])

    assert await decided() == "local"
    bundle.write({"ca.crt": new_ca.ca_file})

    async def trusted() -> bool:
        return await decided() == "remote"

    await eventually(trusted)


async def test_insecure_skip_verify_accepts_any_certificate_and_warns(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = await https_engine(start_engine, Pki(tmp_path / "stranger", "stranger"))
    with caplog.at_level(logging.WARNING, logger="sidecar.app"):
        sidecar = await start_sidecar_with(prefill_tls=True, tls_insecure_skip_verify=True)
    assert "SIDECAR_TLS_INSECURE_SKIP_VERIFY=true" in caplog.text
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={HEADER: prefill.endpoint},
    ) as response:
        assert response.status == 200
    assert (await last_record(http, sidecar))["decision"] == "remote"


async def test_llmds_skip_flag_for_the_prefill_leaves_an_https_decode_verified(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """llm-d's --tls-insecure-skip-verify=prefiller, with the decode engine on https:// by
    SIDECAR_DECODE_URL: the prefill's unknown certificate is accepted, the decode's refused (by
    its /health polls, and then by every request, before its prefill)."""
    stranger = Pki(tmp_path / "stranger", "stranger")
    prefill = await https_engine(start_engine, stranger)
    decode = await https_engine(start_engine, stranger)
    flags = translate(
        ["--enable-tls=prefiller", "--tls-insecure-skip-verify=prefiller"],
        {"SIDECAR_DECODE_URL": decode.url, "SIDECAR_TLS_INSECURE_SKIP_VERIFY": "true"},
    ).settings
    with caplog.at_level(logging.WARNING, logger="sidecar.app"):
        sidecar = await start_sidecar_with(
            decode_url=decode.url, tls_insecure_skip_verify=True, **flags
        )
    assert "SIDECAR_PREFILL_TLS_INSECURE_SKIP_VERIFY=true" in caplog.text
    assert "decode engine are not verified" not in caplog.text
    await eventually(lambda: _not_ready(http, sidecar))
    async with http.get(sidecar.url + "/ready") as response:
        reason = (await response.json())["error"]["message"]
    assert reason.startswith(f"the certificate of decode engine at {decode.endpoint} did not")
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={HEADER: prefill.endpoint},
    ) as response:
        assert response.status == 503
        message = (await response.json())["error"]["message"]
    assert message == f"the decode engine is down, nothing was sent: {reason}"
    # The same flags in front of a plain-HTTP decode engine: the prefill goes through,
    # unverified (asked of the emulator over its own TLS).
    plain = await start_engine()
    served = await start_sidecar_with(decode_url=plain.url, tls_insecure_skip_verify=True, **flags)
    async with http.post(
        served.url + "/v1/chat/completions",
        json=chat(max_tokens=2),
        headers={HEADER: prefill.endpoint},
    ) as response:
        assert response.status == 200, await response.text()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as insecure:
        assert len(await engine_requests(insecure, prefill)) == 1


async def test_a_decode_that_skips_verification_leaves_the_prefill_verified(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    stranger = Pki(tmp_path / "stranger", "stranger")
    decode = await https_engine(start_engine, stranger)
    trusted, untrusted = (
        await https_engine(start_engine, pki),
        await https_engine(start_engine, stranger),
    )
    sidecar = await start_sidecar_with(
        decode_url=decode.url,
        prefill_tls=True,
        tls_ca_file=pki.ca_file,
        decode_tls_insecure_skip_verify=True,
    )
    for prefill, decision in ((trusted, "remote"), (untrusted, "local")):
        async with http.post(
            sidecar.url + "/v1/chat/completions",
            json=chat(max_tokens=2),
            headers={HEADER: prefill.endpoint},
        ) as response:
            assert response.status == 200, await response.text()
        record = await last_record(http, sidecar)
        assert record["decision"] == decision
    assert record["fallback_reason"] == "prefill_unreachable"


def test_stage_skip_settings() -> None:
    from pydantic import ValidationError

    both = Settings(prefill_tls=True, decode_url="https://127.0.0.1:8443")
    assert (both.prefill_skip_verify, both.decode_skip_verify) == (False, False)
    stage = Settings(
        prefill_tls=True,
        decode_url="https://127.0.0.1:8443",
        tls_insecure_skip_verify=True,
        decode_tls_insecure_skip_verify=False,
        tls_ca_file="/etc/ca.pem",  # the decode engine's
    )
    assert (stage.prefill_skip_verify, stage.decode_skip_verify) == (True, False)
    with pytest.raises(ValidationError, match="SIDECAR_PREFILL_TLS=true, or unset it"):
        Settings(prefill_tls_insecure_skip_verify=True)
    with pytest.raises(ValidationError, match="verifies no certificate"):
        Settings(
            decode_url="https://127.0.0.1:8443",
            decode_tls_insecure_skip_verify=True,
            tls_ca_file="/etc/ca.pem",
        )


def test_engine_tls_settings_without_an_https_engine_are_refused() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="verifies no certificate"):
        Settings(prefill_tls=True, tls_insecure_skip_verify=True, tls_ca_file="/etc/ca.pem")
    with pytest.raises(ValidationError, match="SIDECAR_PREFILL_TLS is false"):
        Settings(prefill_tls_server_name="prefill.llm.svc")
    assert Settings(decode_url="https://127.0.0.1:8443", tls_ca_file="/etc/ca.pem").tls_ca_file


@pytest.mark.system
async def test_the_process_on_uvloop_serves_https_and_follows_a_rotation(
    pki: Pki, tmp_path: Path, decode: Any
) -> None:
    """``python -m sidecar`` (uvloop's own TLS implementation, not asyncio's) hands each new
    handshake the rotated certificate too."""
    first, second = pki.issue("127.0.0.1"), pki.issue("127.0.0.1")
    secret = secret_with(tmp_path / "secret", first)
    port = free_port()
    url = f"https://127.0.0.1:{port}"

    async def up() -> bool:
        try:
            return await serial_on_a_new_connection(pki, url) > 0
        except OSError:
            return False

    settings = {
        "port": str(port),
        "decode_url": decode.url,
        "tls_cert_file": secret.file("tls.crt"),
        "tls_key_file": secret.file("tls.key"),
        "tls_reload_interval_s": "0.05",
    }
    async with sidecar_process(settings, until=up) as process:
        assert await serial_on_a_new_connection(pki, url) == first[2]
        before = await TlsConnection.open(pki.client_context(), url)
        secret.write({"tls.crt": second[0], "tls.key": second[1]})

        async def rotated() -> bool:
            return await serial_on_a_new_connection(pki, url) == second[2]

        await eventually(rotated, within=20)
        assert await before.get("/health") == 200  # opened before: still served
        await before.close()
        log = await process.log()
    assert "event loop: uvloop" in log
    assert f"listening on {url}" in log
    assert "the listener's certificate: reloaded" in log


async def test_a_pool_member_is_scheduled_and_scraped_over_https(
    start_sidecar_with: StartSidecar,
    start_engine: StartEmulator,
    pki: Pki,
    http: aiohttp.ClientSession,
) -> None:
    prefill = await https_engine(start_engine, pki)
    sidecar = await start_sidecar_with(
        prefill_endpoints=prefill.endpoint,
        prefill_tls=True,
        tls_ca_file=pki.ca_file,
        disagg_min_tokens=0,
        scrape_interval_s=0.05,
    )

    async def scraped() -> bool:
        async with http.get(sidecar.url + "/debug/scheduler") as response:
            (endpoint,) = (await response.json())["endpoints"]
        return endpoint["scraped"] is not None and endpoint["state"] == "healthy"

    await eventually(scraped)
    async with http.post(
        sidecar.url + "/v1/chat/completions", json=chat("x " * 400, max_tokens=2)
    ) as response:
        assert response.status == 200
    record = await last_record(http, sidecar)
    assert (record["decision"], record["reason"]) == ("remote", "scheduled")
