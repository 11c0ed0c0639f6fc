#!/usr/bin/env python
"""What a decode step's attention costs with the past's K/V in each dtype that
onnxruntime's CPU ``GroupQueryAttention`` takes.

One GroupQueryAttention node, one new token after a past of D positions,
past and present sharing one buffer (IOBinding, as the engine's decode
batches run it), in a cache of float32 (what the engine's graphs use),
float16, or int8 codes with one scale per channel (``k_quant_type`` /
``v_quant_type`` ``PER_CHANNEL``) or per tensor. The query, key and value
stay float32. Beside them, the engine's own decode attention
(:func:`pagedkv_np.backends.decode_ops.attend`, float32 buffers), which
decodes GGUF imports (Numba threads as set, e.g. ``NUMBA_NUM_THREADS``).
Each layer has a buffer of its own, so the K/V come from memory, not the
cache, as in a real model (``--layers`` of them, called in
turn); the dtypes run in interleaved rounds and each figure is the median
time per layer.

The geometries are Gemma 3 270M's global layers (4 query heads, one K/V
head of 256) and SmolLM2-135M's (9 query heads, 3 K/V heads of 64). An int8
cache with static scales needs those scales calibrated per model, and its
buffers would also be the prompt runs' (the graph's K/V dtype is one for
both); the figures here say what that would buy.

Usage::

    python scripts/bench_kv_dtypes.py                 # depths 0, 2048, 4096
    python scripts/bench_kv_dtypes.py --quick         # depth 512, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import interleave  # noqa: E402

GEOMETRIES = {"gemma3-270m": (4, 1, 256), "smollm2-135m": (9, 3, 64)}
CACHES = ("float32", "float16", "int8/channel", "int8/tensor", "engine f32")


def _session(cache: str, heads: int, kv_heads: int, head_dim: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    kv = {"float32": f32, "float16": TensorProto.FLOAT16}.get(cache, TensorProto.INT8)
    inputs = [helper.make_tensor_value_info("q", f32, [1, 1, heads * head_dim]),
              helper.make_tensor_value_info("k", f32, [1, 1, kv_heads * head_dim]),
              helper.make_tensor_value_info("v", f32, [1, 1, kv_heads * head_dim]),
              helper.make_tensor_value_info("past_k", kv, [1, kv_heads, "T", head_dim]),
              helper.make_tensor_value_info("past_v", kv, [1, kv_heads, "T", head_dim]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"]
    attrs: dict = {}
    inits = []
    if cache.startswith("int8"):
        per = cache.split("/")[1]
        shape = [1] if per == "tensor" else [kv_heads, 1, head_dim]
        inits = [numpy_helper.from_array(np.full(shape, 0.05, np.float32), name)
                 for name in ("k_scale", "v_scale")]
        names += [""] * 5 + ["k_scale", "v_scale"]
        kind = "PER_TENSOR" if per == "tensor" else "PER_CHANNEL"
        attrs = dict(k_quant_type=kind, v_quant_type=kind, kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"],
                            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
                            **attrs)
    outputs = [helper.make_tensor_value_info("out", f32, None),
               helper.make_tensor_value_info("present_k", kv, None),
               helper.make_tensor_value_info("present_v", kv, None)]
    graph = helper.make_graph([node], "attention", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _engine_layers(geometry: tuple[int, int, int], depth: int, layers: int,
                   rng: np.random.Generator):
    """The engine's own decode attention (float32 buffers), as :func:`_layers`."""
    from pagedkv_np.backends import decode_ops as ops

    heads, kv_heads, head_dim = geometry
    shape = (1, kv_heads, depth + 64, head_dim)
    bufs = [[rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
            for _ in range(layers)]
    x = rng.standard_normal((1, heads * head_dim)).astype(np.float32)
    out, positions = np.empty_like(x), np.array([depth])
    scale = np.float32(head_dim ** -0.5)

    def run() -> float:
        start = time.perf_counter()
        for k, v in bufs:
            ops.attend(x, heads, kv_heads, head_dim, k, v, positions, 0, scale, out)
        return (time.perf_counter() - start) / layers

    run()   # compiles (or loads) the kernels
    return run, bufs


def _layers(cache: str, geometry: tuple[int, int, int], depth: int, layers: int,
            threads: int, rng: np.random.Generator):
    """One call per layer, each with a buffer of its own: a callable running them all."""
    import onnxruntime as ort

    if cache == "engine f32":
        return _engine_layers(geometry, depth, layers, rng)
    heads, kv_heads, head_dim = geometry
    session = _session(cache, heads, kv_heads, head_dim, threads)
    shape = (1, kv_heads, depth + 64, head_dim)
    bindings, keep = [], []
    for _ in range(layers):
        if cache.startswith("int8"):
            past = [rng.integers(-127, 128, shape, dtype=np.int8) for _ in range(2)]
        else:
            past = [rng.standard_normal(shape).astype(cache) for _ in range(2)]
        feeds = {"q": rng.standard_normal((1, 1, heads * head_dim)).astype(np.float32),
                 "k": rng.standard_normal((1, 1, kv_heads * head_dim)).astype(np.float32),
                 "v": rng.standard_normal((1, 1, kv_heads * head_dim)).astype(np.float32),
                 "seqlens_k": np.array([depth], np.int32),
                 "total": np.array(depth + 1, np.int32)}
        binding = session.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        for arr, src, dst in zip(past, ("past_k", "past_v"), ("present_k", "present_v")):
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            binding.bind_ortvalue_input(src, value)
            binding.bind_ortvalue_output(dst, value)
            keep.append(value)
        binding.bind_output("out", "cpu")
        bindings.append(binding)
        keep += [past, feeds]

    def run() -> float:
        start = time.perf_counter()
        for binding in bindings:
            session.run_with_iobinding(binding)
        return (time.perf_counter() - start) / layers

    run()   # the first call allocates
    return run, keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_kv_dtypes.py",
        description="onnxruntime GroupQueryAttention per layer, by K/V cache dtype")
    parser.add_argument("--depths", default="0,2048,4096",
                        help="past positions, comma-separated (default 0,2048,4096)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--layers", type=int, default=12,
                        help="layers, each with its own buffers (default 12)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--quick", action="store_true",
                        help="depth 512, 3 rounds of 2 steps, 2 layers")
    args = parser.parse_args(argv)
    if args.quick:
        args.depths, args.rounds, args.steps, args.layers = "512", 3, 2, 2
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        parser.error(f"--depths: expected comma-separated integers, got {args.depths!r}")
    if any(d < 0 for d in depths) or min(args.rounds, args.steps, args.layers,
                                         args.threads) < 1:
        parser.error("depths must be >= 0; rounds, steps, layers and threads >= 1")
    rng = np.random.default_rng(0)
    print(f"GroupQueryAttention, one token, median ms per layer over {args.rounds} "
          f"interleaved rounds of {args.steps} steps, {args.layers} layers, "
          f"{args.threads} threads")
    print(f"{'geometry':<14}{'depth':>6}" + "".join(f"{c:>14}" for c in CACHES))
    for name, geometry in GEOMETRIES.items():
        for depth in depths:
            # each run's buffers stay held beside it: its bindings only point at them
            runs = {cache: _layers(cache, geometry, depth, args.layers, args.threads, rng)
                    for cache in CACHES}
            times = interleave({c: (lambda run=run: [run() for _ in range(args.steps)])
                                for c, (run, _) in runs.items()}, args.rounds)
            medians = {c: statistics.median(t for chunk in times[c] for t in chunk)
                       for c in CACHES}
            base = medians["float32"]
            print(f"{name:<14}{depth:>6}" + "".join(
                f"{1e3 * medians[c]:>8.3f} {base / medians[c]:>4.2f}x" for c in CACHES))
    print("ratios: float32's time over each dtype's (above 1: faster than float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
