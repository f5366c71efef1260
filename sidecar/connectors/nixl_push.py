"""vLLM NixlPushConnector (vLLM 0.32): the prefill engine writes the KV into the decode's blocks.

Found by reading vLLM 0.32's push connector and its toy proxy (docs/protocol.md has the sources):
at the proxy the exchange is the pull connector's — the same prefill leg, the prefill's
``kv_transfer_params`` (plus ``"transfer_mode": "push"``) given verbatim to the decode leg — with
one difference. The decode engine registers its blocks with the prefill engine under **its own
request id** (``cmpl-``/``chatcmpl-`` + the ``x-request-id``), and the prefill engine pushes the
entry it staged under that same id. A release with an id of its own (as ``nixl`` sends) matches
nothing and frees nothing: here it carries the prefill leg's exact ``x-request-id`` on the same
path. vLLM 0.32 frees nothing by itself after a decode refusal (the KV is held until its lease),
so this release is what frees it.
"""

from __future__ import annotations

from sidecar.connectors.exchange import Exchange
from sidecar.connectors.nixl import NixlConnector


class NixlPushConnector(NixlConnector):
    name = "nixl-push"

    def release_id(self, ex: Exchange) -> str:
        """The prefill leg's engine id: the prefill engine hands its KV only to a registration
        under the same id (on the same path)."""
        return ex.engine_id
