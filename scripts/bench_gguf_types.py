"""Time of one linear layer per GGUF weight type, as the importer builds it.

For a K x N weight (default 2048 x 2048) of random ggml blocks of each type,
:func:`pagedkv_np.models.graph.build_linear` builds the layer as the model
would run it (MatMulNBits with the type's bits and block size, plus the
block-sum term of types with offsets) at ``accuracy_level`` 0 (float32
activations) and 4 (int8 activations); beside them, a float32 MatMul of the
same shape (what a type that is not kept as blocks becomes). Each session
runs with one intra-op thread, without spinning; rows of activations M = 1
(decode) and M = 32 (a prefill chunk); best and median milliseconds over
the calls (:func:`pagedkv_np.bench.timing.round_times`). No asv sibling:
the importer's choice per type is measured here once, not per commit.

Run: ``.venv/bin/python scripts/bench_gguf_types.py [--k 2048] [--n 2048] [--reps 50]``.

Measured on this 2-core machine (2026-12-01, onnxruntime 1.32, shared with
other jobs, load average 9-12: medians move by 2x, the best of 50 less): the
table in :mod:`pagedkv_np.models.gguf.blocks`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from pagedkv_np.bench.timing import round_times, spread  # noqa: E402
from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized  # noqa: E402
from pagedkv_np.models.graph import build_linear  # noqa: E402

# byte offsets of each block's float16 fields (d, then dmin or m)
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
              "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
              "q6_k": (208,)}


def random_weight(kind: str, k: int, n: int, rng: np.random.Generator) -> BlockQuantized:
    spec = BLOCK_KINDS[kind]
    raw = rng.integers(0, 256, (n, k // spec.nweights, spec.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[..., at:at + 2] = np.array([0.001], np.float16).view(np.uint8)
    return BlockQuantized(kind, raw.reshape(n, -1))


def float_model(k: int, n: int, rng: np.random.Generator):
    w = rng.standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "f32",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", n])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def time_model(model, k: int, rows: int, reps: int) -> tuple[float, float]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, rows, k)).astype(np.float32)
    for _ in range(2):
        sess.run(None, {"x": x})
    # one call a sample (min_time 0): the median says how the load moved them
    times = spread(r[0] for r in round_times([lambda: sess.run(None, {"x": x})], reps, 0.0))
    return times.low * 1e3, times.median * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--kinds", default=",".join(BLOCK_KINDS))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"K={args.k} N={args.n}, one thread; ms best / median")
    print(f"{'layer':18s} {'M=1':>15s} {'M=32':>15s}")
    cases = [("float32 MatMul", float_model(args.k, args.n, rng))]
    for kind in args.kinds.split(","):
        w = random_weight(kind, args.k, args.n, rng)
        for level in (0, 4):
            name = f"{kind} {w.spec.bits}b/{w.spec.sub} acc{level}"
            cases.append((name, build_linear(w, accuracy_level=level)))
    for name, model in cases:
        one = time_model(model, args.k, 1, args.reps)
        many = time_model(model, args.k, 32, max(args.reps // 5, 3))
        print(f"{name:18s} {one[0]:7.3f} {one[1]:7.3f} {many[0]:7.3f} {many[1]:7.3f}",
              flush=True)


if __name__ == "__main__":
    main()
