"""Scenario parameters: the modelled cluster, its sidecars, the workload, the SLOs, the checks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from sidecar.defaults import QOE_CHOICES
from sidecar.emulator.config import ATTENTION_CROSSOVER_TOKENS
from sidecar.emulator.engine import prefill_seconds
from sidecar.scheduling.model import Transfer

if TYPE_CHECKING:
    from bench.sim.checks import Check

StateMode = Literal["redis", "coalesced", "shared", "local"]
StaleMode = Literal["delay", "scrape"]
TokenMode = Literal["estimated", "exact"]
ReserveMode = Literal["production", "prompt"]
EngineModel = Literal["batched", "slots"]
Mode = Literal["conditional", "always", "never", "anchor"]
Workload = Literal["mixed", "system_prompts", "trace"]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "standard"
    # Cluster.
    prefill_engines: int = 4
    decode_engines: int = 4
    prefill_tokens_per_s: float = 10_000.0
    """Linear prefill speed of every engine, prefill and decode alike (a local prefill runs at
    it too), unless ``prefill_speeds`` says otherwise for the prefill engines."""
    prefill_speeds: tuple[float, ...] = ()
    """Linear prefill speed (tokens/s) of each prefill engine; empty: all at the default."""
    crossover_tokens: int = ATTENTION_CROSSOVER_TOKENS
    """Prefill time ``a·n + b·n²`` with ``b = a / crossover_tokens`` (the emulator's default,
    docs/emulator.md); 0: linear."""
    prefill_budget_tokens: int = 8192
    """``batched``: tokens per engine iteration; longer prompts are chunked over several."""
    decode_step_s_at_1: float = 0.020
    decode_step_s_at_64: float = 0.040
    """``batched``: decode step time at batch 1 and 64, linear in between and beyond."""
    decode_max_batch: int = 64
    """``batched``: requests a decode engine runs at once (its local prefills included); the
    others wait, first come first served, and the wait is part of their time to first token
    (vLLM's ``max_num_seqs``, in practice bound by the KV cache: 64 sequences of ~5,500 tokens is
    about what an 80 GB GPU holds beside an 8B model's weights). 0: no bound."""
    transfer: Transfer = Transfer(fixed_s=0.002, s_per_token=1e-7)
    engine_model: EngineModel = "batched"
    """``batched``: iteration-level batching, a local prefill stalls its decode batch (the
    scenarios). ``slots``: the emulator's own model (``sidecar.emulator``, for the calibration):
    ``max_num_seqs`` slots, each admitted request its own timers, delays × (1 + slowdown ×
    (running − 1))."""
    prefill_max_num_seqs: int = 1
    decode_max_num_seqs: int = 16
    concurrency_slowdown: float = 0.0
    decode_s_per_token: float = 0.02
    kv_transfer_s_per_block: float = 0.0
    block_size: int = 16
    """``slots``: the emulators' settings of the same names; both models: the engines' KV
    block, the granularity of their prefix caches."""
    prefill_cache_tokens: int = 262_144
    """Tokens each prefill engine's prefix cache holds (LRU, ``bench.sim.caches``): 16,384
    blocks of 16, what ``SIDECAR_PREFILL_CACHE_TOKENS`` assumes by default."""
    prefill_restart_s: float = 0.0
    """Mean virtual seconds between restarts of each prefill engine (exponential, seeded per
    engine); a restart empties its prefix cache (its KV events say ``AllBlocksCleared``; the
    approximate index is not told). 0: never. The engine's downtime is not modelled."""
    foreign_tokens_per_s: float = 0.0
    """Prompt tokens per second each prefill engine caches for traffic the sidecars never see
    (another fleet's, a batch job's): unique prompts of ``foreign_prompt_tokens`` at exponential
    gaps, evicting what this fleet placed. Their compute is not modelled (the scraped load would
    show it to every variant alike). 0: none."""
    foreign_prompt_tokens: int = 4096
    kv_in_flight: bool = False
    """What-if, not production: an ``exact`` variant also counts each prompt placed on a
    prefill engine as held there until the events of its prefill reach the indexes (the pool's
    placements seen at once; llm-d's speculative indexing is the like, with a TTL)."""
    kv_event_lag_s: float = 0.05
    """``exact`` variants: how long after a prefill engine's cache changes its KV events reach
    the sidecars' indexes (vLLM publishes once per engine step; then the network)."""
    decode_cache_tokens: int = 262_144
    """Tokens each decode engine's prefix cache holds, for prompts with prefix structure (the
    shared-prompt and trace workloads): it keeps what it prefilled and what it pulled, as vLLM
    does, so a prompt whose prefix it holds computes only the rest locally. The mixed workload's
    engines hold exactly a conversation's history (``Shape.cached_tokens``) instead."""
    # Sidecars.
    staleness_s: float = 1.0
    """The scrape interval (``SIDECAR_SCRAPE_INTERVAL_S``); with ``delay``, the gauges' age."""
    stale_mode: StaleMode = "scrape"
    """``scrape``: each sidecar scrapes every ``staleness_s`` at its own phase (age 0 to
    ``staleness_s``, constant in between), as production does. ``delay``: every sidecar sees each
    engine as it was exactly ``staleness_s`` ago (one snapshot for all: the herding worst case)."""
    state: StateMode = "redis"
    """``redis``: the Redis backend as production runs it: before each decision a sidecar
    syncs (or joins the sync in flight) and decides on its answer, the others' reservations one
    round trip old; its reservations, releases and heartbeats are synced by the background
    worker. ``coalesced`` (a design, not production: ``bench.sim.state.CoalescedClient``): the
    same script sent in the background every ``sync_s``, a decision never waits. ``shared``:
    every reservation seen instantly by every sidecar. ``local``: each sidecar sees its own only
    (the memory backend)."""
    sync_s: float = 0.1
    """``coalesced``: seconds between a sidecar's background syncs."""
    redis_rtt_s: float = 0.001
    state_timeout_s: float = 0.005
    lease_s: float = 10.0
    """``redis``: a round trip; ``SIDECAR_STATE_TIMEOUT_MS`` and ``SIDECAR_STATE_LEASE_S``."""
    redis_refresh_s: float = 0.0
    """What-if, not production (``bench.sim.state.RedisClient``): the backend's worker also
    syncs every ``redis_refresh_s`` (0: never)."""
    tokens: TokenMode = "estimated"
    """``estimated``: sidecars see production's estimate (characters / 4) of a prompt whose
    true count the engines work on; ``exact``: they see the true counts."""
    chars_per_token_median: float = 4.0
    chars_per_token_sigma: float = 0.25
    """Characters per true token of each prompt: log-normal (docs/scheduling.md)."""
    reserve: ReserveMode = "production"
    """``production``: a placement reserves the estimated uncached tokens, as the scheduler
    does; ``prompt``: the whole prompt (the first simulator's choice)."""
    ttft_ratio: float | None = None
    """The decider's ``ttft_ratio``; None: the Decider's default."""
    stall_weight: float | None = None
    """The decider's ``stall_weight`` (what-if); None: the Decider's default."""
    choices: int = QOE_CHOICES
    retest_s: float | None = None
    """What-if: the planner's re-test interval (``Planner(retest_s=)``); None: production's
    default; 0: no re-tests."""
    """``SIDECAR_SCHEDULER_CHOICES``: the candidates ``qoe`` compares."""
    # Workload.
    workload: Workload = "mixed"
    """``mixed``: chat, RAG, multi-turn (below); ``system_prompts``: shared system
    prompts; ``trace``: a Mooncake-format trace (``trace_path``)."""
    trace_path: str | None = None
    trace_windows: bool = False
    """A trace's replay starts where the seed says and its spread has a seeded phase
    (``bench.sim.traces``); off: every seed replays the same arrivals. The protocol sets it."""
    bursty: bool = False
    burst_cv: float = 3.0
    """Bursty arrivals: gamma inter-arrival times with this coefficient of variation."""
    chat_share: float = 0.6
    rag_share: float = 0.3
    chat_median_tokens: float = 300.0
    chat_sigma: float = 0.8
    chat_max_tokens: int = 4000
    chat_output_tokens: int = 200
    rag_tokens: tuple[int, int] = (3000, 8000)
    rag_output_tokens: int = 100
    multi_history_tokens: tuple[int, int] = (2000, 6000)
    multi_new_tokens: int = 100
    multi_output_tokens: int = 150
    system_prompts: int = 32
    system_tokens: tuple[int, int] = (2000, 8000)
    system_zipf_s: float = 1.1
    system_user_tokens: tuple[int, int] = (50, 500)
    system_output_tokens: tuple[int, int] = (100, 300)
    # SLOs.
    ttft_slo_s: float = 1.0
    long_ttft_slo_s: float = 3.0
    long_prompt_tokens: int = 4000
    ttft_slo_per_prefill: float = 0.0
    """When above 0, a prompt's TTFT SLO is at least this many times its prefill alone on an
    idle engine at ``prefill_tokens_per_s`` (for a trace's prompts of up to 126,000 tokens,
    which no fixed SLO suits)."""
    tpot_slo_s: float = 0.050
    constant_ttft_s: float = 2.0
    constant_tpot_s: float = 0.050
    """DistServe-style constant SLOs of the workload (``bench.sim.slos``): TTFT ≤
    ``constant_ttft_s`` whatever the prompt, mean TPOT ≤ ``constant_tpot_s``. The TTFT bound is
    2.5 × the idle prefill of the workload's 90th-percentile prompt, to the half second: the
    mixed workload's 6,302 tokens (0.70 s) and shared-prompts' 7,829 (0.90 s) give 2 s; the
    conversation trace's 27,367 (4.14 s) gives 10.5 s."""
    target_attainment: float = 0.90
    # What runs by default, and what is checked.
    variants: tuple[Variant, ...] = ()
    checks: tuple[Check, ...] = field(default=(), compare=False)
    guess: float = 10.0
    """Where the goodput search starts (req/s); any value works, a close one saves runs."""

    def decode_step_s(self, batch: int) -> float:
        slope = (self.decode_step_s_at_64 - self.decode_step_s_at_1) / 63.0
        return self.decode_step_s_at_1 + slope * (batch - 1)

    def ttft_slo(self, prompt_tokens: int) -> float:
        slo = self.long_ttft_slo_s if prompt_tokens > self.long_prompt_tokens else self.ttft_slo_s
        if self.ttft_slo_per_prefill > 0:
            alone = prefill_seconds(
                1.0 / self.prefill_tokens_per_s, self.crossover_tokens, prompt_tokens
            )
            slo = max(slo, self.ttft_slo_per_prefill * alone)
        return slo

    def speeds(self) -> tuple[float, ...]:
        """Each prefill engine's linear speed in tokens/s."""
        if self.prefill_speeds:
            return self.prefill_speeds
        return (self.prefill_tokens_per_s,) * self.prefill_engines

    def describe(self) -> str:
        arrivals = f"bursty (gamma, CV {self.burst_cv:g})" if self.bursty else "Poisson"
        speeds = self.speeds()
        fleet = (
            f"{self.prefill_engines} prefill"
            if len(set(speeds)) == 1
            else f"{self.prefill_engines} prefill ({', '.join(f'{s:,.0f}' for s in speeds)} tok/s)"
        )
        prefill = "linear" if not self.crossover_tokens else f"b = a / {self.crossover_tokens:,}"
        workload = {
            "mixed": "",
            "system_prompts": ", 32 shared system prompts (Zipf 1.1)",
            "trace": f", trace {self.trace_path}",
        }[self.workload]
        return (
            f"{self.name}: {fleet} + {self.decode_engines} decode engines, "
            f"{self.decode_engines} sidecars, state {self.state}"
            + (f" every {self.sync_s:g} s" if self.state == "coalesced" else "")
            + f", metrics scraped every "
            f"{self.staleness_s:g} s ({self.stale_mode}), tokens {self.tokens}, reserve "
            f"{self.reserve}, prefill {prefill}, {arrivals} arrivals{workload}"
            + ("" if self.ttft_ratio is None else f", decider ttft_ratio {self.ttft_ratio:g}")
            + ("" if self.stall_weight is None else f", decider stall_weight {self.stall_weight:g}")
            + ("" if self.choices == QOE_CHOICES else f", qoe choices {self.choices}")
            + ("" if self.retest_s is None else f", what-if re-tests every {self.retest_s:g} s")
            + (
                ""
                if not self.redis_refresh_s
                else f", what-if Redis refresh {self.redis_refresh_s:g} s"
            )
            + (
                f", prefill caches {self.prefill_cache_tokens:,} tokens"
                if self.workload != "mixed"
                else ""
            )
            + (
                ""
                if not self.prefill_restart_s
                else f", each prefill engine restarted every {self.prefill_restart_s:g} s (mean)"
            )
            + (
                ""
                if not self.foreign_tokens_per_s
                else f", {self.foreign_tokens_per_s:,.0f} tokens/s of foreign traffic cached "
                "per prefill engine"
            )
            + (
                f", KV events {self.kv_event_lag_s * 1000:g} ms behind"
                if any(variant.exact for variant in self.variants)
                else ""
            )
            + (", what-if: prompts in flight count as held" if self.kv_in_flight else "")
        )

    def plain(self) -> Scenario:
        """The first simulator's idealisations: instant shared reservations, exact
        token counts, linear prefill, one stale snapshot for every sidecar, whole prompts
        reserved."""
        return replace(
            self,
            state="shared",
            tokens="exact",
            crossover_tokens=0,
            stale_mode="delay",
            reserve="prompt",
        )


@dataclass(frozen=True, slots=True)
class Variant:
    """A scheduler under test: a policy and how the decider uses it."""

    policy: str
    mode: Mode = "conditional"
    blind: bool = False
    """The sidecars run without the prefill prefix index (``SIDECAR_PREFILL_PREFIX_INDEX=false``:
    every endpoint computes the whole prompt), as production did before it had one."""
    exact: bool = False
    """The sidecars read each prefill candidate's cached tokens from the engine's exact index,
    fed by its KV events (``bench.sim.exact``), instead of the approximate one."""
    sync_s: float = 0.0
    """Above 0: the sidecars share reservations by the coalesced design
    (``bench.sim.state.CoalescedClient``), syncing every ``sync_s``, whatever the scenario's
    state; 0: the scenario's state."""
    eager: bool = False
    """With ``sync_s``: a change is synced at once when the last sync began at least ``sync_s``
    ago (``CoalescedClient(eager=)``)."""
    choices: int = 0
    """``qoe``: the candidates compared (``Qoe(choices=)``); 0: the scenario's."""
    among: int = 1
    """``qoe``: the pick is drawn at random among the ``among`` candidates of lowest predicted
    time to first token (``Qoe(among=)``); 1: the lowest, as production does."""

    @property
    def label(self) -> str:
        if self.mode == "never":
            return "never (all local)"
        if self.mode == "anchor":
            return self.policy
        label = self.policy if self.mode == "conditional" else f"{self.policy} always"
        if self.exact:
            label = f"{label} exact"
        elif self.blind:
            label = f"{label} prefix-blind"
        if self.sync_s:
            label += f" sync {self.sync_s:g}" + (" eager" if self.eager else "")
        if self.choices:
            label += f" sample{self.choices}"
        if self.among > 1:
            label += f" top{self.among}"
        return label


QOE = Variant("qoe")
QOE_BLIND = Variant("qoe", blind=True)
QOE_EXACT = Variant("qoe", exact=True)
SGLANG = Variant("sglang_cache_aware", "anchor")
LLMD = Variant("llm-d_pd_scorer", "anchor")
LLMD_PRECISE = Variant("llm-d_precise", "anchor", exact=True)
"""llm-d with its precise prefix-cache scorer for the prefill pick, fed by the prefill engines'
KV events (``bench.sim.anchors.LlmdPrecise``)."""
ANCHOR_VARIANTS = {variant.policy: variant for variant in (SGLANG, LLMD, LLMD_PRECISE)}
ROUND_ROBIN = Variant("round_robin")
LEAST_LOADED = Variant("least_loaded")
QOE_ALWAYS = Variant("qoe", "always")
ROUND_ROBIN_ALWAYS = Variant("round_robin", "always")
NEVER = Variant("qoe", "never")

ALL_VARIANTS = (
    QOE,
    Variant("power_of_two"),
    LEAST_LOADED,
    ROUND_ROBIN,
    Variant("random"),
    QOE_ALWAYS,
    ROUND_ROBIN_ALWAYS,
    NEVER,
)
