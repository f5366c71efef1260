"""Typed keys of the emulator's aiohttp application and request state."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.engine import Engine
from sidecar.emulator.faults import FaultBoard
from sidecar.emulator.kv import KvStore
from sidecar.emulator.metrics import EmulatorMetrics
from sidecar.emulator.push import PushBoard
from sidecar.emulator.reqlog import RequestLog
from sidecar.emulator.sglang import RoomBoard

CONFIG = web.AppKey("config", EmulatorConfig)
KV = web.AppKey("kv", KvStore)
METRICS = web.AppKey("metrics", EmulatorMetrics)
FAULTS = web.AppKey("faults", FaultBoard)
REQUEST_LOG = web.AppKey("request_log", RequestLog)
SIDE_CHANNEL_PORT = web.AppKey("side_channel_port", int)
STARTED_AT = web.AppKey("started_at", int)
# Handler tasks in flight, so close() can cancel hung and streaming requests promptly.
INFLIGHT = web.AppKey("inflight", set[asyncio.Task[Any]])
PUSH = web.AppKey("push", PushBoard)  # the prefill side's push registrations
ROOMS = web.AppKey("rooms", RoomBoard)  # sglang prefill servers only
POLLS = web.AppKey("polls", dict[str, int])  # /metrics and /health requests served, by path
ENGINE = web.AppKey("engine", Engine)  # set by a cleanup_ctx once the pull session exists

REQUEST_ID = web.RequestKey("request_id", str)
RAW_TARGET = web.RequestKey("raw_target", str)  # the request line's target, before decoding
