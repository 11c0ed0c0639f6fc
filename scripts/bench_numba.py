"""Quick measurements of the numba backend beside a plain copy of the same bytes.

Usage::

    python scripts/bench_numba.py [--repeat N] [--only gather,prefill,decode,cold,thresholds]

Figures (one layer, 8 KV heads x 128, page_size 16, pages in random order):

* gather of 32 sequences x 2048 tokens into preallocated BTHD and BHTD
  buffers, float32 and float16;
* prefill write of 2048 tokens, NHD and HND stores;
* decode write of 32 sequences x 1 token, per call, through the public
  ``Backend.write(..., check_indices=False)``, and its parts;
* cold start: the first write + gather in a fresh process, with an empty and
  with a warm kernel cache (a temporary directory);
* ``thresholds``: every kernel variant against the bytes moved, behind
  ``PARALLEL_MIN_BYTES`` and ``STREAM_MIN_BYTES``.

Bandwidths count bytes read plus bytes written. Each operation is timed
alternately with plain copies of the same number of bytes between two
contiguous arrays (:func:`pagedkv_np.bench.timing.against_copy`):
``np.copyto`` on one thread, and ``np.copyto`` split over Numba's thread
count with a persistent thread pool (NumPy releases the GIL while it
copies). The baseline is whichever of the two copies was faster.
Machines shared with other work make every figure vary, so the best of
``--repeat`` runs is reported, the ratio is taken between the bests, and the
median of the per-round ratios is printed beside it. The decode write's
parts and the threshold sweep take turns the same way
(:func:`~pagedkv_np.bench.timing.best_times`).

Siblings: ``pagedkv bench`` prints the standard gather and write cases of
every backend, and the asv suite (``benchmarks/bench_backends.py``) tracks
them per commit; this script measures what only the numba backend has
(kernel variants, thresholds, validation cost, cold start).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from functools import partial

import numpy as np

import pagedkv_np as pk
from pagedkv_np.backends.base import Backend
from pagedkv_np.bench.timing import CopyBaseline, CopyRatio, against_copy, best_times

NUM_HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16
BATCH, SEQ_LEN = 32, 2048


def _random_bits(rng, shape, dtype) -> np.ndarray:
    bits = np.dtype(np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint16)
    return rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits,
                        endpoint=True).view(dtype)


def _timed_rounds(op, base: CopyBaseline, moved: int, repeat: int) -> CopyRatio:
    """The op beside copies of ``moved`` bytes, one call per sample."""
    return against_copy(op, base.copies(moved), repeat, min_time=0.0)


def _line(name: str, moved: int, timings: CopyRatio) -> str:
    op_gbs, copy_gbs = moved / timings.seconds / 1e9, moved / timings.copy_seconds / 1e9
    threads = timings.copy_threads
    return (f"{name:<34} {timings.seconds * 1e3:7.2f} ms {op_gbs:5.1f} GB/s | copy "
            f"({threads} thread{'s' * (threads > 1)}) {copy_gbs:5.1f} GB/s | ratio "
            f"{op_gbs / copy_gbs:4.2f} (median of rounds {np.median(timings.ratios):4.2f})")


def _gather_case(backend, store, page_table, seq_lens, out_layout, repeat, base):
    shape = ((BATCH, SEQ_LEN, NUM_HEADS, HEAD_DIM) if out_layout == "BTHD"
             else (BATCH, NUM_HEADS, SEQ_LEN, HEAD_DIM))
    out = (np.ones(shape, store.dtype), np.ones(shape, store.dtype))

    def op():
        backend.gather(store.k, store.v, 0, page_table, seq_lens, out=out,
                       out_layout=out_layout, check_indices=False)

    moved = 4 * out[0].nbytes
    return _line(f"gather {store.dtype} NHD->{out_layout}", moved,
                 _timed_rounds(op, base, moved, repeat))


def bench_gather(backend, repeat: int, base: CopyBaseline) -> list[str]:
    rng = np.random.default_rng(0)
    lines = []
    num_pages = BATCH * SEQ_LEN // PAGE_SIZE
    page_table = rng.permutation(num_pages).astype(np.int32).reshape(BATCH, -1)
    seq_lens = np.full(BATCH, SEQ_LEN, np.int32)
    for dtype in ("float32", "float16"):
        store = pk.KVStore(1, PAGE_SIZE, NUM_HEADS, HEAD_DIM, num_pages=num_pages,
                           dtype=dtype, backend=pk.get_backend("numpy"))
        store.k[...] = _random_bits(rng, store.shape, store.dtype)
        store.v[...] = _random_bits(rng, store.shape, store.dtype)
        for out_layout in ("BTHD", "BHTD"):
            lines.append(_gather_case(backend, store, page_table, seq_lens, out_layout,
                                      repeat, base))
    return lines


def bench_prefill(backend, repeat: int, base: CopyBaseline) -> list[str]:
    rng = np.random.default_rng(1)
    lines = []
    num_tokens = SEQ_LEN
    num_pages = 4 * num_tokens // PAGE_SIZE
    pages = rng.permutation(num_pages)[: num_tokens // PAGE_SIZE].astype(np.int32)
    slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE, dtype=np.int32)).ravel()
    for dtype in ("float32", "float16"):
        for layout in ("NHD", "HND"):
            store = pk.KVStore(1, PAGE_SIZE, NUM_HEADS, HEAD_DIM, num_pages=num_pages,
                               dtype=dtype, layout=layout, backend=pk.get_backend("numpy"))
            store.k[...] = 1  # touch every page before timing
            store.v[...] = 1
            k = _random_bits(rng, (num_tokens, NUM_HEADS, HEAD_DIM), store.dtype)
            v = _random_bits(rng, (num_tokens, NUM_HEADS, HEAD_DIM), store.dtype)

            def op():
                backend.write(store.k, store.v, 0, slots, k, v, layout=layout,
                              check_indices=False)

            moved = 4 * k.nbytes
            lines.append(_line(f"prefill write {dtype} {layout} 2048 tok", moved,
                               _timed_rounds(op, base, moved, repeat)))
    return lines


class _NoKernel(Backend):
    """The base class's validation alone."""

    def _write(self, *args):
        pass


