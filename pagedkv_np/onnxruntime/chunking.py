"""Chunked prefill: how many prompt tokens a step feeds, and the prompt being fed.

A step of :class:`~pagedkv_np.onnxruntime.OrtDecoder` decodes a token for
every running request, then feeds prompt tokens. A long prompt fed whole
stalls the running requests for its whole prefill; fed in chunks, one chunk
a step, they wait one chunk between two tokens. On a small CPU a chunk's
model call costs about a decode step before its first token (the weights
are read once per call) and then its tokens, so with ``N`` prompt tokens in
chunks of ``n``::

    gap between two tokens of a running request ~ 2 t_decode + n t_token
    the prompt's time to its first token        ~ N / n * (2 t_decode + n t_token)

Small chunks keep the running requests going, large ones the prompt's own
wait short; neither gets both. Measured over HTTP (``pagedkv serve``,
SmolLM2-135M Q4_1, 2 cores of an Intel Xeon with AMX, 2026-12-04,
``scripts/bench_llamacpp.py``'s inter-token gap workload: a 4,500-token
prompt arriving while 4 streams decode at an 18-21 ms median gap; medians
of 2 interleaved rounds beside the prompt alone, whose first token came
after 8.4-8.7 s)::

    chunk        streams' gap while it is fed     prompt TTFT
                 p50       p99 (p99 / p50)
    16 tokens     86 ms    122 ms (1.4x)          22.5 s (+160%)
    32 tokens    114 ms    165 ms (1.5x)          14.8 s (+70%)
    64 tokens    165 ms    366 ms (2.2x)          10.5 s (+23%)
    128 tokens   266 ms    450 ms (1.7x)           8.9 s (+5%)   (the default)

``prefill_chunk`` (default :data:`DEFAULT_PREFILL_CHUNK`) sets ``n``: 128
keeps the prompt's first token within 15% of when it is fed alone, while
the streams go on at about 4 tokens a second instead of stopping for the
whole prefill (llama-server's streams waited 4.0 s at the median in the
same workload, 8.0 s at p99). Smaller chunks shorten the pauses but never
to 3x the streams' own cadence (16 tokens: 5.8x at p99), and the prompt
pays 23-160%: a call's first cost (the weights read once, onnxruntime's
own) does not shrink with the chunk. On a slower 2-core VM earlier (24 ms
cadence, 18.9 s alone) 128 gave 527 / 824 ms and -10%, 64 332 / 540 ms
and +15%. A chunk sized from measured step times (to take two decode
steps) did worse on both counts (6.8x, 122 s): the times it steered by
were noisy.

With no request decoding, nothing stalls: a step feeds
:data:`SOLO_PREFILL_CHUNK` tokens, which bounds the activations a long
prompt needs without slowing it down.

A chunk never has ``n % 128 == 1`` rows (:func:`chunk_rows`), the one thing
that changes a prompt's K/V bits with the chunking: onnxruntime 1.32's 4-bit
``MatMulNBits`` computes the lone last row of a 128-row tile (a 1-token
chunk above all) on its single-row path, which differs from the rows of a
batch in the last bits; every other chunking of a prompt gives the same K/V,
bit for bit (SmolLM2, a 45-token prompt in chunks of 5, 8, 9, 16 and whole;
chunks of 44 and 1 differ at the last position). Without the rule the
chunking followed the scheduling (a step's budget left over by one prompt
starts the next), and int8 decode steps turn last-bit differences into
other tokens (1 of 4 chats of ``tests/test_determinism.py``, fed in 8- and
16-token chunks beside decoding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import check_positive_int
from .requests import Request

__all__ = ["ChunkBudget", "Prefill", "DEFAULT_PREFILL_CHUNK", "SOLO_PREFILL_CHUNK",
           "TILE_ROWS", "chunk_rows"]

#: Prompt tokens a step feeds while requests decode (``prefill_chunk``).
DEFAULT_PREFILL_CHUNK = 128

#: Prompt tokens a step feeds with no request decoding: a 4,818-token prompt
#: in chunks of 512 took 87.5 s against 100.9 s in one call (and 88.9 s in
#: chunks of 256) on a loaded machine, and bounds its activations.
SOLO_PREFILL_CHUNK = 512


#: rows of onnxruntime's MatMulNBits tiles: a chunk of ``n % TILE_ROWS == 1`` rows
#: has a lone last row, computed on the single-row path
TILE_ROWS = 128


def chunk_rows(budget: int, remaining: int, first: bool) -> int:
    """How many of a prompt's ``remaining`` tokens to feed now, with ``budget``
    left in this step: the most, up to ``budget``, that leave neither this
    chunk nor the rest with ``n % TILE_ROWS == 1`` rows (a prompt of one
    token excepted); 0 to wait for the next step. ``first``: nothing was fed
    in this step yet, so a chunk a token or two over ``budget`` is taken
    rather than none (a budget of 1 still moves)."""
    if remaining <= 1:                  # a budget is at least 1
        return remaining

    def fits(n: int) -> bool:
        return n % TILE_ROWS != 1 and (remaining - n) % TILE_ROWS != 1

    for n in range(min(budget, remaining), 0, -1):
        if fits(n):
            return n
    if not first:
        return 0
    return next(n for n in range(min(budget, remaining) + 1, remaining + 1) if fits(n))


class ChunkBudget:
    """Prompt tokens a step may feed (see the module docstring).

    Parameters
    ----------
    prefill_chunk : int, optional
        Tokens a step feeds while requests decode (default
        :data:`DEFAULT_PREFILL_CHUNK`).

    Raises
    ------
    DTypeError, ConfigError
        ``prefill_chunk`` is not a positive integer or None.
    """

    def __init__(self, prefill_chunk: Any = None) -> None:
        self.chunk = (DEFAULT_PREFILL_CHUNK if prefill_chunk is None
                      else check_positive_int(prefill_chunk, "prefill_chunk"))

    def tokens(self, decoding: bool) -> int:
        """This step's budget; ``decoding``: whether requests decode beside it."""
        return self.chunk if decoding else max(SOLO_PREFILL_CHUNK, self.chunk)


class Prefill:
    """A request whose prompt is being fed, chunk by chunk: ``seq`` holds its
    first ``num_done`` tokens (``num_cached`` of them from the prefix
    cache); the runner holds the K/V to continue from, and that of the
    chunks fed since ``num_written`` (the pages get it when the prompt ends
    or is given up)."""

    __slots__ = ("req", "seq", "tokens", "num_cached", "num_done", "num_written")

    def __init__(self, req: Request, seq: Any, tokens: np.ndarray, num_cached: int) -> None:
        self.req, self.seq, self.tokens = req, seq, tokens
        self.num_cached = self.num_done = self.num_written = num_cached

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])
