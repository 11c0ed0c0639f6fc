"""Figures of the int8 store: cached tokens per GiB, quantize/dequantize speed, error.

Usage::

    python scripts/bench_quant.py [--only tokens,speed,quality] [--backend numba]
                                  [--rounds 5] [--quick] [--matched]

* ``tokens``: tokens a GiB of K/V holds, for float32, float16 and int8
  stores of 8 KV heads x 128 (32 layers) and of SmolLM2-135M's 3 x 64 (30
  layers), scales included.
* ``speed``: one layer of 32 sequences x 2048 tokens x 8 heads x 128, pages
  of 16 in shuffled order. ``write`` quantizes all 65536 tokens (float32,
  float16 or bfloat16 in); ``gather`` dequantizes them into preallocated
  buffers of each of those dtypes, in both output layouts (``--matched``:
  only the layout that follows the store's, NHD -> BTHD and HND -> BHTD).
  Each is timed in interleaved rounds beside plain copies of the float
  bytes handed in (write) or got back (gather), from
  :class:`pagedkv_np.bench.timing.CopyBaseline`; the ratio is copy time /
  operation time (1.0: as fast as copying the floats), the median of the
  per-round ratios with the range beside it.
* ``quality``: the measurement behind the format's group size
  (:mod:`pagedkv_np.quant`): RMS error relative to the signal for K with
  outlier channels and Gaussian V, by values per scale, beside a float16
  round trip.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedkv_np import KVStore, get_backend  # noqa: E402
from pagedkv_np.bench.timing import CopyBaseline, round_times  # noqa: E402
from pagedkv_np.layout import resolve_dtype  # noqa: E402

GIB = 1 << 30
PAGE_SIZE = 16
GEOMETRIES = [("8 x 128, 32 layers", 32, 8, 128), ("SmolLM2 3 x 64, 30 layers", 30, 3, 64)]
BATCH, SEQ_LEN, NUM_HEADS, HEAD_DIM = 32, 2048, 8, 128


def tokens_per_gib() -> None:
    print("cached tokens per GiB of K/V (page_size 16, scales included)")
    print(f"  {'geometry':28s} {'float32':>10s} {'float16':>10s} {'int8':>10s}"
          f" {'x f32':>7s} {'x f16':>7s}")
    for name, layers, heads, dim in GEOMETRIES:
        tokens = {d: GIB // (KVStore.bytes_per_page(layers, PAGE_SIZE, heads, dim, d)
                             // PAGE_SIZE) for d in ("float32", "float16", "int8")}
        print(f"  {name:28s} {tokens['float32']:10d} {tokens['float16']:10d} "
              f"{tokens['int8']:10d} {tokens['int8'] / tokens['float32']:7.2f} "
              f"{tokens['int8'] / tokens['float16']:7.2f}")


def _ratios(op, copies, rounds: int, min_time: float) -> tuple[float, float, float, float]:
    """(op seconds median, median ratio, min ratio, max ratio) over rounds."""
    times = round_times([op] + [c for c, _ in copies], rounds, min_time)
    ratios = [min(r[1:]) / r[0] for r in times]
    return (float(np.median([r[0] for r in times])), float(np.median(ratios)),
            min(ratios), max(ratios))


def _write_line(backend, arrays, layout, slots, in_dtype, rng, baseline, rounds, min_time):
    dt = resolve_dtype(in_dtype)
    shape = (len(slots), NUM_HEADS, HEAD_DIM)
    k = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dt))
    v = backend.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dt))

    def write():
        backend.write_quantized(*arrays, 0, slots, k, v, layout=layout, check_indices=False)

    nbytes = k.nbytes + v.nbytes
    t, med, lo, hi = _ratios(write, baseline.copies(2 * nbytes, backend), rounds, min_time)
    return (f"  write  {layout} from {in_dtype:8s}          {t * 1e3:8.1f} ms  "
            f"ratio {med:.2f} [{lo:.2f}, {hi:.2f}]")


def _gather_line(backend, arrays, layout, out_layout, out_dtype, table, seq_lens, baseline,
                 rounds, min_time):
    batch = table.shape[0]
    shape = ((batch, SEQ_LEN, NUM_HEADS, HEAD_DIM) if out_layout == "BTHD"
             else (batch, NUM_HEADS, SEQ_LEN, HEAD_DIM))
    out = (backend.zeros(shape, resolve_dtype(out_dtype)),
           backend.zeros(shape, resolve_dtype(out_dtype)))

    def gather():
        backend.gather_quantized(*arrays, 0, table, seq_lens, layout=layout,
                                 out_layout=out_layout, out=out, check_indices=False)

    nbytes = out[0].nbytes + out[1].nbytes
    t, med, lo, hi = _ratios(gather, baseline.copies(2 * nbytes, backend), rounds, min_time)
    matched = (layout, out_layout) in (("NHD", "BTHD"), ("HND", "BHTD"))
    tag = " (layout-matched)" if matched else ""
    return (f"  gather {layout} -> {out_layout} {out_dtype:8s}  {t * 1e3:8.1f} ms  "
            f"ratio {med:.2f} [{lo:.2f}, {hi:.2f}]{tag}")


FLOATS = ("float32", "float16", "bfloat16")
MATCHED = {"NHD": "BTHD", "HND": "BHTD"}


def speed(backend_name: str, rounds: int, quick: bool, matched: bool = False) -> None:
    backend = get_backend(backend_name)
    batch = 4 if quick else BATCH
    num_pages = batch * SEQ_LEN // PAGE_SIZE
    rng = np.random.default_rng(0)
    table = rng.permutation(num_pages).astype(np.int32).reshape(batch, -1)
    seq_lens = np.full(batch, SEQ_LEN, np.int32)
    pos = np.arange(SEQ_LEN)
    slots = np.concatenate([table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                            for b in range(batch)]).astype(np.int32)
    baseline = CopyBaseline()
    min_time = 0.05 if quick else 0.2
    print(f"{backend_name}: one layer of {batch} x {SEQ_LEN} tokens x {NUM_HEADS} x {HEAD_DIM}, "
          f"int8 store, ratio = copy of the float bytes / operation, median of {rounds} "
          f"rounds [min, max]")
    try:
        for layout in ("NHD", "HND"):
            store = KVStore(1, PAGE_SIZE, NUM_HEADS, HEAD_DIM, num_pages=num_pages,
                            dtype="int8", layout=layout, backend=backend)
            arrays = (store.k, store.v, store.k_scale, store.v_scale)
            for in_dtype in FLOATS:
                print(_write_line(backend, arrays, layout, slots, in_dtype, rng, baseline,
                                  rounds, min_time))
            for out_layout in (MATCHED[layout],) if matched else ("BTHD", "BHTD"):
                for out_dtype in FLOATS:
                    print(_gather_line(backend, arrays, layout, out_layout, out_dtype, table,
                                       seq_lens, baseline, rounds, min_time))
    finally:
        baseline.close()


def quality() -> None:
    from pagedkv_np.quant import GROUP_SIZE, QMAX

    rng = np.random.default_rng(0)
    n, heads, dim = 4096, 8, 128
    k = rng.standard_normal((n, heads, dim)).astype(np.float32)
    for h in range(heads):  # K: a few outlier channels per head, as real K has
        k[:, h, rng.choice(dim, 4, replace=False)] *= 12.0
    v = rng.standard_normal((n, heads, dim)).astype(np.float32)

    def round_trip(x, group):
        g = x.reshape(n, heads, dim // group, group)
        scale = np.abs(g).max(axis=-1, keepdims=True) / np.float32(QMAX)
        return (np.clip(np.rint(g / scale), -QMAX, QMAX) * scale).reshape(x.shape)

    def rel(x, y):
        return float(np.sqrt(((x - y) ** 2).mean() / (y ** 2).mean()))

    print(f"RMS error / RMS signal, {n} tokens x {heads} x {dim} (the format uses {GROUP_SIZE})")
    print(f"  {'values per scale':18s} {'bytes/value':>11s} {'K outliers':>11s} "
          f"{'V gaussian':>11s}")
    for group in (32, 64, 128):
        print(f"  {group:<18d} {1 + 4 / group:11.4f} {rel(round_trip(k, group), k):11.5f} "
              f"{rel(round_trip(v, group), v):11.5f}")
    print(f"  {'float16 store':18s} {2.0:11.4f} {rel(k.astype(np.float16), k):11.5f} "
          f"{rel(v.astype(np.float16), v):11.5f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="tokens,speed,quality")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 sequences, short samples")
    parser.add_argument("--matched", action="store_true",
                        help="gathers only into the output layout that follows the store's")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    if "tokens" in parts:
        tokens_per_gib()
    if "quality" in parts:
        quality()
    if "speed" in parts:
        speed(args.backend, args.rounds, args.quick, args.matched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
