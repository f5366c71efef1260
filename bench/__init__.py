"""Benchmarks and the scheduling simulator. Never imported by the ``sidecar`` package."""
