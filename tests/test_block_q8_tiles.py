"""q8_tiled_matmul: int8 activations against a weight packed in tiles of 16
outputs follow the documented order bit for bit (a NumPy emulation written
from the module docstring) for random weights and every ggml type of 4 or 8
bits in blocks of 32 as the GGUF importer lays it out, alone or in any batch,
on 1 or 2 threads, on the IR kernel and the portable loops alike, with and
without VNNI; stay close to the lane-order kernel; bad input raises a typed
error before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_np.backends.block_gemv import BlockWeight, block_matmul
from pagedkv_np.backends.block_q8 import q8_matmul, q8_quantize
from pagedkv_np.backends.block_q8_tiles import (packs, q8_tiled_gemm, q8_tiled_gemm_portable,
                                                q8_tiled_matmul, q8_tiles, q8x2_tiled_matmul)
from pagedkv_np.errors import DTypeError, ShapeError
from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized

from test_block_q8 import _halved, _weight
from test_gguf_import import random_blocks


def _codes(w: BlockWeight) -> np.ndarray:
    """int64 ``[N, K]``: each input's code."""
    if w.bits == 8:
        return w.codes.astype(np.int64)
    codes = np.empty((w.out_features, w.in_features), np.int64)
    codes[:, 0::2] = w.codes & 15
    codes[:, 1::2] = w.codes >> 4
    return codes


