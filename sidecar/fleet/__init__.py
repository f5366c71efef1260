"""The fleet's vocabulary: what every layer of the sidecar names — an engine's address
(``Endpoint``), its load and what the monitor found of it (``EngineLoad``, ``EngineSnapshot``),
a prefill endpoint's poll, the KV connector protocols the engines speak.

Plain values, pure functions, no I/O: this package imports nothing of the sidecar's
(``tests/test_layers.py`` holds it to that), so every other package may import it.
"""
