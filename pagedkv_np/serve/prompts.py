"""From a checked request to what the engine takes: prompt ids, a token budget,
a text stream.

Chat requests go through the model's chat template (with the generation
prompt), completions through the tokenizer (or arrive as token ids). The
context length is the smaller of the model's positions and the K/V pool's
tokens: a prompt that leaves no room for one token, or ``max_tokens`` that
overrun it, is a 400 before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, PagedKVError
from .protocol import APIError, GenerationRequest

try:
    from ..text.streaming import TextStream
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedkv_np.serve needs tokenizers and jinja2: "
                      "pip install 'pagedkv-np[serve]'") from exc

__all__ = ["PromptBuilder", "context_length"]


def context_length(decoder: Any) -> int:
    """Most tokens (prompt + generated) one request of ``decoder`` can hold."""
    cache = decoder.cache
    limit = int(cache.num_pages) * int(cache.page_size)
    positions = getattr(decoder.io, "max_positions", None)
    if positions is not None:
        limit = min(limit, int(positions))
    return limit


class PromptBuilder:
    """Prompt ids, token budgets and text streams for one decoder.

    Parameters
    ----------
    decoder : OrtDecoder
        With a ``text`` codec (as ``OrtDecoder.from_pretrained`` loads it).

    Attributes
    ----------
    context_length : int
    eos_token_ids : frozenset of int
    """

    def __init__(self, decoder: Any) -> None:
        codec = getattr(decoder, "text", None)
        if codec is None:
            raise ConfigError("Invalid decoder: it has no tokenizer (text); load it with "
                              "OrtDecoder.from_pretrained")
        self.codec = codec
        self.context_length = context_length(decoder)
        self.eos_token_ids = frozenset(getattr(decoder, "eos_token_ids", ()) or ())
        vocab = getattr(decoder.io, "vocab_size", None)
        self.vocab_size = int(vocab) if vocab is not None else int(codec.vocab_size)

    def prompt_ids(self, req: GenerationRequest) -> np.ndarray:
        """The prompt's token ids, shape [n], int64 (n >= 1).

        Raises
        ------
        APIError
            The chat template refused the messages, or the prompt is empty
            or holds a token id outside the vocabulary.
        """
        try:
            if req.messages is not None:
                ids = self.codec.encode_chat(list(req.messages), add_generation_prompt=True)
            elif isinstance(req.prompt, str):
                ids = self.codec.encode(req.prompt)
            else:
                ids = np.asarray(req.prompt, dtype=np.int64)
        except PagedKVError as exc:
            raise APIError(str(exc), param="messages" if req.messages is not None else "prompt",
                           code="invalid_prompt") from None
        if ids.shape[0] == 0:
            raise APIError("The prompt has no tokens", param="prompt", code="invalid_prompt")
        top = int(ids.max())
        if top >= self.vocab_size:
            raise APIError(f"Invalid value for 'prompt': token id {top} is outside the "
                           f"vocabulary [0, {self.vocab_size})", param="prompt",
                           code="invalid_value")
        return ids

    def max_tokens(self, req: GenerationRequest, num_prompt_tokens: int) -> int:
        """The request's token budget: ``max_tokens``, or what the context leaves.

        Raises
        ------
        APIError
            The prompt and ``max_tokens`` do not fit the context.
        """
        room = self.context_length - num_prompt_tokens
        wanted = req.max_tokens if req.max_tokens is not None else max(room, 1)
        if wanted > room:
            asked = "" if req.max_tokens is None else f" + {req.max_tokens} max_tokens"
            raise APIError(
                f"This model's maximum context length is {self.context_length} tokens; the "
                f"request asks for {num_prompt_tokens} prompt tokens{asked}. Shorten the "
                "prompt or lower max_tokens.",
                param="messages" if req.messages is not None else "prompt",
                code="context_length_exceeded")
        return wanted

    def text_stream(self, req: GenerationRequest) -> TextStream:
        """A fresh detokenizer with the request's stop strings."""
        return TextStream(self.codec, stop=list(req.stop) or None,
                          eos_token_ids=self.eos_token_ids)