def _emulate(x: np.ndarray, w: BlockWeight) -> np.ndarray:
    """The documented order in NumPy float32 (one rounding per operation)."""
    m, k = x.shape
    bs = w.block_size                   # 16: each half of 32 inputs' codes a block
    nb = k // bs
    q = np.empty((m, k), np.int8)
    d, dq, sums = (np.empty((m, nb), np.float32) for _ in range(3))
    q8_quantize(x, 8, bs, q, d, dq, sums)
    codes = _codes(w)
    p = np.einsum("nbi,mbi->mnb", codes.reshape(-1, nb, bs),
                  q.astype(np.int64).reshape(m, nb, bs))
    zs = w.scales * w.zeros.astype(np.float32)
    c = w.offsets - zs if w.offsets is not None else -zs
    acc = np.zeros((m, w.out_features), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(nb):
            v = (w.scales[None, :, b] * d[:, None, b]) * p[:, :, b].astype(np.float32)
            if c.any():
                v = v + c[None, :, b] * dq[:, None, b]
            acc = acc + v
    return acc


CASES = [(4, 0, True), (4, 8, False), (4, "mixed", True), (8, 128, False), (8, "mixed", True),
         (8, 0, False), (5, 16, False), (5, "mixed", True), (16, 32, False), (16, "mixed", True)]


def _tile_weight(rng, bits: int, k: int, n: int, zero, offsets: bool) -> BlockWeight:
    """:func:`_weight` in blocks of 32; ``bits`` 5: 8-bit codes all below 32
    (Q5_0 as imported), which pack as 5 bits; ``bits`` 16: 8 bits in blocks of
    16 (Q6_K as imported)."""
    if bits == 16:
        return _weight(rng, 8, 16, k, n, zero, offsets)
    if bits != 5:
        return _weight(rng, bits, 32, k, n, zero, offsets)
    w = _weight(rng, 8, 32, k, n, zero, offsets)
    w.codes[:] = rng.integers(0, 32, w.codes.shape, dtype=np.uint8)
    w.codes[0, :32] = 31                   # the largest code, and every fifth bit set
    return w


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,zero,offsets", CASES)
@pytest.mark.parametrize("halved", [False, True])
def test_tiles_follow_the_order_in_any_batch(bits, zero, offsets, halved, threads):
    rng = np.random.default_rng(bits * 7 + offsets)
    w = _tile_weight(rng, bits, 160, 41, zero, offsets)   # 41: a last tile of 9 outputs
    w = _halved(w) if halved else w
    x = rng.standard_normal((6, 160)).astype(np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        got = q8_tiled_matmul(x, w)
        alone = [q8_tiled_matmul(x[i:i + 1], w)[0] for i in range(6)]
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(got, _emulate(x, w))
    np.testing.assert_array_equal(np.stack(alone), got)
    # float16 lanes where exact, float32 otherwise: the same values either way
    assert (q8_tiles(w).scales.dtype == np.uint16) == halved
    packed = 8 if bits == 16 else bits              # 8-bit codes below 32 pack as 5 bits
    assert q8_tiles(w).bits == packed
    assert q8_tiles(w).codes.nbytes == -(-41 // 16) * 160 * 2 * packed


@pytest.mark.parametrize("bits,zero,offsets", CASES)
def test_portable_loops_give_the_kernels_bits(bits, zero, offsets):
    rng = np.random.default_rng(3)
    w = _tile_weight(rng, bits, 96, 37, zero, offsets)
    tiles = q8_tiles(w)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    q = np.empty((5, 96), np.int8)
    d, dq, sums = (np.empty((5, 96 // w.block_size), np.float32) for _ in range(3))
    q8_quantize(x, 8, w.block_size, q, d, dq, sums)
    outs = [np.full((5, 37), np.nan, np.float32) for _ in range(2)]
    for gemm, out in zip((q8_tiled_gemm, q8_tiled_gemm_portable), outs):
        gemm(q, d, dq, tiles.codes, tiles.scales, tiles.terms, tiles.bits, 2, out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], _emulate(x, w))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6), blocks=st.integers(1, 20),
       n=st.integers(1, 70), bits=st.sampled_from([4, 5, 8, 16]), offsets=st.booleans(),
       scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_random_shapes_and_magnitudes_follow_the_order(seed, m, blocks, n, bits, offsets,
                                                       scale):
    rng = np.random.default_rng(seed)
    k = blocks * 32
    w = _tile_weight(rng, bits, k, n, "mixed", offsets)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0
    got = q8_tiled_matmul(x, w)
    np.testing.assert_array_equal(got, _emulate(x, w))
    # the lane-order kernel rounds the same int8 rows: only float32 roundings
    # of the sums of |w x| apart
    magnitude = np.abs(x).astype(np.float64) @ np.abs(_dequantized(w))
    assert (np.abs(got - q8_matmul(x, w)) <= 1e-5 * magnitude + 1e-30).all()


def _dequantized(w: BlockWeight) -> np.ndarray:
    """float64 ``[K, N]`` of ``w``."""
    codes = _codes(w).astype(np.float64)
    rep = np.repeat
    bs = w.block_size
    value = (codes - rep(w.zeros, bs, axis=1)) * rep(w.scales.astype(np.float64), bs, axis=1)
    if w.offsets is not None:
        value += rep(w.offsets.astype(np.float64), bs, axis=1)
    return value.T


@pytest.mark.parametrize("kind", sorted(BLOCK_KINDS))
def test_every_ggml_type_that_packs_follows_the_order(kind):
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    rng = np.random.default_rng(8)
    parts = BlockQuantized(kind, random_blocks(rng, (19, 512), qtype, 1.0)).matmul_nbits()
    w = BlockWeight.from_nbits(parts)
    if not packs(w):
        with pytest.raises(ValueError, match="blocks of 32"):
            q8_tiles(w)
        return
    x = rng.standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(q8_tiled_matmul(x, w), _emulate(x, w))


def test_bad_input_raises_before_writing():
    rng = np.random.default_rng(5)
    w = _weight(rng, 4, 32, 64, 20, 8, True)
    out = np.full((2, 20), 7.0, np.float32)
    with pytest.raises(DTypeError):
        q8_tiled_matmul(np.zeros((2, 64), np.float64), w, out)
    with pytest.raises(DTypeError):
        q8x2_tiled_matmul(np.zeros((2, 64), np.float64), w, out)
    with pytest.raises(ShapeError):
        q8x2_tiled_matmul(np.zeros((2, 63), np.float32), w, out)
    with pytest.raises(ShapeError):
        q8_tiled_matmul(np.zeros((2, 63), np.float32), w, out)
    with pytest.raises(ShapeError):
        q8_tiled_matmul(np.zeros((3, 64), np.float32), w, out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="blocks of 32"):
        q8_tiled_matmul(np.zeros((1, 64), np.float32), _weight(rng, 4, 16, 64, 3, 8, False))
    assert q8_tiled_matmul(np.empty((0, 64), np.float32), w).shape == (0, 20)
    # 8 bits in blocks of 16 pack only when the inputs fill blocks of 32
    odd = _weight(rng, 8, 16, 48, 3, 32, False)
    assert not packs(odd) and packs(_weight(rng, 8, 16, 64, 3, 32, False))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_tiles(odd)
    # the IR kernel's forms: halves take 8-bit codes only
    from pagedkv_np.backends.block_q8_tiles_ir import q8_tile_intrinsic
    for bits, halves in [(5, True), (4, True), (6, False)]:
        with pytest.raises(ValueError, match="Invalid tile"):
            q8_tile_intrinsic(bits, 1, False, halves=halves)


def _remainder(x: np.ndarray, block: int = 32) -> np.ndarray:
    """``x - d * float(q)`` of its int8 rounding per block, in float32."""
    m, k = x.shape
    q = np.empty((m, k), np.int8)
    d, dq, sums = (np.empty((m, k // block), np.float32) for _ in range(3))
    q8_quantize(x, 8, block, q, d, dq, sums)
    return x - (np.repeat(d, block, axis=1) * q.astype(np.float32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,zero,offsets", CASES)
def test_twice_rounded_rows_follow_the_order_in_any_batch(bits, zero, offsets, threads):
    """y(x) + y(x's remainder), each the documented order; a row's bits do not
    depend on its batch; far nearer the exact product than int8."""
    rng = np.random.default_rng(bits * 5 + offsets)
    w = _tile_weight(rng, bits, 160, 41, zero, offsets)
    x = (rng.standard_normal((5, 160)) * np.linspace(0.1, 4, 160)).astype(np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        got = q8x2_tiled_matmul(x, w)
        alone = np.stack([q8x2_tiled_matmul(x[i:i + 1], w)[0] for i in range(5)])
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(got, _emulate(x, w) + _emulate(_remainder(x, w.block_size), w))
    np.testing.assert_array_equal(alone, got)
    exact = x.astype(np.float64) @ _dequantized(w)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(_dequantized(w))
    int8_error = np.abs(q8_tiled_matmul(x, w) - exact).max()
    assert np.abs(got - exact).max() < int8_error / 20
    assert (np.abs(got - exact) <= 1e-3 * magnitude).all()
    assert (np.abs(block_matmul(x, w) - exact) <= 1e-5 * magnitude).all()


_NO_VNNI_SCRIPT = """
import sys
import numpy as np
from pagedkv_np.backends import block_q8_tiles_ir
from pagedkv_np.backends.block_gemv import BlockWeight, block_matmul
from pagedkv_np.backends.block_q8_tiles import q8_tiled_matmul
data = np.load(sys.argv[1])
outs = {}
for i in range(int(data["count"])):
    offs = data[f"offsets{i}"]
    w = BlockWeight(int(data[f"bits{i}"]), int(data[f"block{i}"]), 160, 41, data[f"codes{i}"],
                    data[f"zeros{i}"], data[f"scales{i}"], offs if offs.size else None)
    outs[f"out{i}"] = q8_tiled_matmul(data["x"], w)
np.savez(sys.argv[2], **outs)
print("vnni" if block_q8_tiles_ir.HAS_VNNI or block_q8_tiles_ir.HAS_VNNI_512 else "no vnni")
"""


@pytest.mark.parametrize("drop", [("avx512vnni",), ("avx512vnni", "avxvnni")])
def test_the_kernels_without_vnni_give_the_same_bits(tmp_path, drop):
    """Compiled in a process told that the CPU lacks 512-bit VNNI (then the
    256-bit form where the CPU has AVX-VNNI), or every VNNI (``maddubs``)."""
    from llvmlite import binding as llvm_binding

    rng = np.random.default_rng(12)
    x = rng.standard_normal((5, 160)).astype(np.float32)
    arrays, want = {"x": x, "count": np.int64(len(CASES))}, []
    for i, (bits, zero, offsets) in enumerate(CASES):
        w = _tile_weight(rng, bits, 160, 41, zero, offsets)
        arrays.update({f"bits{i}": np.int64(w.bits), f"block{i}": np.int64(w.block_size),
                       f"codes{i}": w.codes, f"zeros{i}": w.zeros,
                       f"scales{i}": w.scales,
                       f"offsets{i}": w.offsets if offsets else np.zeros(0, np.float32)})
        want.append(q8_tiled_matmul(x, w))
    np.savez(tmp_path / "in.npz", **arrays)
    features = llvm_binding.get_host_cpu_features()
    for name in drop:
        features[name] = False
    env = dict(os.environ, NUMBA_CPU_FEATURES=features.flatten(),
               PAGEDKV_NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _NO_VNNI_SCRIPT, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("vnni" if len(drop) == 1 and features.get("avxvnni")
                                   else "no vnni")
    got = np.load(tmp_path / "out.npz")
    for i, case in enumerate(CASES):
        np.testing.assert_array_equal(got[f"out{i}"], want[i], err_msg=str(case))
