"""Benchmarks and the scheduling simulator (``python -m bench --help``; bench/suite.py). Never
imported by the ``sidecar`` package."""
