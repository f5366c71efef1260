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

from sidecar.emulator.events import KvEventsOptions, parse_kv_events_config
from sidecar.emulator.faults import FaultSpec

Mode = Literal["strict", "lenient"]
MODES: tuple[Mode, ...] = ("strict", "lenient")
KvProtocol = Literal["nixl", "nixl-push", "sglang", "shared-storage"]
KV_PROTOCOLS: tuple[KvProtocol, ...] = ("nixl", "nixl-push", "sglang", "shared-storage")
DisaggregationMode = Literal["null", "prefill", "decode"]
DISAGGREGATION_MODES: tuple[DisaggregationMode, ...] = ("null", "prefill", "decode")
Tokenizer = Literal["chars", "words"]
TOKENIZERS: tuple[Tokenizer, ...] = ("chars", "words")
KvEventsEncoding = Literal["map", "array"]
KV_EVENTS_ENCODINGS: tuple[KvEventsEncoding, ...] = ("map", "array")
CHOICES: dict[str, tuple[str, ...]] = {
    "mode": MODES,
    "kv_protocol": KV_PROTOCOLS,
    "disaggregation_mode": DISAGGREGATION_MODES,
    "tokenizer": TOKENIZERS,
    "kv_events_encoding": KV_EVENTS_ENCODINGS,
}
ATTENTION_CROSSOVER_TOKENS = 53_250
"""Prompt length at which a prefill's attention FLOPs equal those of the rest of the model, for
a Llama-3-8B-shaped model (docs/emulator.md, *Latency model*)."""


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Configuration of one emulator instance (see docs/emulator.md for the semantics)."""

    host: str = field(
        default="127.0.0.1",
        metadata=_doc(
            "address(es) the API listens on: a comma list, e.g. 0.0.0.0,:: for both families"
        ),
    )
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
        default=4096,
        metadata=_doc(
            "KV blocks of the emulated GPU: the prefix cache's capacity (LRU) and the "
            "denominator of kv_cache_usage_perc"
        ),
    )
    max_model_len: int = field(
        default=32768, metadata=_doc("context length; prompt + output beyond it is a 400")
    )
    max_num_seqs: int = field(
        default=0, metadata=_doc("max concurrently running requests, others wait; 0 = unlimited")
    )
    prefill_s_per_token: float = field(
        default=0.0, metadata=_doc("prefill seconds per uncached prompt token (the linear term)")
    )
    prefill_crossover_tokens: int = field(
        default=ATTENTION_CROSSOVER_TOKENS,
        metadata=_doc(
            "prompt tokens at which prefill's quadratic (attention) term equals the linear one: "
            "b = prefill_s_per_token / this; 0 = linear prefill"
        ),
    )
    tokenizer: Tokenizer = field(
        default="chars",
        metadata=_doc("how a text prompt is counted: chars (ceil(characters / 4)) or words"),
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
    kv_protocol: KvProtocol = field(
        default="nixl",
        metadata=_doc(
            "KV transfer protocol: nixl (vLLM pull), nixl-push (vLLM NixlPushConnector), "
            "sglang (bootstrap rooms), shared-storage (a directory of blocks)"
        ),
    )
    push_registration_timeout_s: float = field(
        default=480.0,
        metadata=_doc("nixl-push: seconds a decode waits for its registration to be matched"),
    )
    disaggregation_mode: DisaggregationMode = field(
        default="null",
        metadata=_doc("sglang: this server's role, like SGLang's --disaggregation-mode"),
    )
    bootstrap_timeout_s: float = field(
        default=300.0,
        metadata=_doc("sglang prefill: seconds a computed room waits for a decode to claim it"),
    )
    waiting_timeout_s: float = field(
        default=300.0,
        metadata=_doc("sglang decode: seconds a request waits for its room's KV"),
    )
    kv_store: str | None = field(
        default=None,
        metadata=_doc("shared-storage: directory of KV blocks shared by the engines"),
    )
    kv_store_max_blocks: int = field(
        default=0,
        metadata=_doc("shared-storage: blocks kept in the store, least recent evicted; 0 = no cap"),
    )
    keepalive_timeout_s: float = field(
        default=5.0,
        metadata=_doc(
            "seconds an idle API connection stays open, then the server closes it "
            "(vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5)"
        ),
    )
    tls_cert_file: str | None = field(
        default=None,
        metadata=_doc("PEM certificate: the API serves HTTPS (with --tls-key-file)"),
    )
    tls_key_file: str | None = field(
        default=None, metadata=_doc("PEM private key of --tls-cert-file")
    )
    tls_client_ca_file: str | None = field(
        default=None,
        metadata=_doc("HTTPS: require a client certificate signed by this PEM CA (mTLS)"),
    )
    kv_events_config: str | None = field(
        default=None,
        metadata=_doc(
            "vLLM's --kv-events-config JSON: publish KV-cache events over ZMQ, e.g. "
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
        ),
    )
    kv_events_encoding: KvEventsEncoding = field(
        default="map",
        metadata=_doc(
            "KV events' encoding: map (tagged by type, vLLM 0.32) or array (earlier vLLM)"
        ),
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
            "prefill_crossover_tokens": self.prefill_crossover_tokens,
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
        self._check_protocol()

    def _check_protocol(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in (
            "push_registration_timeout_s",
            "bootstrap_timeout_s",
            "waiting_timeout_s",
            "keepalive_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.kv_store_max_blocks < 0:
            raise ValueError("kv_store_max_blocks must be >= 0")
        sglang = self.kv_protocol == "sglang"
        if sglang and self.disaggregation_mode == "null":
            raise ValueError("kv_protocol sglang needs disaggregation_mode prefill or decode")
        if not sglang and self.disaggregation_mode != "null":
            raise ValueError("disaggregation_mode applies to kv_protocol sglang only")
        shared = self.kv_protocol == "shared-storage"
        if shared and not self.kv_store:
            raise ValueError("kv_protocol shared-storage needs kv_store (a directory)")
        if not shared and self.kv_store is not None:
            raise ValueError("kv_store applies to kv_protocol shared-storage only")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file (HTTPS)")
        self.kv_events()  # raises ValueError on a bad --kv-events-config

    def kv_events(self) -> KvEventsOptions | None:
        """The parsed ``kv_events_config`` (None: not given)."""
        if self.kv_events_config is None:
            return None
        return parse_kv_events_config(self.kv_events_config)


_PATHS = frozenset({"kv_store", "tls_cert_file", "tls_key_file", "tls_client_ca_file"})
"""Fields whose flag takes a path (default: none)."""
_JSON = frozenset({"kv_events_config"})
"""Fields whose flag takes a JSON text (default: none)."""


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse_cli(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.emulator",
        description="vLLM-compatible engine emulator speaking NIXL (pull or push), SGLang "
        "bootstrap rooms or shared-storage KV transfer.",
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
        elif f.name in CHOICES:
            parser.add_argument(flag, choices=CHOICES[f.name], default=default, help=help_text)
        elif f.name in _PATHS:
            parser.add_argument(flag, type=str, default=None, metavar="PATH", help=help_text)
        elif f.name in _JSON:
            parser.add_argument(flag, type=str, default=None, metavar="JSON", help=help_text)
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
