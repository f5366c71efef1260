"""The decider weighs the stall a local prefill imposes on the decodes running on its engine
(issue 23 item 4)."""

from __future__ import annotations

import random

from sidecar.scheduling.decider import Decider
from sidecar.scheduling.model import Candidate, LocalView, Speed
from sidecar.scheduling.policies import make_policy

SPEED = Speed(s_per_token=1e-4, overhead_s=0.01)


def decide(stall_weight: float, running: int):
    decider = Decider(make_policy("qoe", random.Random(1)), stall_weight=stall_weight)
    # A busy endpoint: 40,000 tokens queued, 4.5 s predicted, past 2 x the local 0.31 s.
    busy = Candidate("p0", reserved_tokens=40_000, speed=SPEED)
    local = LocalView(speed=SPEED, running=running)
    return decider.decide([busy], local, prompt_tokens=3000)


def test_without_stall_weight_a_saturated_pool_keeps_the_prefill_local():
    assert decide(0.0, running=40).reason == "pool_saturated"


def test_the_stall_on_running_decodes_counts_against_prefilling_locally():
    # 40 running x 0.3 s of local compute x 1 = 12 s of stall: the 4.5 s remote prefill wins.
    assert decide(1.0, running=40).endpoint == "p0"
    # Nothing running: nothing stalls, the same pool is saturated.
    assert decide(1.0, running=0).reason == "pool_saturated"
