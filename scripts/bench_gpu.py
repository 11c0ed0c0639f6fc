"""Bandwidth of the CuPy backend's kernels beside a device-to-device copy.

Each figure is the kernel's time against ``cudaMemcpyAsync`` (device to
device) of the same bytes, the device copy of
:class:`pagedkv_np.bench.timing.CopyBaseline`, timed in interleaved rounds
in this process (:func:`pagedkv_np.bench.timing.against_copy`: calls queued
back to back, the stream synchronised at the end of each sample):
``ratio = copy time / kernel time`` of the bests (1.0 means as fast as a
plain copy; the goal is >= 0.8), with the median of the per-round ratios
beside it. Bytes count what is read plus what is written, K and V.

Kernels are timed alone (index arrays uploaded once beforehand), then one
line gives the wall time of a whole public call (checks, upload, launch,
synchronise) for scale.

Siblings: ``pagedkv bench --backend cupy`` and the asv suite
(``benchmarks/bench_backends.py``) time the backend's public calls; this
script times the kernels alone, at bfloat16 and larger sizes.

Usage: ``python scripts/bench_gpu.py [--out results.json] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedkv_np import get_backend  # noqa: E402
from pagedkv_np.backends._cuda_sources import get_kernel  # noqa: E402
from pagedkv_np.backends.cupy_gpu import (  # noqa: E402
    plan_copy_pages, plan_gather, plan_write, row_strides)
from pagedkv_np.bench.timing import CopyBaseline, against_copy, best_times, sync_for  # noqa: E402
from pagedkv_np.layout import OutputLayout, StoreLayout, resolve_dtype  # noqa: E402


def launcher(cupy, plan, *arrays):
    kernel = get_kernel(plan.file_name, plan.entry_point)
    args = (*arrays, *plan.scalars)
    return lambda: kernel(plan.grid, plan.block, args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = parser.parse_args(argv)

    import cupy

    be = get_backend("cupy")
    baseline = CopyBaseline()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    repeats = 5 if args.quick else 20
    min_time = 0.005 if args.quick else 0.02   # seconds of one sample
    sync = sync_for(be)
    dtype = resolve_dtype("bfloat16")
    num_heads, head_dim, page_size = 8, 128, 16
    num_seqs, seq_len = (16, 1024) if args.quick else (64, 2048)
    num_prefill = 4096 if args.quick else 16384
    rng = np.random.default_rng(0)
    results = {"device": props["name"].decode(), "dtype": dtype.name, "num_kv_heads": num_heads,
               "head_dim": head_dim, "page_size": page_size, "rows": []}
    print(f"{results['device']}: {dtype.name}, {num_heads} kv heads x {head_dim}, "
          f"page_size {page_size}")
    print(f"{'operation':44s} {'kernel GB/s':>12s} {'copy GB/s':>10s} {'ratio':>6s} "
          f"{'median':>6s}")

    def report(name, nbytes, run):
        """Time ``run`` beside a device copy that reads and writes ``nbytes`` in all."""
        timing = against_copy(run, baseline.copies(nbytes, be), repeats, min_time, sync)
        row = {"operation": name, "bytes": nbytes, "kernel_s": timing.seconds,
               "copy_s": timing.copy_seconds, "kernel_gbps": nbytes / timing.seconds / 1e9,
               "copy_gbps": nbytes / timing.copy_seconds / 1e9, "ratio": timing.ratio,
               "ratio_median": float(np.median(timing.ratios))}
        results["rows"].append(row)
        print(f"{name:44s} {row['kernel_gbps']:12.0f} {row['copy_gbps']:10.0f} "
              f"{row['ratio']:6.2f} {row['ratio_median']:6.2f}")

    num_tokens = num_seqs * seq_len
    num_pages = num_tokens // page_size + 64
    row_bytes = num_heads * head_dim * dtype.itemsize
    for layout in StoreLayout:
        shape = ((1, num_pages, page_size, num_heads, head_dim) if layout is StoreLayout.NHD
                 else (1, num_pages, num_heads, page_size, head_dim))
        k_cache = cupy.zeros(shape, dtype=dtype)
        v_cache = cupy.zeros(shape, dtype=dtype)
        pages = rng.permutation(num_pages)[:num_tokens // page_size].astype(np.int32)

        # Prefill write: num_prefill tokens into scattered pages.
        t = np.arange(num_prefill)
        slots = (pages[t // page_size] * page_size + t % page_size).astype(np.int32)
        k = cupy.asarray(rng.standard_normal((num_prefill, num_heads, head_dim)).astype(dtype))
        v = cupy.asarray(rng.standard_normal((num_prefill, num_heads, head_dim)).astype(dtype))
        plan = plan_write(layout, shape, dtype.itemsize, num_prefill,
                          (k_cache[0].data.ptr, v_cache[0].data.ptr, k.data.ptr, v.data.ptr),
                          row_strides(k.shape, k.strides), row_strides(v.shape, v.strides))
        run = launcher(cupy, plan, k_cache[0], v_cache[0], k, v, cupy.asarray(slots))
        nbytes = 2 * 2 * num_prefill * row_bytes
        report(f"write {layout.value} prefill {num_prefill} tokens", nbytes, run)

        # Decode gather: num_seqs sequences of seq_len tokens, one layer.
        table = pages.reshape(num_seqs, seq_len // page_size)
        lens = np.full(num_seqs, seq_len, dtype=np.int32)
        for out_layout in OutputLayout:
            out_shape = ((num_seqs, seq_len, num_heads, head_dim)
                         if out_layout is OutputLayout.BTHD
                         else (num_seqs, num_heads, seq_len, head_dim))
            k_out = cupy.empty(out_shape, dtype=dtype)
            v_out = cupy.empty(out_shape, dtype=dtype)
            plan = plan_gather(layout, out_layout, shape, dtype.itemsize, num_seqs,
                               table.shape[1], seq_len,
                               (k_cache[0].data.ptr, v_cache[0].data.ptr, k_out.data.ptr,
                                v_out.data.ptr))
            run = launcher(cupy, plan, k_cache[0], v_cache[0], k_out, v_out,
                           cupy.asarray(table), cupy.asarray(lens))
            nbytes = 2 * 2 * num_tokens * row_bytes
            report(f"gather {layout.value}->{out_layout.value} {num_seqs}x{seq_len}",
                   nbytes, run)

        # Copy-on-write of many pages.
        num_pairs = min(1024, num_pages // 4)
        perm = rng.permutation(num_pages).astype(np.int32)
        src, dst = perm[:num_pairs], perm[num_pairs:2 * num_pairs]
        plan = plan_copy_pages(shape, dtype.itemsize, num_pairs,
                               (k_cache.data.ptr, v_cache.data.ptr))
        run = launcher(cupy, plan, k_cache, v_cache, cupy.asarray(src), cupy.asarray(dst))
        nbytes = 2 * 2 * num_pairs * page_size * row_bytes
        report(f"copy_pages {layout.value} {num_pairs} pages", nbytes, run)

        if layout is StoreLayout.NHD:
            # A whole public decode step (one token per sequence), wall clock.
            step_slots = (pages.reshape(num_seqs, -1)[:, -1] * page_size).astype(np.int32)
            k1 = cupy.asarray(rng.standard_normal((num_seqs, num_heads, head_dim)).astype(dtype))
            v1 = cupy.asarray(rng.standard_normal((num_seqs, num_heads, head_dim)).astype(dtype))

            def step():
                be.write(k_cache, v_cache, 0, step_slots, k1, v1, layout=layout)
                cupy.cuda.get_current_stream().synchronize()

            [wall] = best_times([step], repeats, min_time)
            results["decode_write_call_s"] = wall
            print(f"public write of {num_seqs} decode tokens, wall per call: {wall * 1e6:.0f} us")

    worst = min(r["ratio"] for r in results["rows"] if not r["operation"].startswith("copy_"))
    results["worst_write_gather_ratio"] = worst
    print(f"worst write/gather ratio to a copy: {worst:.2f} (goal >= 0.8)")
    baseline.close()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
