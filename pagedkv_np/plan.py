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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Plan", "build_plan", "LOOP_MAX_TOKENS", "LIST_MAX_ENTRIES"]


@dataclass(frozen=True, eq=False)
class Plan:
    """Index arrays of one step (see the module docstring).

    A plan is data only: the cache that built it keeps what it needs to know
    about it (whether it is current, which layers were written) itself.
    """

    page_table: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_ids: tuple[int, ...]
    context_lens: np.ndarray = field(repr=False)
    """int32 [B]: tokens already in the cache before this step."""

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



def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


#: Up to this many new tokens, slots are computed in a Python loop; above it,
#: with array operations. A decode step's plan is built every step, and its
#: few slots cost less one by one than the dozen small array calls would.
LOOP_MAX_TOKENS = 128

#: Page tables of up to this many entries are filled from one flat list; larger
#: ones row by row from ``page_arrays`` when given.
LIST_MAX_ENTRIES = 2048


def build_plan(
    page_ids: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    context_lens: Sequence[int],
    page_size: int,
    seq_ids: Sequence[int],
    page_arrays: Sequence[np.ndarray] | None = None,
) -> Plan:
    """Build a :class:`Plan` from each sequence's pages and lengths.

    ``page_ids[b]`` (a list of ids, or an int array) must cover
    ``seq_lens[b]`` tokens and ``context_lens[b] <= seq_lens[b]``; the caller
    guarantees both. ``page_arrays``, the same ids as int32 arrays, fills a
    large page table faster when given.
    """
    num_seqs = len(page_ids)
    max_pages = max(map(len, page_ids), default=0)
    if page_arrays is None or num_seqs * max_pages <= LIST_MAX_ENTRIES:
        flat: list = []
        for pages in page_ids:
            flat.extend(pages)
            flat.extend([-1] * (max_pages - len(pages)))
        page_table = np.array(flat, dtype=np.int32).reshape(num_seqs, max_pages)
    else:
        page_table = np.full((num_seqs, max_pages), -1, dtype=np.int32)
        for b, page_array in enumerate(page_arrays):
            page_table[b, :len(page_array)] = page_array
    lens = np.array(seq_lens, dtype=np.int32).reshape(num_seqs)
    ctx = np.array(context_lens, dtype=np.int32).reshape(num_seqs)
    if sum(seq_lens) - sum(context_lens) <= LOOP_MAX_TOKENS:
        slots = np.array([pages[pos // page_size] * page_size + pos % page_size
                          for pages, first, end in zip(page_ids, context_lens, seq_lens)
                          for pos in range(first, end)], dtype=np.int32)
        qsl = np.array(list(itertools.accumulate(
            (end - first for first, end in zip(context_lens, seq_lens)), initial=0)),
            dtype=np.int32)
    else:
        new = lens - ctx
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(new, out=qsl[1:])
        # position of each new token: its sequence's context length plus its rank
        row_of = np.repeat(np.arange(num_seqs), new)
        pos = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(ctx - qsl[:-1], new)
        slots = (page_table[row_of, pos // page_size].astype(np.int64) * page_size
                 + pos % page_size).astype(np.int32)
    return Plan(_readonly(page_table), _readonly(lens), _readonly(slots), _readonly(qsl),
                tuple(seq_ids), _readonly(ctx))
