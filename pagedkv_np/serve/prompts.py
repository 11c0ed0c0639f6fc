"""From a checked request to what the engine takes: prompt ids, a token budget,
a text stream.

Chat requests go through the model's chat template (with the generation
prompt), completions through the tokenizer (or arrive as token ids). How
much a request may hold is the engine's rule alone (``decoder.limits``,
:class:`~pagedkv_np.onnxruntime.limits.RequestLimits`): the default
``max_tokens`` is ``limits.room(n)`` after a prompt of ``n`` tokens, and a
request that ``decoder.check_request`` refuses is a 400
``context_length_exceeded`` stating the limit in tokens, before anything
reaches the engine.

A text too long to fit is refused before it is tokenized (tokenizing
megabytes takes seconds and a gigabyte), when the tokenizer allows a lower
bound on its tokens that never refuses a prompt that fits
(:func:`token_bound`: roughly, more than ``context_length x`` the longest
token's characters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError, ContextLengthExceeded, PagedKVError
from ..onnxruntime.limits import RequestLimits
from .infill import fim_token_ids, infill_ids
from .protocol import APIError, GenerationRequest
from .tool_calls import detect_format

try:
    from ..text.streaming import TextStream
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedkv_np.serve needs tokenizers and jinja2: "
                      "pip install 'pagedkv-np[serve]'") from exc

__all__ = ["EchoStream", "PromptBuilder", "ServedDecoder", "TokenBound", "token_bound"]

# pre-tokenizers that keep every character: they split text, or add to it
_KEEPING = ("ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "UnicodeScripts")
# normalizers that never shorten a text by more than this factor: a composed
# character stands for at most 4 code points of its canonical decomposition
# (U+1FAF) and 18 of its compatibility one (U+FDFA); the others never shorten
_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 18}


@dataclass(frozen=True)
class TokenBound:
    """A lower bound on the number of tokens of a text, without tokenizing it.

    Every character of a text becomes part of some token, except the
    ``dropped`` ones (ASCII characters a byte-level vocabulary has no byte
    for: the tokenizer leaves them out), and no token stands for more than
    ``max_chars_per_token`` characters of the text: a text has at least
    ``ceil((len(text) - dropped characters) / max_chars_per_token)`` tokens.
    """

    max_chars_per_token: int
    dropped: str = ""

    def min_tokens(self, text: str) -> int:
        num_chars = len(text) - sum(text.count(c) for c in self.dropped)
        return -(-num_chars // self.max_chars_per_token)


def _pre_tokenizers(pre: dict | None) -> list[dict]:
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [p for q in pre.get("pretokenizers", ()) for p in _pre_tokenizers(q)]
    return [pre]


def _shrink(norm: dict | None) -> int | None:
    """Most a normalizer can shorten a text by (a factor); None: unbounded
    (it may delete characters, or merge runs of them)."""
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        factor = 1
        for step in norm.get("normalizers", ()):
            shrink = _shrink(step)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":   # one character by a non-empty string: never shorter
        pattern = norm.get("pattern") or {}
        return 1 if len(pattern.get("String") or "") == 1 and norm.get("content") else None
    return _SHRINK.get(str(kind))


def _byte_level_gaps(vocab: dict) -> str | None:
    """The ASCII characters whose byte a byte-level ``vocab`` lacks; None
    when it lacks a UTF-8 continuation byte (then a character may vanish
    whole, and no bound holds)."""
    from tokenizers import pre_tokenizers

    # the byte -> character map of the pre-tokenizer itself
    to_chars = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def byte_char(text: str) -> str:
        return to_chars.pre_tokenize_str(text)[0][0][-1]

    if any(byte_char(bytes([0xC2, b]).decode()) not in vocab for b in range(0x80, 0xC0)):
        return None
    return "".join(chr(b) for b in range(0x80) if byte_char(chr(b)) not in vocab)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The :class:`TokenBound` of a ``tokenizers.Tokenizer``; None when no
    bound is provable from its configuration.

    Provable means: a normalizer that shortens a text by a bounded factor
    at most (none; Unicode forms, lowercase, prepend, one character replaced
    by a non-empty string), no truncation, no added token that swallows the
    spaces beside it (``lstrip``/``rstrip``), pre-tokenizers that keep every
    character, and a BPE model that maps every character to some token
    (byte-level alphabet, byte fallback, or one unknown token per unknown
    character), but for the ASCII characters a byte-level vocabulary lacks
    (counted out; then no normalizer). A token then stands for at most as
    many normalized characters as its vocabulary string has (a byte-level
    string has one per byte, a byte-fallback token one byte, an added token
    its content), times the normalizer's factor.
    """
    try:
        spec = json.loads(tokenizer.to_str())
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    except Exception:   # not a tokenizers.Tokenizer: no bound
        return None
    model, pres = spec.get("model") or {}, _pre_tokenizers(spec.get("pre_tokenizer"))
    shrink = _shrink(spec.get("normalizer"))
    if (shrink is None or spec.get("truncation") is not None
            or model.get("type") != "BPE" or not vocab
            or any(p.get("type") not in _KEEPING or p.get("behavior") == "Removed"
                   for p in pres)
            or any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", ()))):
        return None
    dropped: str | None = ""
    if any(p.get("type") == "ByteLevel" for p in pres):
        dropped = _byte_level_gaps(vocab)
    elif not model.get("byte_fallback") and (model.get("unk_token") is None
                                             or model.get("fuse_unk")):
        dropped = None   # unknown characters vanish, or many become one token
    if dropped is None or (dropped and spec.get("normalizer") is not None):
        return None   # a normalizer could make a dropped character of another
    return TokenBound(max(len(t) for t in vocab) * shrink, dropped)


class ServedDecoder(Protocol):
    """What the server needs of a decoder (an ``OrtDecoder`` from
    ``from_pretrained``): its tokenizer, its request limits and its rule."""

    text: Any
    limits: RequestLimits
    eos_token_ids: Any
    io: Any
    cache: Any

    @property
    def context_length(self) -> int: ...

    def check_request(self, num_prompt_tokens: int, max_new_tokens: int) -> None: ...


class PromptBuilder:
    """Prompt ids, token budgets and text streams for one decoder.

    Parameters
    ----------
    decoder : OrtDecoder
        With a ``text`` codec (as ``OrtDecoder.from_pretrained`` loads it).
    fim : (int, int, int), optional
        The fill-in-the-middle token ids (a GGUF file's); default: those
        the vocabulary names (:func:`~pagedkv_np.serve.infill.fim_token_ids`).

    Attributes
    ----------
    context_length : int
    eos_token_ids : frozenset of int
    bound : TokenBound or None
        Texts with more tokens than the context by this bound are refused
        untokenized (None: no bound is provable for this tokenizer).
    """

    def __init__(self, decoder: ServedDecoder,
                 fim: tuple[int, int, int] | None = None) -> None:
        codec = getattr(decoder, "text", None)
        if codec is None:
            raise ConfigError("Invalid decoder: it has no tokenizer (text); load it with "
                              "OrtDecoder.from_pretrained")
        self.codec = codec
        self.decoder = decoder
        # the most tokens one request holds: the model's positions and the pool's
        self.context_length = min(decoder.limits.context_length, decoder.limits.pool_tokens)
        self.eos_token_ids = frozenset(getattr(decoder, "eos_token_ids", ()) or ())
        vocab = getattr(decoder.io, "vocab_size", None)
        self.vocab_size = int(vocab) if vocab is not None else int(codec.vocab_size)
        self.bound = token_bound(getattr(codec, "tokenizer", None))
        # fill-in-the-middle tokens (completions' suffix), None without them
        self.fim = fim if fim is not None else fim_token_ids(codec)

    def bind_tools(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its tools in the served chat template's call format
        (:func:`~pagedkv_np.serve.tool_calls.detect_format`).

        A template that does not read ``tools`` cannot tell the model about
        them: such a request is a 400 naming ``tools``, unless its
        ``tool_choice`` is ``"none"`` (then its tools are dropped).

        Raises
        ------
        APIError
            The template does not use tools, or cannot be read.
        """
        if req.tools is None:
            return req
        try:
            uses = "tools" in self.codec.template_variables()
            fmt = detect_format(self.codec.template_source())
        except PagedKVError as exc:
            raise APIError(str(exc), param="messages", code="invalid_prompt") from None
        if not uses:
            if req.tools.choice == "none":
                return replace(req, tools=None)
            raise APIError("Invalid value for 'tools': this model's chat template does not "
                           "use tools, so the model cannot be told about them (send no tools, "
                           "or tool_choice 'none')", param="tools",
                           code="unsupported_parameter")
        return replace(req, tools=replace(req.tools, format=fmt))

    def chat_text(self, req: GenerationRequest, add_generation_prompt: bool = True) -> str:
        """A chat request's messages (and tools) through the chat template.

        Raises
        ------
        PagedKVError
            The template refused the messages.
        """
        tools = {} if req.tools is None else {"tools": list(req.tools.tools)}
        return self.codec.apply_chat_template(list(req.messages or ()),
                                              add_generation_prompt=add_generation_prompt,
                                              **tools)

    def prompt_ids(self, req: GenerationRequest) -> np.ndarray:
        """The prompt's token ids, shape [n], int64 (n >= 1).

        Raises
        ------
        APIError
            The chat template refused the messages, the prompt is empty,
            holds a token id outside the vocabulary, or has too many
            characters to fit the context.
        """
        try:
            if req.messages is not None:
                # encode_chat, with the length check between its two steps
                text = self.chat_text(req)
                self._check_length(req, text)
                ids = self.codec.encode(text, add_special_tokens=False)
            elif req.suffix is not None:
                ids = self._infill(req)
            elif isinstance(req.prompt, str):
                self._check_length(req, req.prompt)
                ids = self.codec.encode(req.prompt)
            else:
                ids = np.asarray(req.prompt, dtype=np.int64)
        except APIError:
            raise
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

    def _infill(self, req: GenerationRequest) -> np.ndarray:
        """The fill-in-the-middle prompt of a completion with a ``suffix``."""
        if self.fim is None:
            raise APIError("'suffix' is not supported by this model: its vocabulary has no "
                           "fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, "
                           "<fim_middle>)", param="suffix", code="unsupported_parameter")
        suffix = str(req.suffix)
        if isinstance(req.prompt, str):
            self._check_length(req, req.prompt + suffix)
            prefix = self.codec.encode(req.prompt, add_special_tokens=False)
        else:
            self._check_length(req, suffix)
            prefix = req.prompt or ()
        return infill_ids(self.codec, self.fim, prefix, suffix)

    def _check_length(self, req: GenerationRequest, text: str) -> None:
        """A 400 for a text that has more tokens than the context, by the bound."""
        if self.bound is None or len(text) <= self.bound.max_chars_per_token * self.context_length:
            return
        num_tokens = self.bound.min_tokens(text)
        if num_tokens <= self.context_length:
            return
        raise APIError(
            f"This model's maximum context length is {self.context_length} tokens; the "
            f"prompt has {len(text):,} characters, at least {num_tokens:,} tokens (no token "
            f"stands for more than {self.bound.max_chars_per_token}). Shorten the prompt.",
            param="messages" if req.messages is not None else "prompt",
            code="context_length_exceeded")

    def max_tokens(self, req: GenerationRequest, num_prompt_tokens: int) -> int:
        """The request's token budget: ``max_tokens``, or what the context
        leaves (``decoder.limits.room``).

        Raises
        ------
        APIError
            The prompt and ``max_tokens`` do not fit (``decoder.check_request``).
        """
        room = self.decoder.limits.room(num_prompt_tokens)
        wanted = req.max_tokens if req.max_tokens is not None else max(room, 1)
        try:
            self.decoder.check_request(num_prompt_tokens, wanted)
        except ContextLengthExceeded as exc:
            asked = "" if req.max_tokens is None else f" + {req.max_tokens} max_tokens"
            raise APIError(
                f"This model's maximum context length is {exc.context_length} tokens; the "
                f"request asks for {num_prompt_tokens} prompt tokens{asked} (the last "
                "generated token takes no position). Shorten the prompt or lower max_tokens.",
                param="messages" if req.messages is not None else "prompt",
                code="context_length_exceeded") from None
        return wanted

    def check_options(self, req: GenerationRequest, max_tokens: int) -> None:
        """Check the request's engine options against the model: token ids of
        ``logit_bias`` and ``stop_token_ids`` in the vocabulary, ``min_tokens``
        within the token budget.

        Raises
        ------
        APIError
            400 naming the field.
        """
        for name in ("logit_bias", "stop_token_ids"):
            ids = req.options.get(name)
            if ids and max(ids) >= self.vocab_size:
                raise APIError(f"Invalid value for '{name}': token id {max(ids)} is outside "
                               f"the vocabulary [0, {self.vocab_size})", param=name,
                               code="invalid_value")
        min_tokens = req.options.get("min_tokens", 0)
        if min_tokens > max_tokens:
            raise APIError(f"Invalid value for 'min_tokens': {min_tokens} is more than the "
                           f"request's {max_tokens} max_tokens", param="min_tokens",
                           code="invalid_value")

    def text_stream(self, req: GenerationRequest) -> TextStream | EchoStream:
        """A fresh detokenizer with the request's stop strings (with ``echo``,
        the prompt's text goes first)."""
        stream = TextStream(self.codec, stop=list(req.stop) or None,
                            eos_token_ids=self.eos_token_ids)
        if not req.echo:
            return stream
        prompt = (req.prompt if isinstance(req.prompt, str)
                  else self.codec.decode(list(req.prompt or ())))
        return EchoStream(stream, prompt)


class EchoStream:
    """A :class:`TextStream` whose first text is ``prefix`` (completions'
    ``echo``: the prompt before the completion); stop strings are looked for
    in the completion only, and ``text`` is the completion's text."""

    def __init__(self, stream: TextStream, prefix: str) -> None:
        self.stream = stream
        self.detokenizer = stream.detokenizer
        self._prefix = prefix

    @property
    def stopped(self) -> bool:
        return self.stream.stopped

    @property
    def text(self) -> str:
        return self.stream.text

    def _first(self, text: str) -> str:
        out, self._prefix = self._prefix + text, ""
        return out

    def push(self, token_ids: list[int]) -> str:
        return self._first(self.stream.push(token_ids))

    def finish(self) -> str:
        return self._first(self.stream.finish())
