"""The engines as the sidecar watches them: one monitor polls each engine — every decode rank's
``/health`` and ``/metrics``, every prefill endpoint's ``/metrics`` and, while it is probed after
an ejection, its ``/health`` — and publishes what it found as immutable snapshots
(``snapshot.py``: pure, no I/O; ``monitor.py``: the polling tasks)."""
