"""int8 stores: quantize on write, dequantize on gather, and tokens per GiB.

The one home of the int8 store's speed. The data moves time one layer of
``num_seqs`` sequences x ``seq_len`` tokens of 8 KV heads x 128 (pages of 16
in shuffled order), from and into float32 and float16, and track their
ratio to a plain copy of the float bytes the caller hands in (write) or
gets back (gather), measured in the same process: 1.0 is as fast as
copying the floats. ``TokensPerGiB`` tracks how many tokens a GiB of K/V
holds, scales included. For a table of one machine without saving
results: ``asv run --python=same --bench bench_quant``.

Sibling: ``scripts/quant_quality.py`` measures the format's error (by values
per scale on K with outlier channels, and NLL and greedy agreement on
SmolLM2), which decides the format and is no figure to track per commit.
"""

import numpy as np

from pagedkv_np import KVStore

from . import HEAD_DIM, NUM_KV_HEADS, PAGE_SIZE, MoveCase, sizes, with_sync

BACKENDS = ["numpy", "numba", "cupy"]
FLOAT_DTYPES = ["float32", "float16"]
SIZES = sizes(["4x2048", "32x2048"])


def _case(backend, size, layout):
    num_seqs, seq_len = map(int, size.split("x"))
    num_pages = num_seqs * (-(-seq_len // PAGE_SIZE))
    store = KVStore(1, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, num_pages=num_pages, dtype="int8",
                    layout=layout, backend=backend)
    pages = np.random.default_rng(0).permutation(num_pages).astype(np.int32)
    table = pages.reshape(num_seqs, -1)
    seq_lens = np.full(num_seqs, seq_len, np.int32)
    pos = np.arange(seq_len)
    slots = np.concatenate([table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                            for b in range(num_seqs)]).astype(np.int32)
    return store, table, seq_lens, slots


class _Quant(MoveCase):
    """``nbytes`` counts the float bytes twice: a copy of them reads them
    and writes them."""

    repeat = (5, 50, 5.0)
    # The NumPy reference takes seconds a call at 32x2048 (10-20 s on a
    # loaded 2-core machine): more than asv's 60 s for a warm-up, a call
    # and the copy comparison.
    timeout = 300


class WriteQuantized(_Quant):
    """Quantize every token of the batch (a prefill of all of it)."""

    params = [BACKENDS, FLOAT_DTYPES, ["NHD", "HND"], SIZES]
    param_names = ["backend", "dtype", "layout", "size"]

    @staticmethod
    def build(backend, dtype, layout, size):
        store, _, _, slots = _case(backend, size, layout)
        rng = np.random.default_rng(1)
        shape = (len(slots), NUM_KV_HEADS, HEAD_DIM)
        k = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        v = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        arrays = (store.k, store.v, store.k_scale, store.v_scale)

        def run():
            backend.write_quantized(*arrays, 0, slots, k, v, layout=layout, check_indices=False)

        return with_sync(backend, run), 2 * (k.nbytes + v.nbytes), backend

    def time_write(self, *params):
        self.run()


class GatherQuantized(_Quant):
    """Dequantize the batch into preallocated buffers: NHD into BTHD and HND
    into BHTD (layout-matched), and NHD into BHTD."""

    params = [BACKENDS, FLOAT_DTYPES, ["NHD-BTHD", "HND-BHTD", "NHD-BHTD"], SIZES]
    param_names = ["backend", "dtype", "layouts", "size"]

    @staticmethod
    def build(backend, dtype, layouts, size):
        layout, out_layout = layouts.split("-")
        store, table, seq_lens, _ = _case(backend, size, layout)
        num_seqs, seq_len = table.shape[0], int(seq_lens[0])
        shape = ((num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM) if out_layout == "BTHD"
                 else (num_seqs, NUM_KV_HEADS, seq_len, HEAD_DIM))
        out = (backend.zeros(shape, np.dtype(dtype)), backend.zeros(shape, np.dtype(dtype)))
        arrays = (store.k, store.v, store.k_scale, store.v_scale)

        def run():
            backend.gather_quantized(*arrays, 0, table, seq_lens, layout=layout,
                                     out_layout=out_layout, out=out, check_indices=False)

        return with_sync(backend, run), 2 * (out[0].nbytes + out[1].nbytes), backend

    def time_gather(self, *params):
        self.run()


class TokensPerGiB:
    """Tokens a GiB of K/V holds (page_size 16), for 8 KV heads x 128 over
    32 layers and SmolLM2-135M's 3 x 64 over 30 layers."""

    params = [["float32", "float16", "int8"], ["8x128", "3x64"]]
    param_names = ["dtype", "geometry"]

    def track_tokens_per_gib(self, dtype, geometry):
        heads, dim = map(int, geometry.split("x"))
        layers = 32 if geometry == "8x128" else 30
        per_token = KVStore.bytes_per_page(layers, PAGE_SIZE, heads, dim, dtype) // PAGE_SIZE
        return (1 << 30) // per_token

    track_tokens_per_gib.unit = "tokens"
