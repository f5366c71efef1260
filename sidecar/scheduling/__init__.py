"""Choosing the prefill partner when the gateway named none, and whether to disaggregate at all.

Pure and synchronous (the simulator runs them as they are): ``model`` (what is known at decision
time), ``policies``, ``decider``, ``estimates`` (speed, health), ``prompts`` (token estimate,
prefix index), ``scrape`` (engine load parsing). Live and async: ``scheduler`` (the pool and the
request path), ``state`` (memory and Redis backends).
"""
