"""Loaded by every Python process of the end-to-end suite's vLLM engines (``PYTHONPATH``, see
``e2e/engines.py``): asks Linux for the AMX tile state before vLLM's CPU attention can use it.

vLLM 0.32's CPU attention runs AMX tile instructions when the CPU has them (bf16, a block size
that is a multiple of 32: ``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``) but
does not request the tile state itself (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, which
``torch.cpu._init_amx`` makes); oneDNN requests it the first time its own matrix products use
AMX. A decode engine whose first forward step follows a KV pull (one token: no oneDNN AMX work
yet) reaches the attention kernel first, and its worker dies of SIGILL ("Fatal Python error:
Illegal instruction" in ``cpu_attention_with_kv_cache``) — on machines with AMX only.
"""

import contextlib

with contextlib.suppress(Exception):  # never the reason an engine does not start
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
