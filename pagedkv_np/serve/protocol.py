"""The OpenAI wire format: request checking and errors.

Nothing here touches the engine: :func:`parse_chat` and :func:`parse_completion`
turn a decoded JSON body into a :class:`GenerationRequest` or raise
:class:`APIError`; :mod:`~pagedkv_np.serve.responses` builds the JSON objects
that go back. Unknown fields are ignored (clients send many), as
OpenAI does; :func:`unknown_fields` names them (the server logs each name
once); a field this module reads belongs in :data:`KNOWN_FIELDS`. A known
field of the wrong type or out of range is a 400 naming the field in
``param``, and so is a string that is not valid Unicode text (a lone
surrogate such as ``"\\ud800"``: valid JSON, but no UTF-8 encodes it, so
neither the tokenizer nor a response could carry it); a known feature this
server does not implement (``best_of`` on chat, ``tools`` on completions,
``suffix`` for a model without fill-in-the-middle tokens) is a 400
too, rather than silently different output. Chat's tool fields are checked
in :mod:`~pagedkv_np.serve.tools`. A body nested too deeply for
the JSON parser is a 400 as well.
"""

from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..checks import is_int
from .api_error import APIError, json_type
from .tools import ToolRequest, message_fields, parse_tools

__all__ = ["APIError", "GenerationRequest", "parse_json", "parse_chat", "parse_completion",
           "MAX_STOP_STRINGS", "MAX_LOGIT_BIAS", "MAX_STOP_TOKEN_IDS", "MAX_LOGPROBS",
           "KNOWN_FIELDS", "unknown_fields"]

#: most stop strings a request may give
MAX_STOP_STRINGS = 16
_ROLES = ("system", "developer", "user", "assistant", "tool")
_SURROGATE = re.compile("[\\ud800-\\udfff]")
#: the request fields read (or refused by name) by either route
KNOWN_FIELDS = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stream", "stream_options", "cache_salt", "user", "n",
    "best_of", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "echo",
    "suffix", "logit_bias", "tools", "response_format", "repetition_penalty", "min_p",
    "stop_token_ids", "ignore_eos", "min_tokens", "tool_choice", "parallel_tool_calls"})
#: most entries of ``logit_bias`` and of ``stop_token_ids``
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
#: most alternatives per token (``top_logprobs``, completions' ``logprobs``)
MAX_LOGPROBS = 20


