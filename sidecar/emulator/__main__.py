"""``python -m sidecar.emulator``: run one emulator until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from sidecar.emulator.app import start_emulator
from sidecar.emulator.config import EmulatorConfig, config_from_args
from sidecar.server.binding import CannotListen

log = logging.getLogger("sidecar.emulator")
MODULE = "python -m sidecar.emulator"


async def serve(config: EmulatorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.debug("effective configuration: %s", config)
    try:
        emulator = await start_emulator(config)
    except CannotListen as exc:  # a port in use or not permitted (its listeners closed again)
        raise CannotStart(str(exc)) from None
    try:
        log.info(
            "emulator serving %s at %s (side channel %s:%d, engine %s, %s mode, kv protocol %s%s)",
            config.model,
            emulator.url,
            config.side_channel_host,
            emulator.side_channel_port,
            emulator.engine_id,
            config.mode,
            config.kv_protocol,
            f" {config.disaggregation_mode}" if config.kv_protocol == "sglang" else "",
        )
        await stop.wait()
        log.info("emulator stopping")
    finally:
        await emulator.close()


class CannotStart(Exception):
    """The emulator cannot serve (a port it cannot bind); its message is one line."""


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(serve(config))
    except CannotStart as exc:
        print(f"{MODULE}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
