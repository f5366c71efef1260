"""A discrete-event simulator of P/D-disaggregated serving in virtual time.

It runs production's placement code (``sidecar.scheduling``: the planner, decider, policies,
estimates, decode ranks and prefix index, the token estimate) unchanged against a modelled
cluster, with modelled state backends; see docs/scheduling.md for the model and its assumptions.
"""
