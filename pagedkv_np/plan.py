"""Per-step index arrays, built once and reused for every layer.

For a batch of sequences, a :class:`Plan` holds::

    page_table       int32 [B, max_pages]  page ids of each sequence, -1 padded
    seq_lens         int32 [B]             tokens of each sequence after this step
    slot_mapping     int32 [N]             page_id * page_size + offset of each
                                           new token, sequences concatenated
    query_start_loc  int32 [B + 1]         sequence b's new tokens are
                                           slot_mapping[qsl[b]:qsl[b + 1]]

A sequence's tokens split into those already in the cache and the new ones
this step writes::

    position:  0 ............ context_len ........... seq_len
               |  in the cache  |  new (slot_mapping)   |

The arrays are read-only: a plan is checked once when it is built, and layers
reuse it without checking again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["Plan", "build_plan"]


@dataclass(frozen=True, eq=False)
class Plan:
    """Index arrays of one step (see the module docstring)."""

    page_table: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_ids: tuple[int, ...]
    _owner: int = field(repr=False, default=0)
    _epoch: int = field(repr=False, default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_new_tokens(self) -> int:
        """Total new tokens (rows of ``k``/``v`` that ``write`` takes)."""
        return int(self.slot_mapping.shape[0])

    @property
    def new_lens(self) -> np.ndarray:
        """int32 [B]: new tokens per sequence."""
        return np.diff(self.query_start_loc).astype(np.int32)

    @property
    def context_lens(self) -> np.ndarray:
        """int32 [B]: tokens already in the cache before this step."""
        return (self.seq_lens - self.new_lens).astype(np.int32)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def build_plan(
    page_lists: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    context_lens: Sequence[int],
    page_size: int,
    seq_ids: Sequence[int],
    owner: int = 0,
    epoch: int = 0,
) -> Plan:
    """Build a :class:`Plan` from each sequence's pages and lengths.

    ``page_lists[b]`` must cover ``seq_lens[b]`` tokens and
    ``context_lens[b] <= seq_lens[b]``; the caller guarantees both.
    """
    num_seqs = len(page_lists)
    max_pages = max((len(p) for p in page_lists), default=0)
    page_table = np.full((num_seqs, max_pages), -1, dtype=np.int32)
    lens = np.asarray(seq_lens, dtype=np.int32).reshape(num_seqs)
    ctx = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
    qsl = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(lens - ctx, out=qsl[1:])
    slots = np.empty(int(qsl[-1]), dtype=np.int32)
    for b, pages in enumerate(page_lists):
        if pages:
            page_table[b, :len(pages)] = pages
        lo, hi = int(ctx[b]), int(lens[b])
        if hi > lo:
            pos = np.arange(lo, hi, dtype=np.int64)
            slots[qsl[b]:qsl[b + 1]] = page_table[b, pos // page_size] * np.int64(page_size) + pos % page_size
    return Plan(_readonly(page_table), _readonly(lens), _readonly(slots), _readonly(qsl),
                tuple(seq_ids), owner, epoch)
