"""Log-probabilities in OpenAI's two wire shapes.

The engine reports, per generated token, a ``TokenLogprob(token, logprob,
top)`` (:mod:`pagedkv_np.onnxruntime.requests`); this module turns a run of
them into what a client parses:

* chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
* completions (``logprobs: k``, the legacy shape): ``{"tokens",
  "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.

A token's text is its id decoded alone with special tokens kept; a token
that holds part of a UTF-8 character decodes to U+FFFD there, which is why
``bytes`` is given too (those are the UTF-8 bytes of that text, not the raw
piece of the character: the tokenizer does not expose the raw bytes).

:class:`HeldLogprobs` keeps a request's entries back until the text of their
tokens is returned, so that the logprobs of an answer cut by a stop string
cover the returned text and nothing past it.
"""

from __future__ import annotations

import functools
from typing import Any
from collections.abc import Sequence

__all__ = ["LogprobWriter", "HeldLogprobs"]


class LogprobWriter:
    """Formats one request's log-probabilities, chunk by chunk.

    ``text_offset`` (completions) counts characters of the token texts from
    the start of the completion, across every chunk this writer formats.

    Parameters
    ----------
    codec : TextCodec
        The served model's tokenizer (``decode``).
    kind : str
        ``"chat"`` or ``"completion"``.
    """

    def __init__(self, codec: Any, kind: str) -> None:
        self.kind = kind
        self._decode = functools.lru_cache(maxsize=4096)(
            lambda token_id: codec.decode([token_id], skip_special_tokens=False))
        self.offset = 0

    def token_text(self, token_id: int) -> str:
        return str(self._decode(int(token_id)))

    def format(self, entries: Sequence[Any]) -> dict:
        """The ``logprobs`` object of a choice (or chunk) for ``entries``, a
        list of ``TokenLogprob``."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, offsets = [], []
        for e in entries:
            text = self.token_text(e.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [float(e.logprob) for e in entries],
                "top_logprobs": [{self.token_text(t): float(lp) for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, entry: Any) -> dict:
        item = self._item(entry.token, entry.logprob)
        item["top_logprobs"] = [self._item(t, lp) for t, lp in entry.top]
        return item

    def _item(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    @staticmethod
    def join(parts: list[dict]) -> dict | None:
        """One ``logprobs`` object from the objects of consecutive chunks (None
        for none)."""
        if not parts:
            return None
        out: dict = {key: [] for key in parts[0]}
        for part in parts:
            for key, values in part.items():
                out[key].extend(values)
        return out


class HeldLogprobs:
    """A request's ``TokenLogprob`` entries, each released once its token's
    text is part of the returned text.

    Each entry is filed with ``start``: how many characters the detokenizer
    had produced before its token was pushed. Its token's text (if any)
    begins there, so the token belongs to the answer exactly when ``start``
    is less than the number of characters returned; a token whose text
    straddles a stop string is kept (its text holds the stop's first
    characters), tokens wholly inside or past the stop string are not.

    Invariant: the held entries are in token order, with non-decreasing
    ``start``.
    """

    def __init__(self) -> None:
        self._held: list[tuple[int, Any]] = []

    def add(self, entries: Sequence[Any], start: int) -> None:
        self._held.extend((start, e) for e in entries)

    def release(self, num_chars: int) -> tuple:
        """The held entries whose text begins within the first ``num_chars``
        characters (they are returned: no stop string can cut them now)."""
        cut = 0
        while cut < len(self._held) and self._held[cut][0] < num_chars:
            cut += 1
        out, self._held = self._held[:cut], self._held[cut:]
        return tuple(e for _, e in out)

    def rest(self) -> tuple:
        """Every held entry (the request ended without a stop string)."""
        out, self._held = self._held, []
        return tuple(e for _, e in out)
