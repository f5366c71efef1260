"""A discrete-event simulator of P/D-disaggregated serving in virtual time.

It runs the production scheduling classes (``sidecar.scheduling``: decider, policies, estimates)
unchanged against a modelled cluster; see docs/scheduling.md for the model and its assumptions.
"""
