"""``python -m sidecar``: read Settings (the environment, and llm-d's sidecar flags over it),
configure logging, install uvloop, serve until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from sidecar import __version__, llmd
from sidecar.app import DRAIN, TLS_VERSIONS
from sidecar.config import Settings, describe_fields, explain, unknown_variables
from sidecar.drain import BUDGET_SLACK_S
from sidecar.llmd import FlagError, Translation
from sidecar.observability.tracing import Tracing, TracingUnavailable
from sidecar.security.tls import ServerTls, TlsFilesError
from sidecar.server.listener import raise_open_files_limit
from sidecar.server.runner import CannotListen, RunningSidecar, start_sidecar

logger = logging.getLogger("sidecar")

MODULE = "python -m sidecar"
USAGE = """usage: {prog} [--help] [--version] [llm-d sidecar flags]

pd-sidecar {version}: the decode-pod sidecar of prefill/decode-disaggregated LLM serving.
It is configured with environment variables (list values are comma-separated):
"""

FLAGS_HEADING = """
It also accepts the flags of llm-d's routing sidecar, as -flag or --flag, -flag=value or
-flag value; a flag wins over the variable it maps to (docs/migrating-from-llm-d.md):
"""


def _help(argv0: str = "") -> str:
    """``--help``'s text, its usage line naming the command as ``argv0`` says it was typed (the
    console script ``pd-sidecar``, else ``python -m sidecar``)."""
    from sidecar.inject.__main__ import prog_name  # only for --help: argparse, yaml

    rows = describe_fields()
    width = max(len(name) for name, _, _ in rows)
    lines = [USAGE.format(prog=prog_name(argv0, MODULE), version=__version__)]
    for name, default, description in rows:
        lines.append(f"  {name:<{width}}  default: {default or '(empty)'}")
        lines.append(f"  {'':<{width}}  {description}")
    lines.append(FLAGS_HEADING)
    flags = llmd.help_rows()
    width = max(len(typed) for typed, _ in flags)
    for typed, maps_to in flags:
        lines.append(f"  {typed:<{width}}  -> {maps_to}")
    lines.append("\nDocumentation: docs/configuration.md, docs/migrating-from-llm-d.md")
    return "\n".join(lines)


def read_flags(args: list[str]) -> Translation:
    """What llm-d's sidecar flags in ``args`` ask for; exit status 2 with a one-line message
    when one is unknown or cannot be honoured."""
    try:
        return llmd.translate(args, os.environ)
    except FlagError as exc:
        print(f"pd-sidecar: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def self_signed(settings: Settings) -> ServerTls:
    """The listener's TLS with a self-signed certificate made now, held in memory only; exit
    status 1 with a one-line message when it cannot be made."""
    from sidecar.security.selfsigned import self_signed_tls  # cryptography: only when asked

    try:
        return self_signed_tls(TLS_VERSIONS[settings.tls_min_version])
    except (OSError, TlsFilesError) as exc:
        print(f"pd-sidecar: cannot make a self-signed certificate: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def load_settings(overrides: Mapping[str, Any] | None = None) -> Settings:
    """Settings from the environment, ``overrides`` (from flags) winning; exit status 2 with a
    one-line message when invalid."""
    try:
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        print(f"pd-sidecar: {explain(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def load_tracing(settings: Settings) -> Tracing:
    """The tracer provider SIDECAR_TRACING asks for, built from the ``OTEL_*`` variables
    (``NO_TRACING`` when off); exit status 2 with a one-line message when it cannot be (the
    extra or an exporter missing)."""
    try:
        return Tracing.when(settings.tracing)
    except TracingUnavailable as exc:
        print(f"pd-sidecar: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_kv_events(settings: Settings) -> None:
    """Exit status 2 with a one-line message when SIDECAR_KV_EVENTS=true cannot be honoured
    (its extra missing)."""
    if not settings.kv_events:
        return
    from sidecar import kvevents

    problem = kvevents.unavailable()
    if problem is not None:
        print(f"pd-sidecar: {problem}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help", "-help") for arg in args):
        _print(_help(sys.argv[0]))
        return
    if args and args[0] == "--version":
        _print(__version__)
        return
    flags = read_flags(args) if args else Translation()
    settings = load_settings(flags.settings)
    listener_tls = self_signed(settings) if flags.self_signed else None
    tracing = load_tracing(settings)
    check_kv_events(settings)
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _warn_unknown_variables()
    for note in flags.notes:
        logger.warning("llm-d flag: %s", note)
    logger.info("pd-sidecar %s starting with %s", __version__, settings.model_dump_json())
    if tracing.enabled:
        logger.info("tracing on: %s", tracing.description)
    # Before the listener sizes its cap to it (sidecar.server.listener.connection_budget).
    raise_open_files_limit()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        status = asyncio.run(_serve(settings, tracing, listener_tls))
    else:
        status = uvloop.run(_serve(settings, tracing, listener_tls))
    if status:
        raise SystemExit(status)


def _print(text: str) -> None:
    """``text`` on stdout; a reader that went away (``--help | head``) ends it quietly, as
    argparse's help does. Python ignores SIGPIPE, so the write, or the interpreter's own flush at
    exit, raises ``BrokenPipeError``: stdout is pointed at /dev/null so that the flush cannot."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _warn_unknown_variables() -> None:
    for message in unknown_variables(os.environ):
        logger.warning("%s", message)


async def _serve(settings: Settings, tracing: Tracing, listener_tls: ServerTls | None) -> int:
    """Serve until SIGTERM or SIGINT; the exit status (1: a port could not be bound, or TLS
    files could not be loaded)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        sidecar = await start_sidecar(settings, tracing=tracing, listener_tls=listener_tls)
    except (CannotListen, TlsFilesError) as exc:
        logger.error("%s", exc)
        return 1
    _settle_heap(settings.gc_gen0_threshold)
    logger.info(
        "listening on %s (event loop: %s), decode engine %s",
        sidecar.url,
        type(loop).__module__.split(".")[0],
        ", ".join(settings.decode_ranks),
    )
    if sidecar.admin_port is not None:
        logger.info("admin endpoints on %s", sidecar.admin_url)
    await stop.wait()
    await _drain(sidecar, settings.drain_timeout_s)
    return 0


def _settle_heap(gen0_threshold: int) -> None:
    """Start-up's objects (modules, settings, the app, its sessions) will live as long as the
    process: collect once, then freeze them so that no later collection walks them again. And
    collect the young generation less often: the request path allocates a few hundred container
    objects per request, nearly all gone by the end of it, so a collection every 700 allocations
    (Python's default) mostly walks objects that are about to be freed anyway."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(gen0_threshold, older, oldest)


async def _drain(sidecar: RunningSidecar, timeout_s: float) -> None:
    """Fail readiness, stop accepting, let streams finish, cancel stragglers, close: all within
    ``timeout_s`` + 1 s (``sidecar.drain``)."""
    sidecar.begin_drain()
    inflight = sidecar.app[DRAIN].in_flight()
    logger.info("draining: %d request(s) in flight, up to %gs", inflight, timeout_s)
    try:
        async with asyncio.timeout(timeout_s + BUDGET_SLACK_S):
            cut = await sidecar.close()
    except TimeoutError:
        # Every step is bounded on its own; this is the last resort that keeps the promise.
        logger.error("shutdown overran its budget of %gs; exiting anyway", timeout_s)
        return
    logger.info(
        "drained: %d request(s) finished, %d cancelled at the drain timeout",
        max(0, inflight - cut),
        cut,
    )


if __name__ == "__main__":
    main()
