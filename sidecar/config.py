"""Settings: the only module that reads the environment.

Every field is an environment variable ``SIDECAR_<NAME>``. List settings are comma-separated
strings (not JSON). ``python -m sidecar --help`` prints ``describe_fields()``, and the settings
table of ``docs/configuration.md`` is generated from it (``python -m devkit.configuration_doc``; a
test fails while the page is out of date): a field's ``description`` is what both show.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Iterable, Mapping
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from yarl import URL

from sidecar import defaults
from sidecar.fleet import connectors
from sidecar.fleet.endpoints import (
    Endpoint,
    parse_endpoint,
    parse_pool_entry,
    split_scheme,
    valid_host,
)

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
"""An HTTP field name (RFC 9110 §5.1)."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A Kubernetes namespace (RFC 1123 label)."""
_DNS_SUBDOMAIN = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
"""A Kubernetes object name (RFC 1123 subdomain)."""
_WEB = frozenset({"http", "https"})
"""The schemes a SIDECAR_PREFILL_ENDPOINTS entry may be written with."""


def _rank_ports_fit(
    prefix: str, port: int | None, replay: int | None, ranks: int, what: str
) -> None:
    """Refuse event ports whose ranks would run past 65535 or collide: vLLM puts rank *r*'s
    events on ``port`` + *r* and its replay on ``replay`` + *r* (``offset_endpoint_port``).
    ``prefix``: the settings' names before ``PORT``; ``what``: the ranks, for the message."""
    for name, first in (("PORT", port), ("REPLAY_PORT", replay)):
        if first is not None and first + ranks - 1 > 65535:
            raise ValueError(f"{prefix}{name}: the ports of {what} from {first} run past 65535")
    if port is not None and replay is not None and abs(port - replay) < ranks:
        raise ValueError(
            f"{prefix}PORT={port} and {prefix}REPLAY_PORT={replay}: with {what} (each on the "
            "port + its rank) a rank's replay port would be another's events port; set them at "
            "least the rank count apart (e.g. 5557, 5657)"
        )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_", frozen=True, extra="forbid")

    host: Annotated[tuple[str, ...], NoDecode] = Field(
        ("0.0.0.0", "::"),
        description="Addresses the sidecar listens on, both ports (comma list; a host name: "
        "each address it resolves to); each is bound as written, 0.0.0.0 for IPv4 and :: for "
        "IPv6. Where IPv6 is disabled, :: is skipped with a warning while another address is "
        "bound.",
    )
    port: int = Field(8000, ge=0, le=65535, description="Port of the API (0 picks a free port).")
    decode_url: str = Field(
        defaults.DECODE_URL,
        description="Base URL of the local decode engine (http or https, no path).",
    )
    decode_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Base URLs of the local decode engine's data-parallel ranks, one HTTP "
        "server per rank (comma list); each request goes to one ready rank. Empty: "
        "SIDECAR_DECODE_URL alone. Setting both is refused.",
    )
    rank_ports: bool = Field(
        False,
        description="With several decode ranks (SIDECAR_DECODE_URLS): listen on SIDECAR_PORT + r "
        "too and send what arrives there to rank r, what arrives on SIDECAR_PORT to rank 0 (as "
        "llm-d's sidecar does). false: SIDECAR_PORT alone, each request to a ready rank.",
    )
    connector: Literal["nixl", "nixl-push", "sglang", "shared-storage"] = Field(
        "nixl",
        description="KV connector protocol spoken to the engines: nixl (vLLM NixlConnector, "
        "pull; alias nixlv2), nixl-push (vLLM NixlPushConnector), sglang (SGLang's bootstrap "
        "rendezvous; every request disaggregates), shared-storage (vLLM ExampleConnector, "
        "LMCache-style stores: the decode finds the KV by prefix).",
    )
    sglang_bootstrap_port: int = Field(
        connectors.SGLANG.bootstrap_port,
        ge=1,
        le=65535,
        description="SGLang prefill servers' bootstrap port (their --disaggregation-bootstrap-"
        "port), for header and DNS targets; a SIDECAR_PREFILL_ENDPOINTS entry may name its own "
        "as host:port#bootstrap_port.",
    )
    prefill_endpoints: Annotated[tuple[Endpoint, ...], NoDecode] = Field(
        (),
        description="Static prefill pool, comma-separated host:port list ([IPv6]:port; with "
        "sglang, host:port#bootstrap_port), from which SIDECAR_SCHEDULER_POLICY picks when no "
        "gateway header names a prefill server. An entry may be an http:// or https:// URL "
        "without a path, its scheme the one SIDECAR_PREFILL_TLS sets. Empty (and no "
        "SIDECAR_PREFILL_DNS): decode locally (sglang: 503).",
    )
    prefill_dns: Endpoint | None = Field(
        None,
        description="name:port of a headless Service whose A and AAAA records are prefill "
        "endpoints, re-resolved every SIDECAR_DISCOVERY_INTERVAL_S. Empty: none.",
    )
    discovery_interval_s: float = Field(
        10, gt=0, description="Seconds between DNS resolutions of SIDECAR_PREFILL_DNS."
    )
    scrape_interval_s: float = Field(
        1, gt=0, description="Seconds between scrapes of each engine's /metrics."
    )
    scheduler_policy: Literal["qoe", "power_of_two", "least_loaded", "round_robin", "random"] = (
        Field(
            "qoe",
            description="How the prefill endpoint is chosen when no header names one: qoe (the "
            "lowest predicted time to first token among SIDECAR_SCHEDULER_CHOICES random "
            "candidates), power_of_two (the less loaded of 2 random candidates), least_loaded "
            "(the fewest scraped waiting + running requests), round_robin (each in turn), "
            "random.",
        )
    )
    scheduler_choices: int = Field(
        defaults.QOE_CHOICES,
        ge=1,
        description="Random candidates the qoe policy compares (best of d; every endpoint of a "
        "pool no larger).",
    )
    scheduler_seed: int | None = Field(
        None, description="Seed of the scheduler's random choices (empty: unpredictable)."
    )
    disagg_min_tokens: int = Field(
        512,
        ge=0,
        description="Uncached prompt tokens (estimated as characters / 4) from which a request "
        "is prefilled remotely; shorter or locally cached prompts are prefilled locally.",
    )
    disagg_ttft_ratio: float = Field(
        2.0,
        gt=0,
        description="Prefill remotely only while the predicted remote time to first token is at "
        "most this many times the local one; beyond it the pool counts as saturated.",
    )
    disagg_stall_weight: float = Field(
        defaults.STALL_WEIGHT,
        ge=0,
        description="Seconds of a new request's time to first token that one second of stall "
        "on one running decode counts for, when the decider weighs a local prefill against a "
        "prefill server with nothing queued (0: the stall is not weighed, and short prompts "
        "always prefill locally).",
    )
    disagg_tpot_slo_ms: float = Field(
        defaults.TPOT_SLO_S * 1000,
        ge=0,
        description="The decodes' TPOT SLO, in milliseconds, that local prefills may not push "
        "them past: each decode rank's stall budget refills at the share of time its decodes can "
        "spare, from the engine's measured step time (docs/scheduling.md; 0: no budget; "
        "otherwise at least 1).",
    )
    disagg_stall_burst_s: float = Field(
        defaults.STALL_BURST_S,
        ge=0,
        description="Seconds of stall a decode rank's budget holds at most: the longest local "
        "prefill (its predicted compute seconds) allowed while decodes run on the engine "
        "(docs/scheduling.md; 0: none, every prompt with uncached tokens goes to a prefill "
        "server while decodes run).",
    )
    # Ageing and re-tests: an endpoint that was slow once must not be starved for good
    # (docs/scheduling.md).
    speed_half_life_s: float = Field(
        defaults.SPEED_HALF_LIFE_S,
        gt=0,
        description="Half-life, in seconds, of the evidence behind a prefill endpoint's speed "
        "estimate (its own fit, or a speed another sidecar published): without new "
        "observations it ages back toward the prior.",
    )
    speed_idle_half_life_s: float = Field(
        defaults.SPEED_IDLE_HALF_LIFE_S,
        gt=0,
        description="Half-life, in seconds, of a stall's evidence in a prefill endpoint's own "
        "speed estimate while its scrapes show it idle (nothing waiting, nothing running) soon "
        "after a scrape of it went unanswered: that evidence gives way to the endpoint's best "
        "measured speed, so that a stall it recovered from is forgotten.",
    )
    scheduler_retest_s: float = Field(
        defaults.RETEST_S,
        ge=0,
        description="Seconds without a measurement (a prefill from this sidecar, or a new speed "
        "another sidecar published) after which an available endpoint that only its speed "
        "estimate keeps away takes the next remote prefill (0: never).",
    )
    prefix_block_tokens: int = Field(
        16, ge=1, description="Block size, in tokens, of the local prefix-cache estimate."
    )
    prefix_cache_blocks: int = Field(
        65536,
        ge=0,
        description="Blocks remembered by the local prefix-cache estimate (LRU); with "
        "SIDECAR_DECODE_URLS, shared equally by the ranks' indexes.",
    )
    # Prefix-aware placement: what each prefill server holds of the prompts (docs/scheduling.md).
    prefill_prefix_index: bool = Field(
        True,
        description="Predict what each prefill endpoint holds in its prefix cache (the prompts "
        "placed there, aged against its capacity) and count only the tokens it would compute; "
        "false: every endpoint computes the whole prompt (prefix-blind).",
    )
    prefill_prefix_block_tokens: int = Field(
        64,
        ge=1,
        le=4096,
        description="Block size, in estimated tokens (4 characters each), of the prefill "
        "prefix index: a prediction's granularity.",
    )
    prefill_cache_tokens: int = Field(
        262144,
        ge=0,
        description="Tokens a prefill endpoint's prefix cache holds when its metrics do not "
        "say (vLLM exports vllm:cache_config_info; its num_gpu_blocks x block_size wins).",
    )
    prefill_prefix_trust: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of a predicted prefix-cache hit on a prefill endpoint that the "
        "decision counts (0: placement ignores the index, which still learns).",
    )
    prefix_index_memory_mib: float = Field(
        48,
        gt=0,
        description="Memory, in MiB, that all prefix indexes of a sidecar hold at most "
        "together: the local one's SIDECAR_PREFIX_CACHE_BLOCKS first, the prefill endpoints' "
        "(each an equal share) in what is left.",
    )
    prefix_hash_key: SecretStr | None = Field(
        None,
        description="Secret key (at least 16 bytes; from a Kubernetes Secret) of the prefill "
        "prefix index's block hashes; the same on every sidecar of a pool. With "
        "SIDECAR_STATE_BACKEND=redis the sidecars share what they placed only when it is "
        "set; unset, each sidecar draws a key of its own and learns alone.",
    )
    # KV events: what the engines say they hold (docs/kv-events.md, docs/scheduling.md).
    kv_events: bool = Field(
        False,
        description="Subscribe to the KV-cache events of the prefill pool's members and of the "
        "local decode ranks (vLLM --kv-events-config) and predict their prefix-cache hits from "
        "what they report; an engine without events keeps the approximate indexes. Needs the "
        "kvevents extra (the image has it; from a checkout: pip install '.[kvevents]').",
    )
    kv_events_port: int = Field(
        5557,
        ge=1,
        le=65535,
        description="Port of the prefill engines' KV-event publisher (vLLM's endpoint, "
        "tcp://*:5557), on each pool member's address.",
    )
    kv_events_replay_port: int | None = Field(
        5657,
        ge=1,
        le=65535,
        description="Port of the prefill engines' replay socket (vLLM's replay_endpoint; vLLM "
        "adds the data-parallel rank to both ports, so 5558 would be rank 1's events port). "
        "Empty: no replay, a lost message resets that engine's index.",
    )
    kv_events_topic: str = Field(
        "",
        max_length=256,
        description="Topic the engines publish their KV events under (vLLM's topic; the same "
        "on every engine).",
    )
    kv_events_prefill_dp_size: int = Field(
        1,
        ge=1,
        le=256,
        description="Data-parallel ranks of each prefill server (vLLM --data-parallel-size): "
        "rank r is subscribed at SIDECAR_KV_EVENTS_PORT + r and _REPLAY_PORT + r on every "
        "pool member's address, and a member counts the cached tokens of its least-cached "
        "rank (vLLM's balancer picks a rank by load alone); a rank whose port never connected "
        "is left out.",
    )
    kv_events_decode_port: int | None = Field(
        5557,
        ge=1,
        le=65535,
        description="Port of the local decode engine's KV-event publisher, on the host of its "
        "URL; rank r of SIDECAR_DECODE_URLS on this port + r (vLLM's data-parallel offset). "
        "Empty: the decode ranks are not subscribed to.",
    )
    kv_events_decode_replay_port: int | None = Field(
        5657,
        ge=1,
        le=65535,
        description="Port of the local decode engine's replay socket, + r for rank r. Empty: "
        "no replay.",
    )
    kv_events_cpu_weight: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Share of a prefix hit in an engine's CPU offload (beyond what its GPU "
        "holds) that the decision counts as cached: the blocks are loaded back, not computed.",
    )
    kv_events_storage_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of a prefix hit in an engine's storage tier (beyond its GPU and CPU) "
        "that the decision counts as cached.",
    )
    kv_events_tokenize_timeout_ms: float = Field(
        50,
        gt=0,
        description="Longest wait, in milliseconds, for the local decode engine's /tokenize to "
        "give a request's token ids (counted in its time to first token); past it the request "
        "is placed by the approximate indexes.",
    )
    kv_events_max_blocks: int = Field(
        100_000,
        ge=1,
        le=(1 << 20) - 1,
        description="Blocks the exact index of one engine (or decode rank) holds at most, about "
        "320 bytes each; the engine's own evictions normally keep it smaller.",
    )
    eject_after_failures: int = Field(
        3, ge=1, description="Consecutive failures that eject a prefill endpoint."
    )
    eject_base_s: float = Field(
        2, gt=0, description="First ejection time in seconds; doubles per failed probe."
    )
    eject_max_s: float = Field(
        60, gt=0, description="Longest ejection time in seconds; at least SIDECAR_EJECT_BASE_S."
    )
    state_backend: Literal["memory", "redis"] = Field(
        "memory",
        description="Where reservations, speed estimates and ejections live: memory (this "
        "sidecar only) or redis (shared by every sidecar).",
    )
    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis URL for SIDECAR_STATE_BACKEND=redis (may hold a password; "
        "never logged).",
    )
    redis_cluster: bool = Field(
        False,
        description="SIDECAR_REDIS_URL names a node of a Redis Cluster (redis:// or rediss://, "
        "database 0): use the cluster client, which follows slots and failovers.",
    )
    redis_key_prefix: str = Field(
        "pd-sidecar",
        min_length=1,
        description="Prefix of every Redis key; sidecars sharing a pool share it.",
    )
    state_lease_s: float = Field(
        10,
        gt=0,
        description="Seconds after which a silent sidecar's reservations stop counting.",
    )
    state_reservations: Literal["script", "counters"] = Field(
        "script",
        description="With SIDECAR_STATE_BACKEND=redis, how reservations are shared: script "
        "(one script call per sync, the pool's totals in one hash slot) or counters (one "
        "counter per endpoint, written per reservation and read per decision: Redis's cost per "
        "decision does not grow with the sidecars). Counters sidecars also share through the "
        "script while any script sidecar is live, for rolling upgrades.",
    )
    shared_scrapes: bool = Field(
        False,
        description="With SIDECAR_STATE_BACKEND=redis: each prefill endpoint's /metrics is "
        "scraped by SIDECAR_SCRAPES_PER_ENDPOINT sidecars of the pool (chosen by rendezvous "
        "hashing over the live ones) and read by the others from Redis, so that an engine gets "
        "the same scrapes at 8 decode pods and at 1,000.",
    )
    scrapes_per_endpoint: int = Field(
        2,
        ge=1,
        le=16,
        description="With SIDECAR_SHARED_SCRAPES: the sidecars that scrape each prefill "
        "endpoint (its owners); one more than one so that an owner's loss loses nothing.",
    )
    state_timeout_ms: float = Field(
        5,
        gt=0,
        description="Longest wait for Redis before a decision, in milliseconds; then the "
        "local view decides.",
    )
    prefill_retries: int = Field(
        1,
        ge=0,
        description="Retries of a prefill that failed transiently (connect error, timeout, "
        "502/503/504): on another endpoint when the sidecar chose it, on the same one when "
        "the gateway named it.",
    )
    prefill_retry_backoff_s: float = Field(
        0.05, ge=0, description="Wait before the first prefill retry, doubled for each next one."
    )
    prefill_fallback: Literal["local", "fail"] = Field(
        None,  # resolved per connector by _fallback_for_connector
        validate_default=True,
        description="After a failed prefill: local (the decode engine recomputes the prompt) or "
        "fail (503 to the client). Empty: local, except with sglang (fail; local is refused).",
    )
    prefill_timeout_s: float = Field(
        60, gt=0, description="Longest prefill leg, in seconds (a timeout is a transient failure)."
    )
    decode_first_byte_timeout_s: float = Field(
        60, gt=0, description="Longest wait for the decode engine's first byte, in seconds."
    )
    stream_idle_timeout_s: float = Field(
        60, gt=0, description="Longest gap between two chunks of the decode answer, in seconds."
    )
    request_timeout_s: float = Field(
        0, ge=0, description="Longest request end to end, in seconds; 0: no limit."
    )
    client_body_timeout_s: float = Field(
        30, gt=0, description="Longest time a client may take to send its request body."
    )
    client_header_timeout_s: float = Field(
        30,
        gt=0,
        description="Longest time a client may take to send a request's head (request line and "
        "headers), in seconds: from the accept for a new connection, from the first byte of the "
        "next request on a keep-alive one. Over it the connection is closed (SIDECAR_PORT and "
        "SIDECAR_ADMIN_PORT).",
    )
    client_keepalive_s: float = Field(
        3630,
        gt=0,
        description="Seconds a client connection may sit idle between two requests before it "
        "is closed. Keep it above the gateway's idle timeout for its upstream connections "
        "(Envoy: 1 hour), so that the gateway always closes an idle connection first.",
    )
    max_connections: int = Field(
        2048,
        ge=1,
        description="Client connections served on SIDECAR_PORT. A new one over it takes the "
        "place of the oldest connection waiting for a request; when every one is busy it may "
        "only ask /health or /ready (anything else: 503), and is closed after the answer. "
        "Lowered to what the open-files limit holds.",
    )
    release_on_disconnect: bool = Field(
        True,
        description="Free KV a prefill staged that no decode will take (the client left, or "
        "the decode leg failed or was refused before its first byte) at once, by having the "
        "decode engine pull it; false: leave it to the prefill engine's own expiry.",
    )
    prefill_on_disconnect: Literal["auto", "abort", "finish"] = Field(
        "auto",
        description="A prefill whose client left: abort (the engine drops it; one that was "
        "just finishing may keep its KV until expiry), finish (let it end, then release its "
        "KV; needs SIDECAR_RELEASE_ON_DISCONNECT=true), auto (abort one queued, finish one "
        "whose own compute or predicted remaining time is within 0.5 s, abort the rest).",
    )
    prefill_headers: Annotated[tuple[str, ...], NoDecode] = Field(
        defaults.PREFILL_HEADERS,
        description="Request headers a gateway names the prefill server in, in order of "
        "precedence (comma list; the first present wins). Every one of them is stripped before "
        "any engine. Add a name only if the gateway strips it from client requests. Empty: no "
        "header is read (the sidecar's own scheduler places every request).",
    )
    prefill_header_sampling: bool = Field(
        False,
        description="When the prefill header names several servers (a comma list, or the "
        "header repeated), send the prefill to one of them at random (seeded by "
        "SIDECAR_SCHEDULER_SEED), as llm-d's --enable-prefiller-sampling; false: to the first.",
    )
    prefill_allowed_cidrs: Annotated[tuple[IPv4Network | IPv6Network, ...], NoDecode] = Field(
        (),
        description="Networks a prefill target named by a header may be in (comma list).",
    )
    prefill_allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Host names a prefill target named by a header may have (comma list).",
    )
    admin_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve /metrics and /debug/* on this port only (not on SIDECAR_PORT). "
        "Empty: on SIDECAR_PORT.",
    )
    inference_pool: str | None = Field(
        None,
        description="namespace/name of an InferencePool (inference.networking.k8s.io/v1, or "
        "the older inference.networking.x-k8s.io/v1alpha2): the IP addresses of the pods it "
        "selects are allowed prefill targets too, followed through the Kubernetes API. Until "
        "its first list, /ready is 503. Empty: none.",
    )
    inference_pool_group: Literal[
        "", "inference.networking.k8s.io", "inference.networking.x-k8s.io"
    ] = Field(
        "",
        description="The API group SIDECAR_INFERENCE_POOL is found in: inference.networking.k8s.io "
        "(v1) or inference.networking.x-k8s.io (v1alpha2). Empty: v1, else v1alpha2.",
    )
    kube_api_url: str | None = Field(
        None,
        validate_default=True,
        description="Base URL of the Kubernetes API for SIDECAR_INFERENCE_POOL. Empty: in the "
        "pod, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT.",
    )
    kube_token_file: str = Field(
        "/var/run/secrets/kubernetes.io/serviceaccount/token",
        min_length=1,
        description="The service-account token the Kubernetes API is called with (read again "
        "every minute, and after a 401: bound tokens rotate).",
    )
    kube_ca_file: str = Field(
        "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
        min_length=1,
        description="The CA bundle the Kubernetes API's certificate is verified with.",
    )
    kube_retry_base_s: float = Field(
        0.5,
        gt=0,
        description="First wait after a failed list or watch of the Kubernetes API, in seconds; "
        "doubled after each failure in a row, up to SIDECAR_KUBE_RETRY_MAX_S.",
    )
    kube_retry_max_s: float = Field(
        30,
        gt=0,
        description="Longest wait between two attempts to reach the Kubernetes API, in seconds.",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) of the sidecar's listener: with SIDECAR_TLS_KEY_FILE, "
        "SIDECAR_PORT serves HTTPS (TLS 1.2 at least). Reloaded when the file changes. Empty: "
        "plain HTTP.",
    )
    tls_key_file: str | None = Field(
        None, description="PEM private key of SIDECAR_TLS_CERT_FILE (set both or neither)."
    )
    tls_min_version: Literal["1.2", "1.3"] = Field(
        "1.2",
        description="Lowest TLS version the listener (SIDECAR_PORT, and the admin port under "
        "SIDECAR_ADMIN_TLS) accepts: 1.2 or 1.3.",
    )
    admin_tls: bool = Field(
        True,
        description="With SIDECAR_TLS_CERT_FILE: SIDECAR_ADMIN_PORT serves HTTPS too (the same "
        "certificate); false keeps it plain HTTP.",
    )
    tls_reload_interval_s: float = Field(
        5,
        gt=0,
        description="Seconds between checks of the TLS files (listener certificate and key, CA "
        "bundle, client certificate) for a change; a changed file is loaded for new connections.",
    )
    prefill_tls: bool = Field(
        False,
        description="Call the prefill engines over HTTPS (header targets and pool members "
        "alike: https://host:port), verified with SIDECAR_TLS_CA_FILE.",
    )
    prefill_tls_server_name: str | None = Field(
        None,
        description="With SIDECAR_PREFILL_TLS: the name every prefill engine's certificate is "
        "verified against (and sent as SNI), e.g. one Service name for all prefill pods. Empty: "
        "the name the target was given (a header's host name, or its IP address).",
    )
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA bundle that the certificates of https:// engines (prefill, decode) "
        "are verified with. Empty: the system's CAs.",
    )
    tls_client_cert_file: str | None = Field(
        None,
        description="PEM client certificate the sidecar presents to https:// engines (mTLS), "
        "with SIDECAR_TLS_CLIENT_KEY_FILE. Empty: none.",
    )
    tls_client_key_file: str | None = Field(
        None, description="PEM private key of SIDECAR_TLS_CLIENT_CERT_FILE (set both or neither)."
    )
    tls_insecure_skip_verify: bool = Field(
        False,
        description="Accept any certificate from https:// engines, unverified (a warning is "
        "logged at start): the default of the two settings below. Refused together with "
        "SIDECAR_TLS_CA_FILE when no https:// engine is left verified.",
    )
    prefill_tls_insecure_skip_verify: bool | None = Field(
        None,
        description="Accept any certificate from the prefill engines (SIDECAR_PREFILL_TLS), "
        "unverified. Empty: SIDECAR_TLS_INSECURE_SKIP_VERIFY.",
    )
    decode_tls_insecure_skip_verify: bool | None = Field(
        None,
        description="Accept any certificate from the https:// decode engine "
        "(SIDECAR_DECODE_URL(S)), unverified. Empty: SIDECAR_TLS_INSECURE_SKIP_VERIFY.",
    )
    drain_timeout_s: float = Field(
        defaults.DRAIN_TIMEOUT_S,
        ge=0,
        description="On SIGTERM, how long requests in flight may take to finish before they "
        "are cancelled, in seconds; the whole shutdown ends within this + 1 s.",
    )
    rewrite_remote_host: bool = Field(
        False,
        description="Replace remote_host in the prefill's kv_transfer_params with the prefill "
        "endpoint's host (for prefill pods that advertise localhost).",
    )
    max_body_bytes: int = Field(
        33_554_432, gt=0, description="Largest request body accepted, in bytes (over it: 413)."
    )
    max_prefill_answer_bytes: int = Field(
        4_194_304,
        gt=0,
        description="Longest prefill answer read, in bytes; a longer one is a failed prefill "
        "(fallback reason prefill_too_large), dropped unread. A one-token answer with its KV "
        "parameters stays far below it: ~0.5 MB per KV-cache group at 1M prompt tokens.",
    )
    max_body_elements: int = Field(
        1_000_000,
        gt=0,
        description="Most JSON values (array items and object members, at any depth) a "
        "request body may hold; over it: 413, before the body is parsed.",
    )
    body_budget_bytes: int = Field(
        134_217_728,
        gt=0,
        description="Bytes of generation request bodies held at once, across requests, from "
        "their first byte until the decode engine answered; a body that does not fit: 503. "
        "At least SIDECAR_MAX_BODY_BYTES.",
    )
    debug_history: int = Field(
        1000, ge=1, description="Completed requests kept for /debug/requests."
    )
    ready_interval_s: float = Field(
        2, gt=0, description="Seconds between polls of the decode engine's /health."
    )
    ready_failure_threshold: int = Field(
        3,
        ge=1,
        description="Consecutive failed /health polls (no answer in time, an answer other "
        "than 200) before a ready decode engine counts as not ready; a refused connection "
        "(nothing listens) counts at once.",
    )
    ready_success_threshold: int = Field(
        1,
        ge=1,
        description="Consecutive successful /health polls before a decode engine that is not "
        "ready counts as ready.",
    )
    connect_timeout_s: float = Field(
        2, gt=0, description="Seconds allowed to open a TCP connection to an engine."
    )
    engine_keepalive_s: float = Field(
        defaults.ENGINE_KEEPALIVE_S,
        gt=0,
        description="Seconds a connection to an engine may sit idle and still be reused. Keep "
        "it below the engines' own idle timeout (5 s in vLLM, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, and in "
        "SGLang): a request sent as the engine closes the connection is lost.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level of the sidecar's loggers: DEBUG, INFO, WARNING or ERROR."
    )
    log_requests: bool = Field(
        False, description="Log one INFO summary line per generation request."
    )
    tracing: bool = Field(
        False,
        description="Export OpenTelemetry spans of every request and propagate W3C trace "
        "context on the engine legs; configured by the SDK's OTEL_* variables (endpoint, "
        "protocol, sampler, service name). Needs the tracing extra (the image has it; from a "
        "checkout: pip install '.[tracing]').",
    )
    gc_gen0_threshold: int = Field(
        10_000,
        ge=1,
        description="Allocations between two young-generation garbage collections (Python's "
        "default: 700); set once the sidecar listens, after start-up's objects are frozen.",
    )

    @field_validator("connector", mode="before")
    @classmethod
    def _connector_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            known = connectors.named(value)
            return known.name if known is not None else value.strip().lower()
        return value

    @field_validator("prefill_on_disconnect")
    @classmethod
    def _finish_needs_release(cls, value: str, info: ValidationInfo) -> str:
        if value == "finish" and info.data.get("release_on_disconnect") is False:
            raise ValueError(
                "finish lets a prefill stage KV that nobody then releases: it needs "
                "SIDECAR_RELEASE_ON_DISCONNECT=true"
            )
        return value

    @field_validator("prefill_fallback", mode="before")
    @classmethod
    def _fallback_for_connector(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.data.get("connector", "")
        # Why the connector's decode server cannot prefill (its facts), or None when it can.
        cannot = (
            connectors.CONNECTORS[name].cannot_prefill if name in connectors.CONNECTORS else None
        )
        if value is None or (isinstance(value, str) and not value.strip()):
            return "local" if cannot is None else "fail"
        if cannot is not None and isinstance(value, str) and value.strip().lower() == "local":
            raise ValueError(f"local is impossible with SIDECAR_CONNECTOR={name}: {cannot}")
        return value

    @field_validator("disagg_tpot_slo_ms")
    @classmethod
    def _tpot_slo_in_milliseconds(cls, value: float) -> float:
        if value != 0 and not 1 <= value < math.inf:
            raise ValueError(
                f"{value:g} ms: set 0 (no budget) or the TPOT SLO in milliseconds, at least 1 "
                "(e.g. 50 for 50 ms, not 0.05)"
            )
        return value

    @field_validator("disagg_stall_burst_s")
    @classmethod
    def _stall_burst_finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(
                f"{value:g}: set the longest stall in seconds (a finite number; "
                "SIDECAR_DISAGG_TPOT_SLO_MS=0 turns the budget off)"
            )
        return value

    @field_validator("eject_max_s")
    @classmethod
    def _eject_max_above_base(cls, value: float, info: ValidationInfo) -> float:
        base = info.data.get("eject_base_s")
        if base is not None and base > value:
            raise ValueError(f"{value:g} is below SIDECAR_EJECT_BASE_S ({base:g})")
        return value

    @field_validator("prefix_hash_key")
    @classmethod
    def _hash_key_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().encode()) < 16:
            raise ValueError("must be at least 16 bytes (e.g. openssl rand -hex 32)")
        return value

    @field_validator("admin_port")
    @classmethod
    def _admin_port_apart(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and value == info.data.get("port"):
            raise ValueError(f"{value} is SIDECAR_PORT too: leave it empty to serve both there")
        return value

    @field_validator("prefill_headers", mode="before")
    @classmethod
    def _header_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _items(value)
        if isinstance(value, list | tuple):
            bad = [item for item in value if not isinstance(item, str) or not _TOKEN.match(item)]
            if bad:
                raise ValueError(f"not header names: {', '.join(map(str, bad))}")
            return tuple(item.lower() for item in value)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("prefill_endpoints", mode="before")
    @classmethod
    def _endpoint_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _items(value)
        if isinstance(value, list | tuple):
            # Whether a scheme agrees with SIDECAR_PREFILL_TLS was checked before
            # (``_pool_schemes``): here either one is only a prefix.
            return tuple(
                item if isinstance(item, Endpoint) else parse_pool_entry(item, schemes=_WEB)
                for item in value
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _pool_schemes(cls, data: Any) -> Any:
        """A pool entry may be written as a URL (``https://p0:8000``): its scheme must say what
        SIDECAR_PREFILL_TLS says, since one switch sets it for every prefill engine (a header
        target has no scheme of its own)."""
        if not isinstance(data, dict):
            return data
        entries = data.get("prefill_endpoints")
        if isinstance(entries, str):
            try:
                entries = _items(entries)
            except ValueError:
                return data  # the field's own validator says what is wrong with it
        if not isinstance(entries, list | tuple):
            return data
        schemed = [
            (scheme, item)
            for item in entries
            if isinstance(item, str) and _parses(item)  # else its own error says what is wrong
            for scheme in (split_scheme(item)[0],)
            if scheme in _WEB
        ]
        if not schemed:
            return data
        try:
            tls = TypeAdapter(bool).validate_python(data.get("prefill_tls", False))
        except ValidationError:
            return data  # SIDECAR_PREFILL_TLS's own error says what is wrong with it
        wanted = "https" if tls else "http"
        wrong = [item.strip() for scheme, item in schemed if scheme != wanted]
        if wrong and tls:
            raise ValueError(
                f"SIDECAR_PREFILL_ENDPOINTS names {', '.join(wrong)} but SIDECAR_PREFILL_TLS=true "
                "calls every prefill engine over HTTPS: write https:// or host:port alone"
            )
        if wrong:
            raise ValueError(
                f"SIDECAR_PREFILL_ENDPOINTS names {', '.join(wrong)}: set "
                "SIDECAR_PREFILL_TLS=true to call the prefill engines over HTTPS (it applies to "
                "every one of them), or write host:port"
            )
        return data

    @field_validator("prefill_allowed_cidrs", mode="before")
    @classmethod
    def _cidrs(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return tuple(ip_network(item, strict=False) for item in _items(value))
            except ValueError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("prefill_allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(item.lower() for item in _items(value))
            bad = [item for item in value if not valid_host(item)]
            if bad:
                raise ValueError(f"not host names: {', '.join(bad)}")
        return value

    @field_validator("inference_pool", mode="before")
    @classmethod
    def _pool_name(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if not text:
            return None
        namespace, sep, name = text.partition("/")
        if not sep or not _DNS_LABEL.match(namespace) or not _DNS_SUBDOMAIN.match(name):
            raise ValueError(
                f"{value!r}: expected namespace/name (a namespace and an InferencePool name, "
                "lower-case DNS names)"
            )
        return f"{namespace}/{name}"

    @field_validator("kube_api_url", mode="before")
    @classmethod
    def _kube_api(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and value.strip():
            return _base_url(value)
        if info.data.get("inference_pool") is None:
            return None
        # In a pod: the API server's Service, from the variables the kubelet sets (the one
        # place outside SIDECAR_* that the sidecar reads).
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            return None  # not in a pod: the watch reports it (and /ready stays 503)
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    @field_validator("kube_retry_max_s")
    @classmethod
    def _retry_max_above_base(cls, value: float, info: ValidationInfo) -> float:
        base = info.data.get("kube_retry_base_s")
        if base is not None and base > value:
            raise ValueError(f"{value:g} is below SIDECAR_KUBE_RETRY_BASE_S ({base:g})")
        return value

    @field_validator("prefill_tls_server_name")
    @classmethod
    def _server_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.strip().lower()
        if not valid_host(name):
            raise ValueError(f"not a host name: {value}")
        return name

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr) -> SecretStr:
        scheme = value.get_secret_value().split("://", 1)[0]
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    @field_validator("redis_cluster")
    @classmethod
    def _cluster_url(cls, value: bool, info: ValidationInfo) -> bool:
        url = info.data.get("redis_url")
        if not value or url is None:
            return value
        parsed = URL(url.get_secret_value())
        if parsed.scheme not in ("redis", "rediss"):
            raise ValueError(
                "a Redis Cluster is reached over TCP: SIDECAR_REDIS_URL must be a redis:// or "
                "rediss:// URL"
            )
        if parsed.path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has database 0 only: SIDECAR_REDIS_URL names another")
        return value

    @field_validator(
        "scheduler_seed",
        "prefix_hash_key",
        "kv_events_replay_port",
        "kv_events_decode_port",
        "kv_events_decode_replay_port",
        "admin_port",
        "tls_cert_file",
        "tls_key_file",
        "prefill_tls_server_name",
        "tls_ca_file",
        "tls_client_cert_file",
        "tls_client_key_file",
        "prefill_tls_insecure_skip_verify",
        "decode_tls_insecure_skip_verify",
        mode="before",
    )
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("prefill_dns", mode="before")
    @classmethod
    def _dns_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_endpoint(value) if value.strip() else None
        return value

    @field_validator("host", mode="before")
    @classmethod
    def _listen_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _items(value)
        if isinstance(value, list | tuple):
            hosts = [str(item).strip().removeprefix("[").removesuffix("]") for item in value]
            if not hosts:
                raise ValueError("name at least one address, e.g. 0.0.0.0,::")
            bad = [host for host in hosts if not _listen_address(host)]
            if bad:
                raise ValueError(f"not an IP address or a host name: {', '.join(bad)}")
            repeated = sorted({host for host in hosts if hosts.count(host) > 1})
            if repeated:
                raise ValueError(f"an address is listed twice: {', '.join(repeated)}")
            return tuple(hosts)
        return value

    @field_validator("decode_url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        return _base_url(value)

    @field_validator("decode_urls", mode="before")
    @classmethod
    def _rank_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _items(value)
        if isinstance(value, list | tuple):
            urls = []
            for item in value:
                try:
                    urls.append(_base_url(item))
                except ValueError as exc:
                    raise ValueError(f"{item}: {exc}") from None
            repeated = sorted({url for url in urls if urls.count(url) > 1})
            if repeated:
                raise ValueError(f"a rank is listed twice: {', '.join(repeated)}")
            return tuple(urls)
        return value

    @model_validator(mode="after")
    def _one_decode_setting(self) -> Settings:
        if self.decode_urls and "decode_url" in self.model_fields_set:
            raise ValueError(
                "SIDECAR_DECODE_URL and SIDECAR_DECODE_URLS are both set: set "
                "SIDECAR_DECODE_URLS alone for several ranks, SIDECAR_DECODE_URL alone for one"
            )
        return self

    @model_validator(mode="after")
    def _decode_is_not_the_sidecar(self) -> Settings:
        ours = {self.port: "SIDECAR_PORT", self.admin_port: "SIDECAR_ADMIN_PORT"}
        if self.rank_ports and self.port:
            ours.update(
                {self.port + r: "SIDECAR_RANK_PORTS" for r in range(1, len(self.decode_ranks))}
            )
        for url in self.decode_ranks:
            parsed = URL(url)
            if parsed.port in ours and self._listens_at(parsed.host):
                raise ValueError(
                    f"the decode engine {url} is on a port of the sidecar's own "
                    f"({ours[parsed.port]}): the engine listens on a port of its own, the "
                    "sidecar on the pod's serving port"
                )
        return self

    def _listens_at(self, host: str | None) -> bool:
        """Whether the sidecar's listeners (SIDECAR_HOST) take connections to ``host``: a host
        of this pod and a listener on the any-address, or that very address."""
        if not in_this_pod(host):
            return False
        listening = {address.lower() for address in self.host}
        if listening & {"0.0.0.0", "::"}:
            return True
        aliases = {"localhost": {"localhost", "127.0.0.1", "::1"}}
        return bool(listening & aliases.get(host or "", {host or ""}))

    @model_validator(mode="after")
    def _rank_ports_fit(self) -> Settings:
        last = self.port + len(self.decode_ranks) - 1
        if self.rank_ports and self.port and last > 65535:
            raise ValueError(
                f"SIDECAR_RANK_PORTS: the ports of {len(self.decode_ranks)} ranks from "
                f"SIDECAR_PORT={self.port} run past 65535"
            )
        if self.rank_ports and self.admin_port and self.port < self.admin_port <= last:
            raise ValueError(
                f"SIDECAR_RANK_PORTS: SIDECAR_ADMIN_PORT={self.admin_port} is the port of a "
                "decode rank (SIDECAR_PORT + rank): choose another"
            )
        return self

    @model_validator(mode="after")
    def _kv_event_ports_fit(self) -> Settings:
        ranks = len(self.decode_ranks)
        _rank_ports_fit(
            "SIDECAR_KV_EVENTS_DECODE_",
            self.kv_events_decode_port,
            self.kv_events_decode_replay_port,
            ranks,
            f"{ranks} decode ranks",
        )
        return self

    @model_validator(mode="after")
    def _prefill_kv_event_ports_fit(self) -> Settings:
        ranks = self.kv_events_prefill_dp_size
        _rank_ports_fit(
            "SIDECAR_KV_EVENTS_",
            self.kv_events_port,
            self.kv_events_replay_port,
            ranks,
            f"{ranks} data-parallel ranks (SIDECAR_KV_EVENTS_PREFILL_DP_SIZE={ranks})",
        )
        return self

    @model_validator(mode="after")
    def _counters_in_redis(self) -> Settings:
        if self.state_reservations == "counters":
            if self.state_backend != "redis":
                raise ValueError(
                    "SIDECAR_STATE_RESERVATIONS=counters needs SIDECAR_STATE_BACKEND=redis: the "
                    "counters are kept in Redis"
                )
            prefix = self.redis_key_prefix
            spaced = any(c in prefix for c in " {}")
            if spaced or not prefix.isprintable() or len(prefix.encode()) > 300:
                raise ValueError(
                    "SIDECAR_REDIS_KEY_PREFIX must be printable, without spaces or braces, of at "
                    "most 300 bytes with SIDECAR_STATE_RESERVATIONS=counters: it goes in the "
                    "counters' hash tags"
                )
        return self

    @model_validator(mode="after")
    def _shared_scrapes_share(self) -> Settings:
        if self.shared_scrapes and self.state_backend != "redis":
            raise ValueError(
                "SIDECAR_SHARED_SCRAPES needs SIDECAR_STATE_BACKEND=redis: the scrapes are "
                "shared through the shared state"
            )
        return self

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> Settings:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"SIDECAR_BODY_BUDGET_BYTES ({self.body_budget_bytes}) is below "
                f"SIDECAR_MAX_BODY_BYTES ({self.max_body_bytes}): a body of the largest size "
                "accepted would never fit"
            )
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> Settings:
        for cert, key in (
            ("tls_cert_file", "tls_key_file"),
            ("tls_client_cert_file", "tls_client_key_file"),
        ):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                given, missing = (cert, key) if getattr(self, key) is None else (key, cert)
                raise ValueError(
                    f"SIDECAR_{given.upper()} is set but SIDECAR_{missing.upper()} is not: "
                    "a certificate needs its key"
                )
        verified = [
            https and not skip
            for https, skip in (
                (self.prefill_tls, self.prefill_skip_verify),
                (self.decode_https, self.decode_skip_verify),
            )
        ]
        skipping = self.prefill_skip_verify or self.decode_skip_verify
        if skipping and self.tls_ca_file is not None and not any(verified):
            variables = ", ".join(variable for _, variable in self.unverified_stages())
            raise ValueError(
                f"{variables or 'SIDECAR_TLS_INSECURE_SKIP_VERIFY'}=true verifies no "
                "certificate, so SIDECAR_TLS_CA_FILE would be ignored: set one of them"
            )
        for stage, https, name in (
            ("prefill", self.prefill_tls, "SIDECAR_PREFILL_TLS=true"),
            ("decode", self.decode_https, "an https:// SIDECAR_DECODE_URL"),
        ):
            if getattr(self, f"{stage}_tls_insecure_skip_verify") and not https:
                raise ValueError(
                    f"SIDECAR_{stage.upper()}_TLS_INSECURE_SKIP_VERIFY=true applies to the "
                    f"{stage} engines over HTTPS, and they are called over plain HTTP: set "
                    f"{name}, or unset it"
                )
        if self.prefill_tls_server_name is not None and not self.prefill_tls:
            raise ValueError(
                "SIDECAR_PREFILL_TLS_SERVER_NAME is set but SIDECAR_PREFILL_TLS is false: the "
                "prefill engines are called over plain HTTP"
            )
        # Engine TLS settings with no engine over TLS are a forgotten switch, not a choice.
        https = self.prefill_tls or self.decode_https
        used = [
            f"SIDECAR_{name.upper()}"
            for name in ("tls_ca_file", "tls_client_cert_file", "tls_insecure_skip_verify")
            if getattr(self, name) not in (None, False)
        ]
        if used and not https:
            raise ValueError(
                f"{', '.join(used)} applies to engines called over HTTPS, and none is: set "
                "SIDECAR_PREFILL_TLS=true, or an https:// SIDECAR_DECODE_URL"
            )
        return self

    @property
    def decode_ranks(self) -> tuple[str, ...]:
        """The decode engine's base URLs, one per data-parallel rank (one without ranks)."""
        return self.decode_urls or (self.decode_url,)

    @property
    def decode_https(self) -> bool:
        """Whether a decode rank is called over HTTPS."""
        return any(url.startswith("https://") for url in self.decode_ranks)

    @property
    def prefill_skip_verify(self) -> bool:
        """Whether the prefill engines' certificates go unverified (the stage's setting, else
        SIDECAR_TLS_INSECURE_SKIP_VERIFY)."""
        stage = self.prefill_tls_insecure_skip_verify
        return self.tls_insecure_skip_verify if stage is None else stage

    @property
    def decode_skip_verify(self) -> bool:
        """Whether the decode engine's certificates go unverified (the stage's setting, else
        SIDECAR_TLS_INSECURE_SKIP_VERIFY)."""
        stage = self.decode_tls_insecure_skip_verify
        return self.tls_insecure_skip_verify if stage is None else stage

    def unverified_stages(self) -> list[tuple[str, str]]:
        """(stage, the variable that says so) for each stage called over HTTPS unverified."""
        stages = []
        for stage, https, own in (
            ("prefill engines", self.prefill_tls, self.prefill_tls_insecure_skip_verify),
            ("decode engine", self.decode_https, self.decode_tls_insecure_skip_verify),
        ):
            if https and (self.tls_insecure_skip_verify if own is None else own):
                variable = (
                    "SIDECAR_TLS_INSECURE_SKIP_VERIFY"
                    if own is None
                    else f"SIDECAR_{stage.split()[0].upper()}_TLS_INSECURE_SKIP_VERIFY"
                )
                stages.append((stage, variable))
        return stages


def _parses(entry: str) -> bool:
    """Whether a pool entry is well formed, whatever its scheme says."""
    try:
        parse_pool_entry(entry, schemes=_WEB)
    except ValueError:
        return False
    return True


def _base_url(value: str) -> str:
    url = URL(value.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    if url.path not in ("", "/") or url.query_string or url.fragment:
        raise ValueError("must be a base URL without path, query or fragment")
    return str(url.with_path("")).rstrip("/")


def _listen_address(host: str) -> bool:
    try:
        ip_address(host.partition("%")[0])  # an IPv6 address may carry its zone: fe80::1%eth0
    except ValueError:
        return valid_host(host)
    return True


def _items(value: str) -> list[str]:
    """A list setting's items: comma-separated, each stripped. ``ValueError`` naming commas for
    a list written otherwise (a JSON list; ``;`` or spaces between items), which would
    otherwise be read as one odd item."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]") and ('"' in text or "'" in text):
        raise ValueError(
            f"{text!r} is written as a JSON list: give the items separated by commas, without "
            "brackets or quotes (a,b)"
        )
    items = [item for item in (part.strip() for part in value.split(",")) if item]
    for item in items:
        if ";" in item or any(char.isspace() for char in item):
            raise ValueError(
                f"{item!r}: the items of a list are separated by commas (a,b), not by ';' or spaces"
            )
    return items


def describe_fields() -> list[tuple[str, str, str]]:
    """(environment variable, default as written in the environment, description) per setting."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, tuple):
            shown = ",".join(str(item) for item in default)
        elif default is None:
            shown = ""
        elif isinstance(default, SecretStr):
            shown = default.get_secret_value()
        else:
            shown = str(default)
        rows.append((f"SIDECAR_{name.upper()}", shown, field.description or ""))
    return rows


_SAME_WORD = {
    word: "ADDRESS"
    for word in ("URL", "ENDPOINT", "HOST", "ADDR", "ADDRESS", "SERVER", "TARGET", "BACKEND")
} | {
    plural: "ADDRESSES"
    for plural in (
        "URLS",
        "ENDPOINTS",
        "HOSTS",
        "ADDRS",
        "ADDRESSES",
        "SERVERS",
        "TARGETS",
        "BACKENDS",
        "LIST",
    )
}
"""Words other proxies' settings use for what ours call URL(S) or ENDPOINTS: a name that differs
only by them means ours (SIDECAR_PREFILL_URLS is SIDECAR_PREFILL_ENDPOINTS)."""


_SERVICE_LINK = re.compile(
    r"^SIDECAR_(SERVICE_HOST|SERVICE_PORT(_.+)?|PORT_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)$"
)
"""What the kubelet puts in every container of a namespace holding a Service named sidecar."""


def _gist(name: str) -> str:
    words = name.removeprefix("SIDECAR_").split("_")
    return "_".join(_SAME_WORD.get(word, word) for word in words)


def _one_edit(typed: str, name: str) -> bool:
    """Whether ``typed`` is ``name`` with one letter dropped, added or changed, or two
    neighbours swapped."""
    if typed == name or abs(len(typed) - len(name)) > 1:
        return False
    if len(typed) == len(name):
        diff = [i for i, (a, b) in enumerate(zip(typed, name, strict=True)) if a != b]
        return len(diff) == 1 or (
            len(diff) == 2
            and diff[1] == diff[0] + 1
            and (typed[diff[0]], typed[diff[1]]) == (name[diff[1]], name[diff[0]])
        )
    short, long = sorted((typed, name), key=len)
    i = next((i for i, (a, b) in enumerate(zip(short, long, strict=False)) if a != b), len(short))
    return short[i:] == long[i + 1 :]


def nearest_setting(typed: str, known: Iterable[str] | None = None) -> str | None:
    """The setting an unknown ``SIDECAR_*`` name most likely means, or None: one edit away
    (``_one_edit``; among several, one of the same length first, then in order), else the
    same name in another proxy's words for an address (``_SAME_WORD``), else the closest by
    ``difflib`` at 0.75. ``known``: the variables (every setting's, by default)."""
    names = sorted(known if known is not None else (name for name, _, _ in describe_fields()))
    typed = typed.upper()
    edits = [name for name in names if _one_edit(typed, name)]
    if edits:
        return min(edits, key=lambda name: len(name) != len(typed))
    gists: dict[str, str] = {}
    for name in names:
        gists.setdefault(_gist(name), name)
    nearest = difflib.get_close_matches(_gist(typed), gists, n=1, cutoff=0.75)
    return gists[nearest[0]] if nearest else None


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning per ``SIDECAR_*`` variable in ``environ`` that is no setting, naming the
    nearest setting when one is near (a typo, or another proxy's word for it).

    Only warnings: an unknown name must never stop the start, since a newer manifest may run
    an older image."""
    known = {name for name, _, _ in describe_fields()}
    messages = []
    for name in sorted(environ):
        # Settings are read whatever the case of the rest of the name (pydantic-settings).
        if not name.startswith("SIDECAR_") or name.upper() in known:
            continue
        if _SERVICE_LINK.match(name):
            messages.append(
                f"ignoring {name}: Kubernetes sets it for a Service named sidecar "
                "(enableServiceLinks: false in the pod spec leaves it out)"
            )
            continue
        nearest = nearest_setting(name, known)
        if nearest:
            messages.append(f"ignoring unknown variable {name}: did you mean {nearest}?")
        else:
            messages.append(f"ignoring unknown variable {name} (see --help)")
    return messages


def in_this_pod(host: str | None) -> bool:
    """Whether ``host`` names this pod (network namespace): ``localhost``, a loopback or the
    any-address. A decode URL there at a port of the sidecar's own is the sidecar itself."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def explain(error: ValidationError) -> str:
    """One line naming each invalid variable, for the exit-status-2 message."""
    parts = []
    for item in error.errors():
        message = str(item["msg"])
        if isinstance(item.get("ctx"), dict) and "error" in item["ctx"]:
            message = str(item["ctx"]["error"])
        if not item["loc"]:  # a contradiction between settings: the message names them
            parts.append(message)
            continue
        parts.append(f"SIDECAR_{str(item['loc'][0]).upper()}: {message}")
    return "invalid configuration: " + "; ".join(parts)
