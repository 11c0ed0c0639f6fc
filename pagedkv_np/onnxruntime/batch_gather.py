"""The past K/V of a decode batch's rows, gathered into the runner's buffers.

:func:`batch_gather` is the ``gather`` callback the batcher hands the runner
when a batch starts (:meth:`~pagedkv_np.onnxruntime.runners.Runner.start_batch`):
each row from the pages alone, below its own length, or one row from the
runner's kept prompt (see :mod:`pagedkv_np.onnxruntime.batching`).
"""

from __future__ import annotations

import numpy as np

from ..cache import PagedKVCache
from .runners import Gather, Runner

__all__ = ["batch_gather"]


def batch_gather(cache: PagedKVCache, seqs: list, lens: list[int], runner: Runner,
                  prompt_row: int | None = None) -> Gather:
    """The runner's ``gather`` of a decode batch's cached past (no new tokens).

    Into given buffers, each sequence is gathered alone and copied below its
    length, so the positions between its length and the longest's are not
    written: the runner's buffers are fresh mappings (zero until written,
    :func:`~pagedkv_np.memory.lazy_zeros`), whose unwritten pages stay out of
    memory. A gather of the whole batch would write zeros there, and a long
    prompt joining short streams would make every row as long as its own
    (SmolLM2, 4 streams and a 4,500-token prompt: 1.1 GB of zeros).

    Row ``prompt_row`` is the runner's kept prompt instead (not in the
    pages): copied from its buffers, each layer of them handed back once
    copied.
    """
    plans = {b: cache.plan([s]) for b, s in enumerate(seqs) if b != prompt_row}
    rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # a buffer per sequence, reused
    whole: list = []

    def gather(layer: int, out: tuple[np.ndarray, np.ndarray] | None
               ) -> tuple[np.ndarray, np.ndarray]:
        if out is None:        # buffers of the gather's own (OptimumRunner: no prompt row)
            if not whole:
                whole.append(cache.plan(seqs))
            return cache.gather(layer, whole[0], "BHTD", host=True)
        for b, n in enumerate(lens):
            if b == prompt_row:
                k, v = runner.prompt_kv(layer, 0, n)
                out[0][b, :, :n] = k.transpose(1, 0, 2)
                out[1][b, :, :n] = v.transpose(1, 0, 2)
                runner.drop_prompt_layer(layer)
            elif len(seqs) == 1:
                cache.gather(layer, plans[b], "BHTD", out=out, host=True)
            elif n:
                if b not in rows:
                    shape = (1, out[0].shape[1], n, out[0].shape[3])
                    rows[b] = (np.empty(shape, out[0].dtype), np.empty(shape, out[1].dtype))
                k, v = cache.gather(layer, plans[b], "BHTD", out=rows[b], host=True)
                out[0][b, :, :n] = k[0]
                out[1][b, :, :n] = v[0]
        return out

    return gather
