"""Chunked prefill: how many prompt tokens a step feeds, and the prompt being fed.

A step of :class:`~pagedkv_np.onnxruntime.OrtDecoder` decodes a token for
every running request, then feeds prompt tokens. A long prompt fed whole
stalls the running requests for its whole prefill; fed in chunks, one chunk
a step, they wait one chunk between two tokens. On a small CPU a chunk's
model call costs about what a decode step does (the weights are read once
per call) plus its tokens, so with ``N`` prompt tokens in chunks of ``n``::

    gap between two tokens of a running request = t_decode + t_chunk(n)
    the prompt's time to its first token        = N / n * (t_decode + t_chunk(n))

One cannot have both a short gap and the prompt's wait of a lone prefill:
each step's decode comes on top of the prefill's own time. The policy:

``prefill_chunk=None`` (the default)
    each chunk is sized from what the last steps took, so that it takes
    about :data:`STALL_TARGET` decode steps: a running request's gaps stay
    near ``1 + STALL_TARGET`` times its decode step, whatever the load of
    the machine and the size of the batch (a fixed size that suits 4
    running requests on a quiet machine is too large beside one request,
    or on a busy machine, where a decode step and a chunk slow down
    differently). Where a chunk's boundaries fall then varies from run to
    run; the tokens do not (each chunk continues the previous one's K/V).
an int
    that many prompt tokens a step, always (reproducible chunk boundaries).

With no request decoding, nothing stalls: a step feeds
:data:`SOLO_PREFILL_CHUNK` tokens, which bounds the activations a long
prompt needs without slowing it down. Measured with
``scripts/bench_prefill.py`` (README "Long prompts").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import check_positive_int
from .requests import Request

__all__ = ["ChunkBudget", "Prefill", "STALL_TARGET", "SOLO_PREFILL_CHUNK", "MIN_PREFILL_CHUNK"]

#: The time a step's chunk may take while requests decode, in decode steps.
STALL_TARGET = 2.0

#: Prompt tokens a step feeds with no request decoding: chunks of 512 were as
#: fast as one call for the whole prompt, and bound its activations.
SOLO_PREFILL_CHUNK = 512

#: The smallest adaptive chunk: smaller ones cost a model call each for little.
MIN_PREFILL_CHUNK = 8

# weight of the newest figure in the running averages of step times
_SMOOTHING = 0.5


class ChunkBudget:
    """Prompt tokens a step may feed (see the module docstring).

    Parameters
    ----------
    prefill_chunk : int, optional
        Tokens a step feeds while requests decode; None sizes chunks to
        :data:`STALL_TARGET` decode steps.

    Raises
    ------
    DTypeError, ConfigError
        ``prefill_chunk`` is not a positive integer or None.
    """

    def __init__(self, prefill_chunk: Any = None) -> None:
        self.fixed = None if prefill_chunk is None else check_positive_int(prefill_chunk,
                                                                           "prefill_chunk")
        self.decode_seconds: float | None = None      # a decode step, smoothed
        self.token_seconds: float | None = None       # a prompt token of a chunk, smoothed

    def tokens(self, decoding: bool) -> int:
        """This step's budget; ``decoding``: whether requests decode beside it."""
        if not decoding:
            return max(SOLO_PREFILL_CHUNK, self.fixed or 0)
        if self.fixed is not None:
            return self.fixed
        if self.decode_seconds is None or self.token_seconds is None:
            return MIN_PREFILL_CHUNK
        n = int(STALL_TARGET * self.decode_seconds / self.token_seconds)
        return min(max(n, MIN_PREFILL_CHUNK), SOLO_PREFILL_CHUNK)

    def decoded(self, seconds: float) -> None:
        """A decode step of the running requests took ``seconds``."""
        self.decode_seconds = _smooth(self.decode_seconds, seconds)

    def fed(self, num_tokens: int, seconds: float, decoding: bool) -> None:
        """A chunk of ``num_tokens`` took ``seconds`` (only chunks fed beside
        decode steps count: a solo chunk's tokens cost less each)."""
        if decoding and num_tokens:
            self.token_seconds = _smooth(self.token_seconds, seconds / num_tokens)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)


class Prefill:
    """A request whose prompt is being fed, chunk by chunk: ``seq`` holds its
    first ``num_done`` tokens (``num_cached`` of them from the prefix
    cache); the runner holds the K/V to continue from."""

    __slots__ = ("req", "seq", "tokens", "num_cached", "num_done")

    def __init__(self, req: Request, seq: Any, tokens: np.ndarray, num_cached: int) -> None:
        self.req, self.seq, self.tokens = req, seq, tokens
        self.num_cached = self.num_done = num_cached

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])
