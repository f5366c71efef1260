"""The decider weighs the stall a local prefill imposes on the decodes running on its
engine."""

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


def test_the_stall_counts_only_against_a_prefill_server_with_room():
    # 40 running x 0.3 s of local compute x 1 = 12 s of stall, but the endpoint has 40,000
    # tokens queued: it is the pool's bottleneck, and the stall is not weighed against it.
    assert decide(1.0, running=40).reason == "pool_saturated"
    # An idle endpoint 3x slower than local (0.93 s against 0.31 s: past 2 x) takes the prefill
    # when the stall it spares outweighs the difference.
    decider = Decider(make_policy("qoe", random.Random(1)), stall_weight=1.0)
    slow = Candidate("p0", speed=Speed(s_per_token=3e-4, overhead_s=0.03))
    busy = LocalView(speed=SPEED, running=40)
    assert decider.decide([slow], busy, prompt_tokens=3000).endpoint == "p0"
    # Nothing running: nothing stalls, the same pool is saturated.
    idle = LocalView(speed=SPEED, running=0)
    assert decider.decide([slow], idle, prompt_tokens=3000).reason == "pool_saturated"


def test_a_short_prompt_goes_remote_when_its_local_stall_outweighs_a_remote_prefill():
    decider = Decider(make_policy("qoe", random.Random(1)), stall_weight=0.1)
    idle = Candidate("p0")  # the prefill prior: 20 ms of overhead per call, 10 more than local
    # 400 uncached tokens (below min_tokens): 0.04 s of local compute.
    quiet = LocalView(speed=SPEED, running=2)  # 2 x 0.04 x 0.1 = 8 ms of stall: stays local
    assert decider.decide([idle], quiet, prompt_tokens=400).reason == "short_prompt"
    # 60 running decodes: 0.24 s of weighed stall, more than the remote prefill's extra 12 ms.
    busy = LocalView(speed=SPEED, running=60)
    decision = decider.decide([idle], busy, prompt_tokens=400)
    assert (decision.endpoint, decision.reason) == ("p0", "scheduled")
    # A prefix the local engine holds: the same rule, on what each would compute. A prefill
    # server that would compute all 4,400 tokens (0.46 s) is not worth 0.24 s of stall...
    assert decider.decide([idle], busy, prompt_tokens=4400, cached_tokens=4000).reason == (
        "prefix_cached"
    )
    # ...one that holds the prefix too (the prefill prefix index says so) is.
    holder = Candidate("p1", cached_tokens=4000)
    decision = decider.decide([idle, holder], busy, prompt_tokens=4400, cached_tokens=4000)
    assert decision.endpoint == "p1"
    assert decider.decide([holder], quiet, prompt_tokens=4400, cached_tokens=4000).reason == (
        "prefix_cached"
    )
    # A holder with work queued is the pool's bottleneck: the short prompt stays local.
    queued = Candidate("p1", cached_tokens=4000, reserved_tokens=2000)
    assert decider.decide([queued], busy, prompt_tokens=4400, cached_tokens=4000).reason == (
        "prefix_cached"
    )
    # Without the weight, short prompts always stay local.
    unweighed = Decider(make_policy("qoe", random.Random(1)), stall_weight=0.0)
    assert unweighed.decide([idle], busy, prompt_tokens=400).reason == "short_prompt"