def bench_decode(backend, repeat: int, base: CopyBaseline) -> list[str]:
    """Per call, as in a decode loop: each call writes the next position of
    32 sequences, whose pages lie anywhere in a 4096-page store."""
    from pagedkv_np.backends import _numba_kernels as K

    def typed_view(x):   # as the backend hands 16-bit floats to its kernels
        return x if x.itemsize != 2 else x.view(np.uint16)

    rng = np.random.default_rng(2)
    lines = []
    num_seqs, num_pages, steps = 32, 4096, 256
    pages = rng.permutation(num_pages)[: num_seqs * steps // PAGE_SIZE].astype(np.int32)
    pages = pages.reshape(num_seqs, -1)
    step_slots = [pages[:, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(steps)]
    for dtype in ("float32", "float16"):
        store = pk.KVStore(1, PAGE_SIZE, NUM_HEADS, HEAD_DIM, num_pages=num_pages,
                           dtype=dtype, backend=pk.get_backend("numpy"))
        store.k[...] = 1  # touch every page before timing
        store.v[...] = 1
        k = _random_bits(rng, (num_seqs, NUM_HEADS, HEAD_DIM), store.dtype)
        v = _random_bits(rng, (num_seqs, NUM_HEADS, HEAD_DIM), store.dtype)
        # the bytes of K and V, read and written: into the same (hot)
        # destination each call, and into a fresh (cold) one per step, as the
        # store's slots are
        moved = 4 * k.nbytes
        hot = base.copies(moved)[0][0]
        fresh = base.fresh_copies(moved, steps * moved // 2)[0][0]
        typed = typed_view(store.k), typed_view(store.v), typed_view(k), typed_view(v)
        no_kernel = _NoKernel()
        cases = {
            "public write": lambda s: backend.write(store.k, store.v, 0, s, k, v,
                                                    check_indices=False),
            "validation only (no kernel)": lambda s: no_kernel.write(
                store.k, store.v, 0, s, k, v, check_indices=False),
            "public write, cache's flags": lambda s: backend.write(
                store.k, store.v, 0, s, k, v, check_indices=False, check_store=False),
            "kernel call alone": lambda s: K.write_serial(
                typed[0], typed[1], 0, s, typed[2], typed[3], K.STREAM),
            "np.copyto of the bytes (hot)": lambda s: hot(),
            "np.copyto into fresh memory": lambda s: fresh(),
        }
        # one sample: a pass over the 256 steps; the cases take turns
        passes = [lambda fn=fn: [fn(slots) for slots in step_slots] for fn in cases.values()]
        for name, best in zip(cases, best_times(passes, repeat, min_time=0.0)):
            lines.append(f"decode write {dtype} 32x1: {name:<30} {best / steps * 1e6:7.2f} us")
    return lines


def bench_thresholds(repeat: int) -> list[str]:
    """Each kernel variant against the bytes it writes, to place the
    PARALLEL_MIN_BYTES and *STREAM_MIN_BYTES thresholds (float32, NHD store,
    BTHD output)."""
    from pagedkv_np.backends import _numba_kernels as K

    rng = np.random.default_rng(3)
    variants = (("serial", 0), ("serial+stream", K.STREAM), ("parallel", 0),
                ("parallel+stream", K.STREAM))
    lines = ["bytes written (K+V)   " + "".join(f"{name:>17}" for name, _ in variants)
             + "   (us per call, best of N, the variants taking turns)"]
    token_bytes = NUM_HEADS * HEAD_DIM * 4
    num_pages = 8192
    k_cache = np.ones((1, num_pages, PAGE_SIZE, NUM_HEADS, HEAD_DIM), np.float32)
    v_cache = np.ones_like(k_cache)
    for nbytes in (64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20):
        n = nbytes // (2 * token_bytes)
        # Disjoint sets of random slots covering the whole store, taken in
        # turn: destinations are cold, as a write's are
        perm = rng.permutation(num_pages * PAGE_SIZE).astype(np.int32)
        slot_sets = [perm[i * n:(i + 1) * n] for i in range(perm.size // n)]
        k = _random_bits(rng, (n, NUM_HEADS, HEAD_DIM), np.float32)
        fns = []
        for name, stream in variants:
            kernel = K.write_parallel if name.startswith("parallel") else K.write_serial

            def fn(kernel=kernel, stream=stream):
                for slots in slot_sets:
                    kernel(k_cache, v_cache, 0, slots, k, k, stream)

            fns.append(fn)
        cells = [f"{best / len(slot_sets) * 1e6:17.1f}"
                 for best in best_times(fns, repeat, min_time=0.0)]
        lines.append(f"write {nbytes >> 10:8d} KiB      " + "".join(cells))
    for nbytes in (64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20,
                   16 << 20, 32 << 20):
        num_seqs = 1 if nbytes < (1 << 20) else 8
        seq_len = nbytes // (2 * token_bytes * num_seqs)
        table = rng.permutation(num_pages)[: num_seqs * -(-seq_len // PAGE_SIZE)]
        table = table.astype(np.int32).reshape(num_seqs, -1)
        lens = np.full(num_seqs, seq_len, np.int32)
        out = np.ones((num_seqs, seq_len, NUM_HEADS, HEAD_DIM), np.float32), np.ones(
            (num_seqs, seq_len, NUM_HEADS, HEAD_DIM), np.float32)
        fns = [partial(K.gather_parallel if name.startswith("parallel") else K.gather_serial,
                       k_cache, v_cache, 0, table, lens, out[0], out[1], stream)
               for name, stream in variants]
        cells = [f"{best * 1e6:17.1f}" for best in best_times(fns, repeat, min_time=0.01)]
        lines.append(f"gather {2 * out[0].nbytes >> 10:7d} KiB      " + "".join(cells))
    return lines


_COLD = textwrap.dedent("""
    import time
    t0 = time.perf_counter()
    import numpy as np
    import pagedkv_np as pk
    t1 = time.perf_counter()
    be = pk.get_backend("numba")
    st = pk.KVStore(1, 16, 8, 128, num_pages=64, dtype="{dtype}", backend=be)
    k = np.ones((4, 8, 128), st.dtype)
    t2 = time.perf_counter()
    be.write(st.k, st.v, 0, np.arange(4, dtype=np.int32), k, k)
    t3 = time.perf_counter()
    be.gather(st.k, st.v, 0, np.array([[0]], np.int32), np.array([4], np.int32),
              out_layout="BHTD")
    t4 = time.perf_counter()
    print(f"import {{t1 - t0:.2f}} s, first write {{t3 - t2:.2f}} s, "
          f"first gather {{t4 - t3:.2f}} s, total {{t4 - t0:.2f}} s")
""")


def bench_cold() -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PAGEDKV_NUMBA_CACHE_DIR=tmp)
        for dtype in ("float32",):
            for state in ("empty cache", "warm cache"):
                out = subprocess.run([sys.executable, "-c", _COLD.format(dtype=dtype)],
                                     env=env, capture_output=True, text=True, check=True)
                lines.append(f"cold start {dtype}, {state}: {out.stdout.strip()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--only", default="gather,prefill,decode,cold",
                        help="comma-separated subset of gather,prefill,decode,cold,thresholds")
    args = parser.parse_args(argv)
    import numba

    backend = pk.get_backend("numba")
    num_threads = numba.get_num_threads()
    print(f"numba {numba.__version__}, {num_threads} threads, "
          f"threading layer {numba.config.THREADING_LAYER}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    t = time.perf_counter()
    pk.warmup(dtypes=("float32", "float16"))
    print(f"warmup: {time.perf_counter() - t:.2f} s")
    only = set(args.only.split(","))
    base = CopyBaseline(max(2, num_threads))
    try:
        for name, fn in (("gather", lambda: bench_gather(backend, args.repeat, base)),
                         ("prefill", lambda: bench_prefill(backend, args.repeat, base)),
                         ("decode", lambda: bench_decode(backend, args.repeat, base)),
                         ("cold", bench_cold),
                         ("thresholds", lambda: bench_thresholds(args.repeat))):
            if name in only:
                for line in fn():
                    print(line, flush=True)
    finally:
        base.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
