"""Scenario parameters: the modelled cluster, its sidecars, the workload and the SLOs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from sidecar.scheduling.model import Transfer

StateMode = Literal["shared", "local"]
StaleMode = Literal["delay", "scrape"]
Mode = Literal["conditional", "always", "never"]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "standard"
    # Cluster.
    prefill_engines: int = 4
    decode_engines: int = 4
    prefill_tokens_per_s: float = 10_000.0
    """Prefill speed of every engine, prefill and decode alike (a local prefill runs at it too)."""
    prefill_budget_tokens: int = 8192
    """Tokens per engine iteration; longer prompts are chunked over several iterations."""
    decode_step_s_at_1: float = 0.020
    decode_step_s_at_64: float = 0.040
    """Decode step time at batch 1 and 64, linear in between and beyond."""
    transfer: Transfer = Transfer(fixed_s=0.002, s_per_token=1e-7)
    # Sidecars.
    staleness_s: float = 1.0
    stale_mode: StaleMode = "delay"
    """``delay``: scraped gauges show the engine as it was exactly ``staleness_s`` ago.
    ``scrape``: each sidecar scrapes every ``staleness_s`` at its own phase (age 0..staleness)."""
    state: StateMode = "shared"
    """``shared``: every sidecar sees every reservation (Redis); ``local``: only its own."""
    ttft_ratio: float | None = None
    """The decider's ``ttft_ratio``; None: the Decider's default."""
    # Workload.
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
    # SLOs.
    ttft_slo_s: float = 1.0
    long_ttft_slo_s: float = 3.0
    long_prompt_tokens: int = 4000
    tpot_slo_s: float = 0.050
    target_attainment: float = 0.90

    def decode_step_s(self, batch: int) -> float:
        slope = (self.decode_step_s_at_64 - self.decode_step_s_at_1) / 63.0
        return self.decode_step_s_at_1 + slope * (batch - 1)

    def ttft_slo(self, prompt_tokens: int) -> float:
        if prompt_tokens > self.long_prompt_tokens:
            return self.long_ttft_slo_s
        return self.ttft_slo_s

    def describe(self) -> str:
        arrivals = f"bursty (gamma, CV {self.burst_cv:g})" if self.bursty else "Poisson"
        return (
            f"{self.name}: {self.prefill_engines} prefill + {self.decode_engines} decode engines, "
            f"{self.decode_engines} sidecars, state {self.state}, metrics {self.staleness_s:g} s "
            f"stale ({self.stale_mode}), {arrivals} arrivals"
            + ("" if self.ttft_ratio is None else f", decider ttft_ratio {self.ttft_ratio:g}")
        )


STANDARD = Scenario()
WIDE = replace(STANDARD, name="wide", decode_engines=16)
SCENARIOS = {"standard": STANDARD, "wide": WIDE}


@dataclass(frozen=True, slots=True)
class Variant:
    """A scheduler under test: a policy and how the decider uses it."""

    policy: str
    mode: Mode = "conditional"

    @property
    def label(self) -> str:
        if self.mode == "never":
            return "never (all local)"
        return self.policy if self.mode == "conditional" else f"{self.policy} always"


DEFAULT_VARIANTS = (
    Variant("qoe"),
    Variant("power_of_two"),
    Variant("least_loaded"),
    Variant("round_robin"),
    Variant("random"),
    Variant("qoe", "always"),
    Variant("round_robin", "always"),
    Variant("qoe", "never"),
)
