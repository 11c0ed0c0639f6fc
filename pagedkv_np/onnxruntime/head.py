"""The LM head that a GGUF import left beside the graph, run by the engine.

A graph whose metadata names a head file (:mod:`pagedkv_np.models.head_file`)
outputs ``hidden`` states, not logits; :class:`BlockHead` turns the rows the
engine needs (the last position of a prompt, one row per sequence in a
decode step) into logits with
:func:`~pagedkv_np.backends.block_gemv.block_matmul`, straight from the
file's blocks: exact float32 activations, a fixed summation order per logit
(so a row's logits do not depend on its batch), and a quarter of a float32
head's bytes read per token for Q8_0.

The head runs after onnxruntime's run returns, when its threads are idle,
so it takes the same number of Numba threads (``threads``), set in the
calling thread for the call and restored after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy as np

from ..backends.block_gemv import BlockWeight, block_matmul
from ..backends.block_q8 import q8_matmul
from ..backends.block_q8_tiles import packs, q8_tiled_matmul, q8x2_tiled_matmul
from ..errors import ShapeError
from ..models.head_file import HEAD_FILE, read_head

__all__ = ["BlockHead", "folder_head"]


class BlockHead:
    """Logits from hidden states through a head in blocks.

    Parameters
    ----------
    path : str or path
        The head file (:func:`~pagedkv_np.models.head_file.read_head`).
    threads : int, optional
        Numba threads for a call (default: leave the caller's).
    int8 : bool
        Round the hidden states to int8 per block first
        (:func:`~pagedkv_np.backends.block_q8_tiles.q8_tiled_matmul` where the
        head packs in tiles, else :func:`~pagedkv_np.backends.block_q8.q8_matmul`):
        faster, not exact.
    int8x2 : bool
        With ``int8`` False, where the head packs in tiles: round each row to
        int8 twice, the row then what that left
        (:func:`~pagedkv_np.backends.block_q8_tiles.q8x2_tiled_matmul`): about
        int8's time, an error at most 1/254 of int8's (Gemma 3 270M's Q8_0
        head, 2 threads: 14.3 ms against 24.3 exact, 14.7 int8).

    Attributes
    ----------
    hidden_size, vocab_size : int
    softcap : float
        ``cap * tanh(logits / cap)`` after the product; 0: none.
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None,
                 int8: bool = False, int8x2: bool = False) -> None:
        parts, self.softcap = read_head(path)
        self.weight = BlockWeight.from_nbits(parts)
        self.hidden_size = self.weight.in_features
        self.vocab_size = self.weight.out_features
        self.threads = threads
        self.int8 = int8
        self._follow: Callable[[], int] | None = None
        tiled = packs(self.weight)
        self._product = (q8_tiled_matmul if tiled else q8_matmul) if int8 else \
            q8x2_tiled_matmul if int8x2 and tiled else block_matmul
        #: whether calls round to int8 twice (``int8x2`` where the head packs)
        self.int8x2 = not int8 and int8x2 and tiled

    def follow(self, threads: Callable[[], int]) -> None:
        """Run each call on ``threads()`` Numba threads instead of
        :attr:`threads`: the engine passes its decode step's latest count
        (:meth:`~pagedkv_np.onnxruntime.native.NativeDecode.threads_now`),
        1 while the machine is busy, so that the head does not wait on a
        thread that lost its core either."""
        self._follow = threads

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        count = self._follow() if self._follow is not None else self.threads
        if count is None:
            yield
            return
        import numba

        before = numba.get_num_threads()
        want = min(count, int(numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        numba.set_num_threads(want)
        try:
            yield
        finally:
            numba.set_num_threads(before)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """float32 ``[..., vocab_size]`` logits of ``hidden`` ``[..., hidden_size]``."""
        if hidden.ndim < 1 or hidden.shape[-1] != self.hidden_size:
            raise ShapeError(f"Invalid hidden states: expected [..., {self.hidden_size}], "
                             f"got {hidden.shape}")
        rows = np.ascontiguousarray(hidden.reshape(-1, self.hidden_size), dtype=np.float32)
        with self._threads():
            logits = self._product(rows, self.weight)
        if self.softcap:
            cap = np.float32(self.softcap)
            np.tanh(logits / cap, out=logits)
            logits *= cap
        return logits.reshape(hidden.shape[:-1] + (self.vocab_size,))

    def warmup(self) -> None:
        """Compile the kernel now (seconds the first time, then from Numba's
        cache), in its serial form too (one thread runs it)."""
        import numba

        self(np.zeros((1, self.hidden_size), np.float32))
        before = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            rows = np.zeros((1, self.hidden_size), np.float32)
            self._product(rows, self.weight)
        finally:
            numba.set_num_threads(before)


def folder_head(folder: str | os.PathLike, threads: int | None = None) -> BlockHead | None:
    """The head of a model folder whose graph leaves it to the engine (its
    ``lm_head.npz``), or None when the graph computes ``logits`` itself: for
    scripts that run a folder's graph without the engine."""
    path = os.path.join(os.fspath(folder), HEAD_FILE)
    return BlockHead(path, threads) if os.path.isfile(path) else None
