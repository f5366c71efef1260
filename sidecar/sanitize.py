"""The KV-transfer fields only the sidecar may set, and every place in a body an engine reads them.

A client that sets one of them steers an engine's KV transfer: a vLLM decode told to pull KV from
a host of the client's choosing, an SGLang decode sent to a bootstrap room, a prefill rank or a
tensor-parallel layout of the client's choosing. The engines read them in more places than the top
level (docs/protocol.md, "Client KV fields", names each place with its source in vLLM and SGLang):

- vLLM turns ``vllm_xargs`` into ``SamplingParams.extra_args`` (a top-level
  ``kv_transfer_params`` is added there when set), and its request takes ``kv_transfer_params``
  from ``extra_args``; the tokens-in route takes ``sampling_params.extra_args`` as they are;
- SGLang's ``/vertex_generate`` spreads ``parameters`` into its request.

Two rules use this one list. The pipeline **strips** (``strip_client_fields``): it rebuilds every
leg's body anyway, and each leg then carries only what the sidecar set. Passthrough **refuses**
(``client_kv_field``, 400): it forwards the client's bytes unchanged, never re-serialized.
"""

from __future__ import annotations

from typing import Any

import orjson

from sidecar.errors import BadRequest

KV_TRANSFER_PARAMS = "kv_transfer_params"
BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
BOOTSTRAP_PAIR_KEY = "bootstrap_pair_key"
DECODE_TP_SIZE = "decode_tp_size"
DISAGG_PREFILL_DP_RANK = "disagg_prefill_dp_rank"

CLIENT_FIELDS = (
    KV_TRANSFER_PARAMS,
    BOOTSTRAP_HOST,
    BOOTSTRAP_PORT,
    BOOTSTRAP_ROOM,
    BOOTSTRAP_PAIR_KEY,
    DECODE_TP_SIZE,
    DISAGG_PREFILL_DP_RANK,
)
"""Fields a client must not set: vLLM's KV instructions (which host and blocks a decode pulls);
SGLang's rendezvous (the room a decode claims, on which bootstrap server, with which pairing key),
the decode's tensor-parallel size the prefill lays the KV out for, and the prefill rank the decode
takes the KV from."""

CARRIERS: tuple[tuple[str, ...], ...] = (
    (),
    ("vllm_xargs",),
    ("sampling_params", "extra_args"),
    ("parameters",),
)
"""Where in a body an engine reads ``CLIENT_FIELDS`` from (the module docstring): the body
itself, and the objects at these paths."""

_QUOTED_NAMES = tuple(b'"%s"' % name.encode() for name in CLIENT_FIELDS)
_NESTED: dict[str, tuple[tuple[str, ...], ...]] = {}
"""``CARRIERS`` below the top level, by their top-level member: the paths inside it."""
for _where in CARRIERS:
    if _where:
        _NESTED[_where[0]] = (*_NESTED.get(_where[0], ()), _where[1:])


def client_kv_field(body: object) -> str | None:
    """The first KV field (dotted, from the body's top) that ``body`` sets to anything but null,
    or None."""
    for where in CARRIERS:
        holder = body
        for key in where:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(holder, dict):
            for name in CLIENT_FIELDS:
                if holder.get(name) is not None:
                    return ".".join((*where, name))
    return None


def strip_client_fields(body: dict[str, Any]) -> bool:
    """Remove, in place, every ``CLIENT_FIELDS`` member (null or not) of every carrier in
    ``body``; return whether anything was removed.

    A large body's carrier may be an ``orjson.Fragment`` (``sidecar.body``): its JSON text is
    read, and only when it names a client field is it parsed and put back as the object, those
    fields removed. Not as a new fragment: a large body's members are found by the ``id()`` of
    their fragment (``sidecar.body.Members``), and a new one may get the id of the one it
    replaces. orjson writes a key without escapes, so the text names a field exactly when it
    holds it, or holds its name in a string.
    """
    removed = _strip(body)
    for top, paths in _NESTED.items():
        value = body.get(top)
        if isinstance(value, orjson.Fragment):
            text = orjson.dumps(value)
            if not any(name in text for name in _QUOTED_NAMES):
                continue
            try:
                value = body[top] = orjson.loads(text)
            except orjson.JSONDecodeError as exc:  # a string set aside, invalid: never parsed
                raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if isinstance(value, dict):
            for path in paths:
                removed |= _strip(_holder(value, path))
    return removed


def _holder(node: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _strip(holder: Any) -> bool:
    if not isinstance(holder, dict):
        return False
    found = [name for name in CLIENT_FIELDS if name in holder]
    for name in found:
        del holder[name]
    return bool(found)
