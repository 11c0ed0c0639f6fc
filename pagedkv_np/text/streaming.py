"""Streaming text: token ids to text deltas, and stop strings.

:class:`Detokenizer` turns token ids, fed as they are generated, into text
deltas whose concatenation is exactly the decode of all the ids at once.
A byte-level BPE token may hold part of a UTF-8 character, so text that ends
in U+FFFD (a character not yet complete) is held back, and each delta is
decoded with the tokens before it as context (a decoder may render a token
differently at the start of a text, e.g. SentencePiece's leading space).

:class:`StopMatcher` ends a text at a stop string; while streaming it holds
back a suffix that could be the start of one. :class:`TextStream` chains the
two for one request, and drops its end-of-sequence tokens.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

import numpy as np

from ..errors import ConfigError, DTypeError
from .codec import TextCodec

__all__ = ["Detokenizer", "StopMatcher", "TextStream", "truncate_at_stop"]


# Tokens held back before the decode window moves on regardless, and the
# tokens kept as context then: a UTF-8 character has at most 4 bytes, so it
# never spans more than 4 byte tokens.
_MAX_HELD = 16
_UTF8_TOKENS = 4


def _as_ids(token_ids: int | Iterable[int]) -> list[int]:
    if isinstance(token_ids, (int, np.integer)):
        return [int(token_ids)]
    return [int(t) for t in token_ids]


class Detokenizer:
    """Text deltas of token ids fed one or a few at a time.

    The deltas joined are ``codec.decode(all ids)`` once :meth:`finish` has
    been called. Text is emitted when decoding the window since the last
    emission gives more text than the window's context alone, does not end
    in U+FFFD and extends the context's text; the tokens emitted last are the
    next window's context.

    Parameters
    ----------
    codec : TextCodec
    skip_special_tokens : bool
    """

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""                 # every delta so far
        self._context_start = 0        # first token of the decode window
        self._emitted_end = 0          # tokens before this have been emitted

    def _window(self, stop: int | None = None) -> str:
        return self.codec.decode(self.token_ids[self._context_start:stop],
                                 self.skip_special_tokens)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated tokens; returns the text now safe to show (maybe "")."""
        self.token_ids.extend(_as_ids(token_ids))
        if self._emitted_end == len(self.token_ids):
            return ""
        context = self._window(self._emitted_end)
        window = self._window()
        if (len(window) <= len(context) or window.endswith("\ufffd")
                or not window.startswith(context)):
            if len(self.token_ids) - self._emitted_end > _MAX_HELD:
                return self._move_on(context, window)
            return ""
        delta = window[len(context):]
        self._context_start, self._emitted_end = self._emitted_end, len(self.token_ids)
        self.text += delta
        return delta

    def _move_on(self, context: str, window: str) -> str:
        """Emit what the held tokens before the last few decode to, and let
        the decode window start there: a run of tokens that decode to nothing
        or to incomplete characters is then decoded again a few tokens at a
        time, not whole at every push (it took 6.5-15 s for 4,000 such tokens)."""
        cut = len(self.token_ids) - _UTF8_TOKENS
        part = self._window(cut)
        if not (part.startswith(context) and window.startswith(part)):
            return ""
        delta = part[len(context):]
        self._context_start, self._emitted_end = cut - _UTF8_TOKENS, cut
        self.text += delta
        return delta

    def finish(self) -> str:
        """The text still held back, once no more tokens will come."""
        whole = self.codec.decode(self.token_ids, self.skip_special_tokens)
        # the deltas so far are a prefix of the whole decode (each extended
        # its context); what is left is the rest of it
        delta = whole[len(self.text):] if whole.startswith(self.text) else ""
        self._context_start = self._emitted_end = len(self.token_ids)
        self.text += delta
        return delta


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    try:
        items = list(items)
    except TypeError:
        raise DTypeError(f"Invalid stop: expected a string or strings, "
                         f"got {type(stop).__name__}") from None
    for s in items:
        if not isinstance(s, str):
            raise DTypeError(f"Invalid stop: expected strings, got {type(s).__name__}")
        if not s:
            raise ConfigError("Invalid stop: an empty stop string")
    return tuple(dict.fromkeys(items))


class StopMatcher:
    """Ends a text at the first stop string it holds.

    The stop that counts is the one completed first (the smallest end
    position, then the earliest start): the answer is then the same however
    the text arrives in pieces. The text before it is kept, the stop string
    and all after it dropped.

    Parameters
    ----------
    stop : str or iterable of str, optional
        Non-empty strings.
    """

    def __init__(self, stop: Any = None) -> None:
        self.stop = _stop_strings(stop)
        self.text = ""         # all text pushed, up to the stop once found
        self.stopped = False
        self._emitted = 0

    def find(self, text: str, start: int = 0) -> int | None:
        """Index in ``text`` of the first completed stop string, or None."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def push(self, delta: str) -> str:
        """Add text; returns what can be shown (text that cannot start a stop)."""
        if self.stopped:
            return ""
        self.text += delta
        # the emitted text holds no stop's start (those were held back), so
        # the search can begin where emission ended
        idx = self.find(self.text, self._emitted)
        if idx is not None:
            self.stopped = True
            self.text = self.text[:idx]
            end = idx
        else:
            end = len(self.text) - self._held(self.text[self._emitted:])
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def finish(self) -> str:
        """The held-back text, once the text has ended without a stop."""
        out = self.text[self._emitted:]
        self._emitted = len(self.text)
        return out


def truncate_at_stop(text: str, stop: Any) -> str:
    """``text`` up to (without) its first completed stop string."""
    idx = StopMatcher(stop).find(text)
    return text if idx is None else text[:idx]


class TextStream:
    """One request's tokens to text: detokenize, drop end tokens, end at stops.

    Parameters
    ----------
    codec : TextCodec
    stop : str or iterable of str, optional
    eos_token_ids : iterable of int
        Tokens that end the request; they add no text.
    skip_special_tokens : bool

    Attributes
    ----------
    text : str
        Every delta returned so far.
    stopped : bool
        A stop string was found: the request should be aborted.
    """

    def __init__(self, codec: TextCodec, *, stop: Any = None,
                 eos_token_ids: Iterable[int] = (), skip_special_tokens: bool = True) -> None:
        self.detokenizer = Detokenizer(codec, skip_special_tokens)
        self.matcher = StopMatcher(stop)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text = ""
        self.stopped = False

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated tokens; returns the new text to show (maybe "")."""
        kept = [t for t in _as_ids(token_ids) if t not in self.eos_token_ids]
        out = self.matcher.push(self.detokenizer.push(kept)) if kept else ""
        self.text += out
        self.stopped = self.matcher.stopped
        return out

    def finish(self) -> str:
        """The rest of the text once the request has ended."""
        out = self.matcher.push(self.detokenizer.finish())
        if not self.matcher.stopped:
            out += self.matcher.finish()
        self.text += out
        self.stopped = self.matcher.stopped
        return out
