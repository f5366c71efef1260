"""Parsing and validating generation requests (/v1/completions, /v1/chat/completions).

Everything here raises :class:`EmulatorError` with the status vLLM would use; strict mode adds
the checks that catch a P/D proxy sending a prefill leg vLLM would silently mishandle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.sglang import Bootstrap, parse_bootstrap, parse_rid
from sidecar.emulator.text import Prompt, prompt_from_completion, prompt_from_messages

MAX_N = 128


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated generation request.

    ``is_prefill`` is ``kv_transfer_params.do_remote_decode`` (this engine prefills for a remote
    decode and stages the KV); ``is_decode`` is ``do_remote_prefill`` (pull the KV from a remote
    prefill). Both may be set in lenient mode. With the sglang protocol they follow the server's
    ``disaggregation_mode`` instead, and ``bootstrap`` holds the request's room.
    """

    endpoint: Endpoint
    request_id: str
    prompt: Prompt
    output_tokens: int
    n: int
    stream: bool
    include_usage: bool
    is_prefill: bool
    is_decode: bool
    kv_params: Mapping[str, Any] | None
    bootstrap: Bootstrap | None = None
    rid: str | None = None

    @property
    def response_id(self) -> str:
        prefix = "cmpl" if self.endpoint is Endpoint.COMPLETIONS else "chatcmpl"
        return f"{prefix}-{self.request_id}"

    @property
    def role(self) -> str:
        if self.is_prefill and self.is_decode:
            return "prefill+decode"
        return "prefill" if self.is_prefill else "decode" if self.is_decode else "plain"


def _bad(message: str) -> EmulatorError:
    return EmulatorError(400, message)


def _optional_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer")
    if value < minimum:
        raise _bad(f"{name} must be at least {minimum}, got {value}")
    return value


def _optional_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean")
    return value


def _flag(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"kv_transfer_params.{name} must be a boolean")
    return bool(value)


def parse_generation(
    endpoint: Endpoint, body: object, request_id: str, config: EmulatorConfig
) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    try:
        if endpoint is Endpoint.COMPLETIONS:
            if "prompt" not in body:
                raise ValueError("prompt is required")
            prompt = prompt_from_completion(body["prompt"], config.tokenizer)
        else:
            if "messages" not in body:
                raise ValueError("messages is required")
            prompt = prompt_from_messages(body["messages"], config.tokenizer)
    except ValueError as exc:
        raise _bad(str(exc)) from exc

    max_tokens = _optional_int(body, "max_tokens", 1)
    max_completion_tokens = _optional_int(body, "max_completion_tokens", 1)
    min_tokens = _optional_int(body, "min_tokens", 0) or 0
    n = _optional_int(body, "n", 1) or 1
    if n > MAX_N:
        raise _bad(f"n must be at most {MAX_N}")
    stream = _optional_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("stream_options must be an object")
    if stream_options and not stream:
        # vLLM's request validator rejects this too: a prefill leg must drop stream_options.
        raise _bad("Stream options can only be defined when `stream=True`.")
    include_usage = _optional_bool(stream_options, "include_usage") if stream_options else False

    limits = [v for v in (max_tokens,) if v is not None]
    if endpoint is Endpoint.CHAT and max_completion_tokens is not None:
        limits.append(max_completion_tokens)
    output_tokens = min(limits) if limits else config.default_max_tokens
    if min_tokens > output_tokens:
        raise _bad(
            f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({output_tokens})"
        )
    if prompt.num_tokens + output_tokens > config.max_model_len:
        # vLLM's wording (its OpenAI server's input validation), on both routes.
        raise _bad(
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {prompt.num_tokens + output_tokens} tokens ({prompt.num_tokens} in the "
            f"messages, {output_tokens} in the completion). Please reduce the length of the "
            "messages or completion."
        )

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string")
    if model is not None and model != config.model:
        raise EmulatorError(404, f"The model `{model}` does not exist.")

    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise _bad("kv_transfer_params must be an object")
    is_prefill = kv_params is not None and _flag(kv_params, "do_remote_decode")
    is_decode = kv_params is not None and _flag(kv_params, "do_remote_prefill")
    bootstrap: Bootstrap | None = None
    rid: str | None = None
    if config.kv_protocol in ("sglang", "shared-storage") and kv_params is not None:
        if config.mode == "strict":
            raise _bad(f"strict mode: kv_transfer_params is not used with {config.kv_protocol}")
        kv_params, is_prefill, is_decode = None, False, False  # ignored, as vLLM would
    if config.kv_protocol == "sglang":
        try:
            bootstrap = parse_bootstrap(body, _prompt_count(endpoint, body), n)
        except ValueError as exc:
            raise _bad(str(exc)) from exc
        rid = parse_rid(body)
        is_prefill = config.disaggregation_mode == "prefill"
        is_decode = config.disaggregation_mode == "decode"
        if bootstrap is None:
            what = "serve without a decode" if is_prefill else "prefill locally"
            raise _bad(
                f"a {config.disaggregation_mode} server cannot {what}: "
                "bootstrap_host/bootstrap_port/bootstrap_room required"
            )
        if is_prefill:
            output_tokens = 1  # an SGLang prefill server generates the first token only

    request = GenerationRequest(
        endpoint=endpoint,
        request_id=request_id,
        prompt=prompt,
        output_tokens=output_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
        is_prefill=is_prefill,
        is_decode=is_decode,
        kv_params=kv_params,
        bootstrap=bootstrap,
        rid=rid,
    )
    if config.mode == "strict" and config.kv_protocol in ("nixl", "nixl-push"):
        _check_strict(request, max_tokens, max_completion_tokens)
    return request


def _prompt_count(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Prompts in a completions batch (a list of strings or of token-id lists); 1 otherwise."""
    prompt = body.get("prompt") if endpoint is Endpoint.COMPLETIONS else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def _check_strict(
    request: GenerationRequest, max_tokens: int | None, max_completion_tokens: int | None
) -> None:
    """Reject prefill legs that real vLLM would accept but mishandle (see real-vllm-on-cpu.md)."""
    if request.is_prefill and request.is_decode:
        raise _bad(
            "strict mode: kv_transfer_params sets both do_remote_decode and do_remote_prefill"
        )
    if not request.is_prefill:
        return
    if request.stream:
        raise _bad(
            "strict mode: a prefill request (do_remote_decode=true) must not stream; vLLM "
            "returns no kv_transfer_params on a streamed prefill and strands the blocks"
        )
    too_many = {
        name: value
        for name, value in (
            ("max_tokens", max_tokens),
            ("max_completion_tokens", max_completion_tokens),
        )
        if value is not None and value > 1
    }
    if too_many or (max_tokens is None and max_completion_tokens is None):
        raise _bad(
            "strict mode: a prefill request (do_remote_decode=true) must set max_tokens=1 "
            f"(and max_completion_tokens at most 1); got {too_many or 'no token limit'}"
        )
    if request.n > 1:
        raise _bad("strict mode: a prefill request (do_remote_decode=true) must use n=1")
