"""What the tests, the benchmarks and the end-to-end suite share: child processes on loopback
(:mod:`devkit.processes`) and summary statistics (:mod:`devkit.stats`).

Never imported by the package ``sidecar``; imported from the repository root, like ``tests``,
``bench`` and ``e2e``.
"""
