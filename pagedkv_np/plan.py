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
    context_lens: np.ndarray = field(repr=False, default=None)
    """int32 [B]: tokens already in the cache before this step."""
    _owner: int = field(repr=False, default=0)
    _epoch: int = field(repr=False, default=0)
    _seqs: tuple = field(repr=False, default=())
    _versions: tuple = field(repr=False, default=())
    # per layer: written yet? The last byte flags a discarded plan.
    _written: bytearray = field(repr=False, default_factory=bytearray)

    def _mark_written(self, layer: int) -> bool:
        """Record a written layer; True exactly when the last one arrives."""
        if self._written[layer]:
            return False
        self._written[layer] = 1
        return self._written.count(1) == len(self._written) - 1

    def _discard(self) -> None:
        self._written[-1] = 2

    @property
    def is_written(self) -> bool:
        """Whether every layer has been written through this plan."""
        return len(self._written) > 1 and self._written.count(1) == len(self._written) - 1

    @property
    def is_discarded(self) -> bool:
        return bool(self._written) and self._written[-1] == 2

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


def build_plan(
    page_arrays: Sequence[np.ndarray],
    seq_lens: Sequence[int],
    context_lens: Sequence[int],
    page_size: int,
    seq_ids: Sequence[int],
    owner: int = 0,
    epoch: int = 0,
    seqs: tuple = (),
    versions: tuple = (),
    num_layers: int = 0,
) -> Plan:
    """Build a :class:`Plan` from each sequence's pages and lengths.

    ``page_arrays[b]`` (int32 arrays or lists of ids) must cover ``seq_lens[b]`` tokens and
    ``context_lens[b] <= seq_lens[b]``; the caller guarantees both.
    """
    num_seqs = len(page_arrays)
    max_pages = max((len(p) for p in page_arrays), default=0)
    page_table = np.full((num_seqs, max_pages), -1, dtype=np.int32)
    for b, pages in enumerate(page_arrays):
        page_table[b, :len(pages)] = pages
    lens = np.array(seq_lens, dtype=np.int32).reshape(num_seqs)
    ctx = np.array(context_lens, dtype=np.int32).reshape(num_seqs)
    new = lens - ctx
    qsl = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(new, out=qsl[1:])
    # position of each new token: its sequence's context length plus its rank
    rows = np.repeat(np.arange(num_seqs), new)
    pos = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(ctx - qsl[:-1], new)
    slots = page_table[rows, pos // page_size].astype(np.int64) * page_size + pos % page_size
    return Plan(_readonly(page_table), _readonly(lens), _readonly(slots.astype(np.int32)),
                _readonly(qsl), tuple(seq_ids), _readonly(ctx), owner, epoch, seqs, versions,
                bytearray(num_layers + 1))
