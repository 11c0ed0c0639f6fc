"""``POST /tokenize`` and ``POST /detokenize``: the server's tokenizer, in the
shapes of llama.cpp's server and of vLLM's.

``/tokenize``

- llama.cpp: ``{"content": str, "add_special": bool = false}`` ->
  ``{"tokens": [int, ...]}``;
- vLLM: ``{"prompt": str, "add_special_tokens": bool = true}`` or
  ``{"messages": [...], "tools": [...], "add_generation_prompt": bool = true,
  "add_special_tokens": bool = false}`` (the messages and tools checked and
  rendered as ``/v1/chat/completions`` renders them: the same template, the
  same 400s) ->
  ``{"tokens": [...], "count": int, "max_model_len": int}``.

``/detokenize``: ``{"tokens": [int, ...]}`` -> ``{"content": str, "prompt": str}``
(the same text under llama.cpp's name and vLLM's).

A body of neither shape, a field of the wrong type, or a token id outside the
vocabulary is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from ..checks import is_int
from ..errors import PagedKVError
from .prompts import PromptBuilder
from .protocol import APIError, parse_chat, parse_json

__all__ = ["Tokenizing"]


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(f"Invalid type for '{name}': expected a boolean", param=name,
                       code="invalid_type")
    return value


def _text(body: dict, name: str) -> str:
    value = body[name]
    if not isinstance(value, str):
        raise APIError(f"Invalid type for '{name}': expected a string", param=name,
                       code="invalid_type")
    return value


class Tokenizing:
    """The two routes' work (run in a pool thread: a long text takes seconds).

    Parameters
    ----------
    prompts : PromptBuilder
        The server's tokenizer, chat template and context.
    """

    def __init__(self, prompts: PromptBuilder) -> None:
        self.prompts = prompts

    def tokenize(self, raw: bytes) -> dict:
        """The response to a ``/tokenize`` body.

        Raises
        ------
        APIError
            400: neither shape, a wrong type, text that is not Unicode.
        """
        body = parse_json(raw)
        codec = self.prompts.codec
        try:
            if "content" in body:
                text = _text(body, "content")
                ids = codec.encode(text, add_special_tokens=_flag(body, "add_special", False))
                return {"tokens": [int(t) for t in ids]}
            if "messages" in body:
                chat = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
                req = self.prompts.bind_tools(parse_chat(chat))
                text = self.prompts.chat_text(
                    req, add_generation_prompt=_flag(body, "add_generation_prompt", True))
                ids = codec.encode(text, add_special_tokens=_flag(body, "add_special_tokens",
                                                                  False))
            elif "prompt" in body:
                text = _text(body, "prompt")
                ids = codec.encode(text, add_special_tokens=_flag(body, "add_special_tokens",
                                                                  True))
            else:
                raise APIError("Missing required parameter: 'content', 'prompt' or 'messages'",
                               code="missing_required_parameter", param="prompt")
        except APIError:
            raise
        except PagedKVError as exc:
            raise APIError(str(exc), code="invalid_prompt",
                           param="messages" if "messages" in body else "prompt") from None
        tokens = [int(t) for t in ids]
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": self.prompts.context_length}

    def detokenize(self, raw: bytes) -> dict:
        """The response to a ``/detokenize`` body.

        Raises
        ------
        APIError
            400: no ``tokens``, not an array of ints, an id outside the vocabulary.
        """
        body = parse_json(raw)
        tokens: Any = body.get("tokens")
        if tokens is None:
            raise APIError("Missing required parameter: 'tokens'",
                           code="missing_required_parameter", param="tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise APIError("Invalid type for 'tokens': expected an array of token ids",
                           param="tokens", code="invalid_type")
        vocab = self.prompts.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"Invalid value for 'tokens': token id {bad[0]} is outside the "
                           f"vocabulary [0, {vocab})", param="tokens", code="invalid_value")
        text = self.prompts.codec.decode(tokens, skip_special_tokens=False)
        return {"content": text, "prompt": text}
