"""Backend data moves: write, gather and copy_pages, per backend, dtype,
layout and size.

Each class times one operation (``time_*``) and tracks its bandwidth in GB/s
(bytes read plus bytes written) and its ratio to a plain copy of the same
bytes measured in the same process. Index checks are off
(``check_indices=False``), as in the cache, which checks its plans once per
step. Pages are handed out in a shuffled order, as after a while of serving.
"""

import numpy as np

from pagedkv_np import KVStore

from . import (BACKENDS, DTYPES, HEAD_DIM, NUM_KV_HEADS, PAGE_SIZE, MoveCase, bandwidth, sizes,
               with_sync)


def _store(backend, dtype, num_layers, num_pages, layout):
    store = KVStore(num_layers, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, num_pages=num_pages,
                    dtype=dtype, layout=layout, backend=backend)
    # Touch every page: untouched zero pages read faster than real data.
    store.k[...] = 1
    store.v[...] = 2
    return store


def _shuffled_pages(num_pages, seed=0):
    return np.random.default_rng(seed).permutation(num_pages).astype(np.int32)


class _Move(MoveCase):
    """A move of the backend interface, with its bandwidth tracked too."""

    def track_gbps(self, *params):
        return bandwidth(self.run, self.nbytes, self.backend)[0]

    track_gbps.unit = "GB/s"


def _gather_case(backend, dtype, store_layout, out_layout, size):
    num_seqs, seq_len = map(int, size.split("x"))
    pages_per_seq = -(-seq_len // PAGE_SIZE)
    store = _store(backend, dtype, 1, num_seqs * pages_per_seq, store_layout)
    page_table = _shuffled_pages(num_seqs * pages_per_seq).reshape(num_seqs, pages_per_seq)
    seq_lens = np.full(num_seqs, seq_len, dtype=np.int32)
    shape = ((num_seqs, NUM_KV_HEADS, seq_len, HEAD_DIM) if out_layout == "BHTD"
             else (num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM))
    out = (backend.zeros(shape, store.dtype), backend.zeros(shape, store.dtype))

    def run():
        backend.gather(store.k, store.v, 0, page_table, seq_lens, layout=store_layout,
                       out_layout=out_layout, out=out, check_indices=False)

    return with_sync(backend, run), 2 * (out[0].nbytes + out[1].nbytes), backend


class Gather(_Move):
    """One layer of ``num_seqs`` sequences x ``seq_len`` tokens, NHD store,
    into preallocated BHTD or BTHD buffers."""

    params = [BACKENDS, DTYPES, ["BHTD", "BTHD"], sizes(["4x256", "32x512"])]
    param_names = ["backend", "dtype", "layout", "size"]

    @staticmethod
    def build(backend, dtype, layout, size):
        return _gather_case(backend, dtype, "NHD", layout, size)

    def time_gather(self, *params):
        self.run()


class GatherHND(_Move):
    """:class:`Gather` from an HND store into BHTD buffers, the pairing that
    ``OrtDecoder`` uses (each head's positions lie together on both sides)."""

    params = [BACKENDS, DTYPES, sizes(["4x256", "32x512"])]
    param_names = ["backend", "dtype", "size"]

    @staticmethod
    def build(backend, dtype, size):
        return _gather_case(backend, dtype, "HND", "BHTD", size)

    def time_gather(self, *params):
        self.run()


class Write(_Move):
    """Write one layer's new K/V: ``decode`` is 32 sequences x 1 token (a
    call is mostly overhead), ``prefill`` one sequence of 2048 tokens."""

    params = [BACKENDS, DTYPES, ["NHD", "HND"], sizes(["decode", "prefill"])]
    param_names = ["backend", "dtype", "layout", "size"]

    @staticmethod
    def build(backend, dtype, layout, size):
        num_pages = 256
        store = _store(backend, dtype, 1, num_pages, layout)
        pages = _shuffled_pages(num_pages)
        if size == "decode":  # the 6th token of 32 sequences' last pages
            slots = pages[:32] * PAGE_SIZE + 5
        else:
            pos = np.arange(2048)
            slots = pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        slot_mapping = slots.astype(np.int32)
        shape = (len(slot_mapping), NUM_KV_HEADS, HEAD_DIM)
        rng = np.random.default_rng(0)
        k = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(store.dtype))
        v = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(store.dtype))

        def run():
            backend.write(store.k, store.v, 0, slot_mapping, k, v, layout=layout,
                          check_indices=False)

        return with_sync(backend, run), 2 * (k.nbytes + v.nbytes), backend

    def time_write(self, *params):
        self.run()


class CopyPages(_Move):
    """Copy-on-write of ``num_pairs`` whole pages, 2 layers, K and V."""

    params = [BACKENDS, DTYPES, ["NHD", "HND"], sizes([16, 256])]
    param_names = ["backend", "dtype", "layout", "num_pairs"]

    @staticmethod
    def build(backend, dtype, layout, num_pairs):
        store = _store(backend, dtype, 2, 2 * num_pairs, layout)
        pages = _shuffled_pages(2 * num_pairs)
        src, dst = pages[:num_pairs].copy(), pages[num_pairs:].copy()

        def run():
            backend.copy_pages(store.k, store.v, src, dst, layout=layout, check_indices=False)

        # Half the store is read and the other half written.
        return with_sync(backend, run), store.nbytes, backend

    def time_copy_pages(self, *params):
        self.run()
