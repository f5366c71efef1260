"""The SLO sets every run is judged by, side by side.

- ``scaled``: the scenario's own (``Scenario.ttft_slo``: 1 s, 3 s over 4,000 prompt tokens, for a
  trace at least 3 × the prompt's idle prefill) and mean TPOT ≤ ``Scenario.tpot_slo_s``; goodput
  and the checks use it.
- ``constant``: DistServe-style (Zhong et al., OSDI'24: one TTFT and one TPOT bound per
  workload, whatever the prompt): ``Scenario.constant_ttft_s`` and ``constant_tpot_s``.
- ``mooncake 100 ms`` / ``200 ms`` / ``300 ms``: Mooncake's (FAST'25, kvcache-ai/Mooncake
  ``FAST25-release/Mooncake-FAST25.pdf``, §5.1 Metric): TTFT ≤ 30 s and the tail time between
  tokens (``bench.sim.engines.tail_gap``: the mean of the longest 10 % of a request's
  inter-token gaps) ≤ 100, 200 or 300 ms.

Each is reported three ways: both bounds met, the TTFT bound met, the decode bound met.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.sim.scenario import Scenario

MOONCAKE_TTFT_S = 30.0
MOONCAKE_TBT_S = (0.100, 0.200, 0.300)


@dataclass(frozen=True, slots=True)
class Slo:
    name: str
    ttft_s: float | None
    """None: the scenario's scaled TTFT SLO (per prompt)."""
    tpot_s: float | None = None
    """A bound on the mean time per output token."""
    tail_tbt_s: float | None = None
    """A bound on the tail time between tokens."""

    def ttft_met(self, scenario: Scenario, prompt_tokens: int, ttft: float) -> bool:
        bound = scenario.ttft_slo(prompt_tokens) if self.ttft_s is None else self.ttft_s
        return ttft <= bound

    def decode_met(self, tpot: float, tail_tbt: float) -> bool:
        return (self.tpot_s is None or tpot <= self.tpot_s) and (
            self.tail_tbt_s is None or tail_tbt <= self.tail_tbt_s
        )


@dataclass(frozen=True, slots=True)
class Met:
    """Shares of the measured requests meeting an SLO set."""

    both: float
    ttft: float
    decode: float
    """The decode-side bound: mean TPOT, or tail time between tokens."""


def slos(scenario: Scenario) -> tuple[Slo, ...]:
    return (
        Slo("scaled", None, tpot_s=scenario.tpot_slo_s),
        Slo("constant", scenario.constant_ttft_s, tpot_s=scenario.constant_tpot_s),
        *(
            Slo(f"mooncake {tbt * 1000:g} ms", MOONCAKE_TTFT_S, tail_tbt_s=tbt)
            for tbt in MOONCAKE_TBT_S
        ),
    )
