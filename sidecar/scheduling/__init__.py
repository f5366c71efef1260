"""Choosing the prefill partner when the gateway named none, whether to disaggregate at all, and
which rank of the local decode engine takes the request.

Pure and synchronous (the simulator runs them as they are): ``model`` (what is known at decision
time), ``policies``, ``decider``, ``estimates`` (speed, health), ``prompts`` (token estimate,
prefix index), ``ranks`` (the decode ranks and the choice among them), ``scrape`` (engine load
parsing), ``placement`` (the pool's per-endpoint knowledge, candidate building, the decision on a
rank, what is reserved, what is learnt from outcomes). Live and async: ``scheduler`` (the pool
and the request path), ``state`` (memory and Redis backends).
"""
