"""EmulatorConfig — every knob of the emulator — and the command line built from it.

Defaults are chosen for tests: no latency, small blocks, a 30 s KV lease. Each field becomes one
``--kebab-case`` flag; the ``faults`` field becomes the repeatable ``--fault`` flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sidecar.emulator.faults import FaultSpec

Mode = Literal["strict", "lenient"]
MODES: tuple[Mode, ...] = ("strict", "lenient")


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Configuration of one emulator instance (see docs/emulator.md for the semantics)."""

    host: str = field(default="127.0.0.1", metadata=_doc("address the API listens on"))
    port: int = field(default=8200, metadata=_doc("API port; 0 picks a free port"))
    side_channel_port: int = field(
        default=0, metadata=_doc("NIXL side-channel port (advertised as remote_port); 0 = free")
    )
    side_channel_host: str = field(
        default="127.0.0.1",
        metadata=_doc("side-channel bind address, advertised as remote_host (vLLM: localhost)"),
    )
    model: str = field(default="emulated-model", metadata=_doc("served model name"))
    mode: Mode = field(
        default="strict", metadata=_doc("strict rejects proxy mistakes; lenient mimics vLLM 0.32")
    )
    block_size: int = field(default=16, metadata=_doc("tokens per KV block"))
    kv_expiry_s: float = field(
        default=30.0, metadata=_doc("seconds staged prefill blocks wait for a pull before expiry")
    )
    num_gpu_blocks: int = field(
        default=4096, metadata=_doc("KV blocks of the emulated GPU (for kv_cache_usage_perc)")
    )
    max_model_len: int = field(
        default=32768, metadata=_doc("context length; prompt + output beyond it is a 400")
    )
    max_num_seqs: int = field(
        default=0, metadata=_doc("max concurrently running requests, others wait; 0 = unlimited")
    )
    prefill_s_per_token: float = field(
        default=0.0, metadata=_doc("prefill seconds per uncached prompt token")
    )
    kv_transfer_s_per_block: float = field(
        default=0.0, metadata=_doc("seconds per block pulled, spent on the decode side")
    )
    decode_s_per_token: float = field(
        default=0.0, metadata=_doc("seconds per output token after the first")
    )
    concurrency_slowdown: float = field(
        default=0.0,
        metadata=_doc("prefill/decode times x (1 + slowdown * (running - 1))"),
    )
    jitter: float = field(default=0.0, metadata=_doc("relative uniform jitter on every delay"))
    seed: int = field(default=0, metadata=_doc("seed of the jitter RNG"))
    default_max_tokens: int = field(
        default=16, metadata=_doc("output tokens when the request sets no token limit")
    )
    prompt_tokens_details: bool = field(
        default=False, metadata=_doc("report usage.prompt_tokens_details.cached_tokens")
    )
    request_log_size: int = field(
        default=256, metadata=_doc("how many /v1/* requests GET /emulator/requests keeps")
    )
    kv_pull_timeout_s: float = field(
        default=10.0, metadata=_doc("timeout of one side-channel pull, seconds")
    )
    faults: tuple[FaultSpec, ...] = field(
        default=(), metadata=_doc("faults armed at start (CLI: --fault, repeatable)")
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        positive = {
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_model_len": self.max_model_len,
            "default_max_tokens": self.default_max_tokens,
            "request_log_size": self.request_log_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        non_negative = {
            "port": self.port,
            "side_channel_port": self.side_channel_port,
            "max_num_seqs": self.max_num_seqs,
            "kv_expiry_s": self.kv_expiry_s,
            "prefill_s_per_token": self.prefill_s_per_token,
            "kv_transfer_s_per_block": self.kv_transfer_s_per_block,
            "decode_s_per_token": self.decode_s_per_token,
            "concurrency_slowdown": self.concurrency_slowdown,
        }
        for name, num in non_negative.items():
            if num < 0:
                raise ValueError(f"{name} must be >= 0, got {num}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.kv_pull_timeout_s <= 0:
            raise ValueError("kv_pull_timeout_s must be > 0")


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse_cli(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.emulator",
        description="vLLM-compatible engine emulator with an emulated NIXL KV side channel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(EmulatorConfig):
        help_text = f.metadata["help"]
        if f.name == "faults":
            parser.add_argument(
                "--fault",
                dest="faults",
                action="append",
                type=_fault,
                default=[],
                metavar="KIND[:ARG[:COUNT]][@ROLE]",
                help="arm a fault at start, e.g. status:503:2, hang, disconnect:3@decode, "
                "health_down (repeatable)",
            )
            continue
        flag = "--" + f.name.replace("_", "-")
        default: Any = f.default
        if isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif f.name == "mode":
            parser.add_argument(flag, choices=MODES, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_text)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> EmulatorConfig:
    """Parse the command line into a config; argparse exits with status 2 on bad input."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    args["faults"] = tuple(args["faults"])
    try:
        return EmulatorConfig(**args)
    except ValueError as exc:
        parser.error(str(exc))