def unknown_fields(body: dict) -> list[str]:
    """The fields of a request body that no route reads (ignored, as OpenAI
    ignores them)."""
    return [name for name in body if name not in KNOWN_FIELDS]


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request of either endpoint.

    Exactly one of ``messages`` (chat: role/content string pairs, with an
    assistant's ``tool_calls`` and a tool message's ``tool_call_id``, ready
    for the chat template) and ``prompt`` (completions: text, or token ids) is set.
    ``max_tokens`` None means "up to the context length".
    """

    kind: str                                   # "chat" or "completion"
    model: str | None
    messages: tuple[dict, ...] | None
    prompt: str | tuple[int, ...] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_salt: str | None
    #: the engine's further options for ``add_request`` (penalties, ``min_p``,
    #: ``logit_bias`` as {token id: bias}, ``stop_token_ids``, ``ignore_eos``,
    #: ``min_tokens``, ``logprobs``: alternatives per token), only those the
    #: request set
    options: dict = field(default_factory=dict)
    #: choices: continuations of the one prompt (``add_parallel_requests``)
    n: int = 1
    #: chat's tools and tool_choice (None: no tools)
    tools: ToolRequest | None = None
    #: completions: the prompt's text goes before each choice's text
    echo: bool = False
    #: completions: candidates generated, of which the ``n`` with the highest
    #: cumulative token logprob are returned (``best_of`` = ``n``: all)
    best_of: int = 1
    #: completions: the text after the insertion (fill-in-the-middle), or None
    suffix: str | None = None

    @property
    def engine_options(self) -> dict:
        """``options`` with what ranking ``best_of`` candidates needs (each
        token's logprob, without alternatives, when none were asked for)."""
        if self.best_of > self.n and "logprobs" not in self.options:
            return {**self.options, "logprobs": 0}
        return self.options


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError("The request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"The request body must be a JSON object, got {json_type(data)}",
                       code="invalid_json")
    return data


def _type_error(name: str, expected: str, value: Any) -> APIError:
    return APIError(f"Invalid type for '{name}': expected {expected}, got {json_type(value)}",
                    code="invalid_type", param=name)


def _value_error(name: str, message: str) -> APIError:
    return APIError(f"Invalid value for '{name}': {message}", code="invalid_value", param=name)


def _unsupported(name: str, what: str) -> APIError:
    return APIError(f"'{name}' is not supported by this server ({what})",
                    code="unsupported_parameter", param=name)


def _text(name: str, value: str) -> str:
    """``value`` if it is valid Unicode text, else a 400 naming ``name``."""
    if not value.isascii():
        found = _SURROGATE.search(value)
        if found is not None:
            raise _value_error(name, f"a lone surrogate (U+{ord(found.group()):04X}) at index "
                                     f"{found.start()} is not valid Unicode text")
    return value


def _int(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        # JSON has one number type: 3.0 is an integer to most clients
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(name, "an integer", value)
    return int(value)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(name, "a number", value)
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise _value_error(name, "expected a finite number")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return _text(name, value)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(items) > MAX_STOP_STRINGS:
        raise _value_error("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(s == "" for s in items):
        raise _value_error("stop", "stop strings must not be empty")
    for s in items:
        _text("stop", s)
    return tuple(dict.fromkeys(items))


def _best_of(body: dict, kind: str, n: int) -> int:
    """Candidates of a completion: ``best_of``, at least ``n``; not streamed."""
    best_of = _int(body, "best_of", None)
    if best_of is None:
        return n
    if kind == "chat" and best_of != 1:
        raise _unsupported("best_of", "best_of is for /v1/completions")
    if best_of < n:
        raise _value_error("best_of", f"expected best_of >= n = {n}, got {best_of}")
    if best_of > n and _bool(body, "stream", False):
        raise _unsupported("best_of", "best_of with stream: the best candidates are known "
                                      "only at the end")
    return max(best_of, 1)


def _check_unsupported(body: dict, kind: str) -> None:
    if _bool(body, "echo", False) and kind == "chat":
        raise _unsupported("echo", "echo is for /v1/completions")
    if kind == "chat" and body.get("suffix") not in (None, ""):
        raise _unsupported("suffix", "suffix is for /v1/completions")
    if kind != "chat" and body.get("tools") not in (None, []):
        raise _unsupported("tools", "tools are for /v1/chat/completions")


def _ranged(body: dict, name: str, lo: float, hi: float, options: dict,
            lo_open: bool = False) -> None:
    """Put ``body[name]`` in ``options`` when it is given, checked to lie in
    ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if body.get(name) is None:
        return
    value = _number(body, name, 0.0)
    if value > hi or value < lo or (lo_open and value == lo):
        left = "<" if lo_open else "<="
        raise _value_error(name, f"expected {lo:g} {left} {name} <= {hi:g}, got {value:g}")
    options[name] = value


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids as decimal strings -> bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise _value_error("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, item in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise _value_error("logit_bias", f"keys must be token ids as decimal strings, "
                                             f"got {key[:32]!r}")
        number = _number({"logit_bias": item}, "logit_bias", 0.0)
        if not -100.0 <= number <= 100.0:
            raise _value_error("logit_bias", f"biases must be in [-100, 100], got {number:g} "
                                             f"for token {key}")
        bias[int(key)] = number
    return bias


def _stop_token_ids(body: dict) -> tuple[int, ...] | None:
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise _type_error("stop_token_ids", "an array of token ids", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise _value_error("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got "
                                             f"{len(value)}")
    if value and (min(value) < 0 or max(value) >= 2 ** 31):
        bad = min(value) if min(value) < 0 else max(value)
        raise _value_error("stop_token_ids", f"token ids must be in [0, 2**31), got {bad}")
    return tuple(int(t) for t in value)


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token: chat's ``logprobs: true`` with ``top_logprobs``,
    completions' ``logprobs: k``; None when not asked for."""
    if kind == "chat":
        wanted = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise _value_error("top_logprobs", f"expected 0 to {MAX_LOGPROBS}, got {top}")
        if top and not wanted:
            raise _value_error("top_logprobs", "needs logprobs: true")
        return (top or 0) if wanted else None
    if isinstance(body.get("logprobs"), bool):
        raise _type_error("logprobs", "an integer", body["logprobs"])
    top = _int(body, "logprobs", None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _value_error("logprobs", f"expected 0 to {MAX_LOGPROBS}, got {top}")
    return top


def _n(body: dict) -> int:
    n = _int(body, "n", 1) or 0
    if n < 1:
        raise _value_error("n", f"expected an integer >= 1, got {n}")
    return n


def _engine_options(body: dict, kind: str) -> dict:
    """The engine options a request sets (see ``GenerationRequest.options``)."""
    options: dict = {}
    logprobs = _logprobs(body, kind)
    if logprobs is not None:
        options["logprobs"] = logprobs
    _ranged(body, "presence_penalty", -2.0, 2.0, options)
    _ranged(body, "frequency_penalty", -2.0, 2.0, options)
    _ranged(body, "min_p", 0.0, 1.0, options)
    if body.get("repetition_penalty") is not None:
        value = _number(body, "repetition_penalty", 1.0)
        if not 0.0 < value <= 100.0:
            raise _value_error("repetition_penalty",
                               f"expected 0 < repetition_penalty <= 100, got {value:g}")
        options["repetition_penalty"] = value
    bias = _logit_bias(body)
    if bias:
        options["logit_bias"] = bias
    stop_ids = _stop_token_ids(body)
    if stop_ids:
        options["stop_token_ids"] = stop_ids
    if _bool(body, "ignore_eos", False):
        options["ignore_eos"] = True
    min_tokens = _int(body, "min_tokens", None)
    if min_tokens is not None:
        if min_tokens < 0:
            raise _value_error("min_tokens", f"expected an integer >= 0, got {min_tokens}")
        options["min_tokens"] = min_tokens
    return options


def _common(body: dict, kind: str, messages: tuple[dict, ...] | None,
            prompt: str | tuple[int, ...] | None) -> GenerationRequest:
    _check_unsupported(body, kind)
    max_tokens = _int(body, "max_tokens", None)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None)
        name = "max_completion_tokens"
    else:
        name = "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise _value_error(name, f"expected an integer >= 1, got {max_tokens}")
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _value_error("temperature", f"expected 0 <= temperature <= 2, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _value_error("top_p", f"expected 0 < top_p <= 1, got {top_p}")
    top_k = _int(body, "top_k", 0) or 0
    if top_k == -1:          # vLLM's spelling of "no cut"
        top_k = 0
    if top_k < 0:
        raise _value_error("top_k", f"expected an integer >= 0, got {top_k}")
    seed = _int(body, "seed", None)
    if seed is not None and seed < 0:
        raise _value_error("seed", f"expected an integer >= 0, got {seed}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = _bool(options or {}, "include_usage", False)
    salt = _str(body, "cache_salt")
    if salt == "":
        raise _value_error("cache_salt", "expected a non-empty string")
    _str(body, "user")
    engine_options = _engine_options(body, kind)
    echo = _bool(body, "echo", False)
    if echo and "logprobs" in engine_options:
        # the engine keeps the logits of a prompt's last position only
        raise _unsupported("echo", "echo with logprobs: the prompt's logprobs are not "
                                   "computed; send echo or logprobs, not both")
    n = _n(body)
    return GenerationRequest(kind=kind, model=_str(body, "model"), messages=messages,
                             prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k, seed=seed, stop=_stop(body),
                             stream=_bool(body, "stream", False), include_usage=include_usage,
                             cache_salt=salt, options=engine_options, n=n,
                             echo=echo, best_of=_best_of(body, kind, n),
                             suffix=_str(body, "suffix") or None)


def _message(i: int, msg: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _type_error(where, "an object", msg)
    role = msg.get("role")
    if not isinstance(role, str):
        raise _type_error(f"{where}.role", "a string", role)
    if role not in _ROLES:
        raise _value_error(f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise _type_error(f"{where}.content[{j}]", "a text part", part)
            if part.get("type", "text") != "text":
                raise _unsupported(f"{where}.content[{j}]", "text parts only")
            texts.append(_text(f"{where}.content[{j}].text", part["text"]))
        content = "".join(texts)
    if not isinstance(content, str):
        raise _type_error(f"{where}.content", "a string or an array of text parts", content)
    return {"role": role, "content": _text(f"{where}.content", content),
            **message_fields(where, role, msg)}


def parse_chat(body: dict) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body."""
    messages = body.get("messages")
    if messages is None:
        raise APIError("Missing required parameter: 'messages'", code="missing_required_parameter",
                       param="messages")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise _value_error("messages", "expected at least one message, got an empty array")
    req = _common(body, "chat", tuple(_message(i, m) for i, m in enumerate(messages)), None)
    return replace(req, tools=parse_tools(body))


def parse_completion(body: dict) -> GenerationRequest:
    """Check a ``/v1/completions`` body (a prompt: a string, or token ids)."""
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("Missing required parameter: 'prompt'", code="missing_required_parameter",
                       param="prompt")
    prompt: Any = body["prompt"]
    # one prompt per request: a batch of exactly one is unwrapped
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list))
                                                             for p in prompt):
        raise _unsupported("prompt", "one prompt per request")
    if isinstance(prompt, str):
        if prompt == "":
            raise _value_error("prompt", "expected a non-empty prompt")
        return _common(body, "completion", None, _text("prompt", prompt))
    if not isinstance(prompt, list) or not all(
            is_int(t) for t in prompt):
        raise _type_error("prompt", "a string or an array of token ids", prompt)
    if not prompt:
        raise _value_error("prompt", "expected a non-empty prompt")
    if min(prompt) < 0 or max(prompt) >= 2 ** 31:
        bad = min(prompt) if min(prompt) < 0 else max(prompt)
        raise _value_error("prompt", f"token ids must be in [0, 2**31), got {bad}")
    return _common(body, "completion", None, tuple(int(t) for t in prompt))
