"""q8_matmul: int8 activations against a weight in quantized blocks follow the
documented order bit for bit (a NumPy emulation written from the module
docstring), for random weights and every ggml type as the GGUF importer lays
it out, alone or in any batch, on 1 or 2 threads, on the AVX2 kernel and the
portable loops alike, called from Python or from a jitted function; stay
within the documented bound of a float64 product; bad input raises a typed
error before anything is written."""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_np.backends import block_q8
from pagedkv_np.backends.block_gemv import BlockWeight
from pagedkv_np.backends.block_q8 import (HAS_AVX2, q8_gemm, q8_gemm_portable, q8_matmul,
                                          q8_quantize)
from pagedkv_np.errors import DTypeError, ShapeError
from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized

from test_gguf_import import random_blocks


def _weight(rng, bits: int, block_size: int, k: int, n: int, zero, offsets: bool
            ) -> BlockWeight:
    """Random codes; ``zero`` an int for every block or ``"mixed"``."""
    nb = k // block_size
    top = (1 << bits) - 1
    codes = rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8)
    if zero == "mixed":
        zeros = rng.integers(0, top + 1, (n, nb), dtype=np.uint8)
    else:
        zeros = np.full((n, nb), zero, np.uint8)
    scales = (rng.random((n, nb), np.float32) * 0.02 + 1e-3).astype(np.float32)
    offs = (rng.standard_normal((n, nb)).astype(np.float32) * 0.05) if offsets else None
    return BlockWeight(bits, block_size, k, n, codes, zeros, scales, offs)


def _quantize_ref(x: np.ndarray, bits: int, block_size: int):
    """The module docstring's quantization, in NumPy: ``(q, d, dq, sums)`` with
    ``q`` in natural input order (int64)."""
    m, k = x.shape
    xb = x.reshape(m, k // block_size, block_size)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(xb / d[..., None])
    usable = (d > 0) & np.isfinite(d)
    ok = usable[..., None] & (r >= -127) & (r <= 127)
    q = np.where(ok, r, 0).astype(np.int64)
    dq = (d * q.sum(axis=2).astype(np.float32)).astype(np.float32)
    return q, d, dq, dq.copy()      # the offsets multiply dq too


def _codes_ref(w: BlockWeight) -> np.ndarray:
    """``[N, blocks, block_size]`` int64 codes in natural input order."""
    n, nb, bs = w.out_features, w.in_features // w.block_size, w.block_size
    if w.bits == 8:
        return w.codes.reshape(n, nb, bs).astype(np.int64)
    packed = w.codes.reshape(n, nb, bs // 2).astype(np.int64)
    codes = np.empty((n, nb, bs), np.int64)
    codes[..., 0::2] = packed & 15
    codes[..., 1::2] = packed >> 4
    return codes


def _signed_ref(w: BlockWeight) -> bool:
    """Whether ``w`` takes the signed path: 8 bits, block 32, every ``code -
    zero`` in -128..127."""
    if w.bits != 8 or w.block_size != 32:
        return False
    diff = _codes_ref(w) - w.zeros[..., None]
    return bool(((diff >= -128) & (diff <= 127)).all())


def _lanes_ref(bits: int, block_size: int, paired: bool, signed: bool = False) -> np.ndarray:
    """The lane of each natural input of a block (the docstring's lane map)."""
    i = np.arange(block_size)
    if signed:
        return i // 4
    if bits == 8:
        return i // 2 if block_size == 16 else (i // 2) % 8
    if paired:
        return i // 8
    pos = (i % 2) * (block_size // 2) + i // 2
    return pos // 2 if block_size == 16 else pos // 4


def _row_index_ref(bits: int, block_size: int, num_blocks: int) -> np.ndarray:
    """Where each natural input of a row goes in the quantized row."""
    b, i = np.divmod(np.arange(num_blocks * block_size), block_size)
    if bits == 8:
        return b * block_size + i
    paired = (block_size == 32) & (b < num_blocks // 2 * 2)
    return np.where(paired, b // 2 * 64 + (i % 2) * 32 + (b % 2) * 16 + i // 2,
                    b * block_size + (i % 2) * (block_size // 2) + i // 2)


def _tree(lanes: np.ndarray) -> np.ndarray:
    lanes = lanes.copy()
    for width in (4, 2, 1):
        lanes[..., :width] = lanes[..., :width] + lanes[..., width:2 * width]
    return lanes[..., 0]


def _emulate(x: np.ndarray, w: BlockWeight) -> np.ndarray:
    """The documented float32 order, one operation per step."""
    q, d, dq, sums = _quantize_ref(x, w.bits, w.block_size)
    m, n, nb = x.shape[0], w.out_features, d.shape[1]
    signed = _signed_ref(w)
    zs = (w.scales * w.zeros.astype(np.float32)).astype(np.float32)        # [N, nb]
    minus = (zs[None] * dq[:, None]).astype(np.float32)                     # [M, N, nb]
    if signed:                           # the zero point is in the codes
        minus = np.zeros_like(minus)
    if w.offsets is not None:
        e = (w.offsets[None] * sums[:, None]).astype(np.float32) - minus
    else:
        e = -minus
    terms = np.zeros((m, n, 8), np.float32)
    for g in range(nb // 8):
        terms = (terms + e[..., 8 * g:8 * g + 8]).astype(np.float32)
    tail = np.zeros((m, n), np.float32)
    for b in range(nb // 8 * 8, nb):
        tail = (tail + e[..., b]).astype(np.float32)
    codes = _codes_ref(w) - (w.zeros[..., None] if signed else 0)
    prod = codes[None] * q[:, None]                                         # [M, N, nb, bs]
    acc = np.zeros((m, n, 8), np.float32)
    for b in range(nb):
        paired = w.bits == 4 and w.block_size == 32 and b < nb // 2 * 2
        lane = _lanes_ref(w.bits, w.block_size, paired, signed)
        p = np.zeros((m, n, 8), np.int64)
        for i in range(w.block_size):
            p[..., lane[i]] += prod[:, :, b, i]
        sd = (w.scales[None, :, b] * d[:, None, b]).astype(np.float32)[..., None]
        if paired:                       # block 2p: lanes 0-3, block 2p + 1: lanes 4-7
            at = slice(4 * (b % 2), 4 * (b % 2) + 4)
            acc[..., at] = acc[..., at] + sd * p[..., :4].astype(np.float32)
        else:
            acc = (acc + sd * p.astype(np.float32)).astype(np.float32)
    if signed and w.offsets is None:     # no block terms at all
        return _tree(acc)
    return ((_tree(acc) + _tree(terms)).astype(np.float32) + tail).astype(np.float32)


def _quantized(x: np.ndarray, w: BlockWeight):
    nb = w.in_features // w.block_size
    q = np.empty(x.shape, np.int8)
    d, dq, sums = (np.empty((x.shape[0], nb), np.float32) for _ in range(3))
    q8_quantize(x, w.bits, w.block_size, q, d, dq, sums)
    return q, d, dq, sums


CASES = [(bits, bs, zero, off)
         for bits, zeros in ((4, (0, 8, "mixed")), (8, (128, 0, "mixed")))
         for bs in (16, 32) for zero in zeros for off in (False, True)]


@pytest.mark.parametrize("bits,block_size,zero,offsets", CASES)
@pytest.mark.parametrize("k", [32, 96, 576])
def test_follows_the_documented_order_bitwise(bits, block_size, zero, offsets, k):
    rng = np.random.default_rng(k * 7 + bits)
    w = _weight(rng, bits, block_size, k, 37, zero, offsets)
    for m in (1, 3, 4, 5, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :block_size] = 0                     # a block of zeros: d = 0, q = 0
        np.testing.assert_array_equal(q8_matmul(x, w), _emulate(x, w))


@pytest.mark.parametrize("offsets", [False, True])
def test_signed_path_only_where_every_code_minus_zero_fits_int8(offsets):
    """8 bits, block 32: the extremes -128 and 127 against q = +-127 (a pair of
    2 * 128 * 127 must not saturate), and a weight with one code out of range
    taking the unsigned path as a whole."""
    rng = np.random.default_rng(9)
    k, n = 160, 13
    w = _weight(rng, 8, 32, k, n, "mixed", offsets)
    zeros = rng.integers(0, 256, w.zeros.shape, dtype=np.uint8)
    low = np.repeat(zeros.astype(np.int64) - 128, 32, axis=1).clip(0, 255)
    high = np.repeat(zeros.astype(np.int64) + 127, 32, axis=1).clip(0, 255)
    codes = rng.integers(low, high + 1).astype(np.uint8)
    codes[0, :32] = 0                    # zero 128: -128 throughout the block
    codes[1, :32] = 255                  # zero 128: 127
    zeros[:2, 0] = 128
    fits = BlockWeight(8, 32, k, n, codes, zeros, w.scales, w.offsets)
    assert _signed_ref(fits)
    codes = codes.copy()
    codes[5, 70], zeros[5, 2] = 255, 0   # 255 - 0 does not fit
    unfit = BlockWeight(8, 32, k, n, codes, zeros.copy(), w.scales, w.offsets)
    assert not _signed_ref(unfit)
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[0, :32] = 1.0                      # q = 127 throughout the block
    x[1, :32] = -1.0
    x[2, :32] = np.where(np.arange(32) % 2, 1.0, -1.0)
    for weight in (fits, unfit):
        np.testing.assert_array_equal(q8_matmul(x, weight), _emulate(x, weight))
    # no saturation: block 0 alone, codes -128 (output 0) and 127 (output 1)
    only = x[:2].copy()
    only[:, 32:] = 0
    y = q8_matmul(only, BlockWeight(8, 32, k, n, fits.codes, fits.zeros, fits.scales, None))
    d = 1 / 127
    for out, w_code in ((0, -128), (1, 127)):
        want = fits.scales[out, 0] * d * w_code * 127 * 32
        assert y[0, out] == pytest.approx(want, rel=1e-6)
        assert y[1, out] == pytest.approx(-want, rel=1e-6)


def test_quantized_row_layout():
    rng = np.random.default_rng(1)
    k = 96                                   # block 32: a pair, then a block alone
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, :16] = np.clip(x[1, :16], -1, 1)
    x[1, 0], x[1, 5], x[1, 7] = 127, 2.5, -3.5     # d = 1: ties round to even
    for bits in (4, 8):
        for bs in (16, 32):
            nb = k // bs
            q, d, dq, sums = _quantized(x, BlockWeight(bits, bs, k, 1, np.zeros(
                (1, k * bits // 8), np.uint8), np.zeros((1, nb), np.uint8),
                np.ones((1, nb), np.float32), None))
            want, want_d, want_dq, want_sums = _quantize_ref(x, bits, bs)
            natural = q[:, _row_index_ref(bits, bs, nb)]
            np.testing.assert_array_equal(natural, want.reshape(3, k))
            assert (natural[1, 5], natural[1, 7], d[1, 0]) == (2, -4, 1)
            np.testing.assert_array_equal(d, want_d)
            np.testing.assert_array_equal(dq, want_dq)
            np.testing.assert_array_equal(sums, want_sums)
            assert np.abs(q).max() == 127


@pytest.mark.parametrize("bits,block_size,zero,offsets", CASES[::3])
def test_matches_float64_within_the_documented_bound(bits, block_size, zero, offsets):
    rng = np.random.default_rng(5)
    k, n = 192, 29
    w = _weight(rng, bits, block_size, k, n, zero, offsets)
    x = (rng.standard_normal((5, k)) * np.exp(rng.standard_normal((5, k)))).astype(np.float32)
    core = (_codes_ref(w) - w.zeros[..., None]) * w.scales[..., None].astype(np.float64)
    dense = core + (0 if w.offsets is None else w.offsets[..., None])
    dense = dense.reshape(n, k)
    want = x.astype(np.float64) @ dense.T
    q, d, _, _ = _quantize_ref(x, bits, block_size)
    # rounding x: at most d_b / 2 per input (plus its own float32 roundings)
    bound = 0.5001 * np.einsum("mb,nb->mn", d.astype(np.float64),
                               np.abs(core).sum(axis=2))
    bound += 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
    # float32 roundings of both sides of the zero point
    sides = np.einsum("nbi,mbi->mnb", _codes_ref(w).astype(np.float64), np.abs(q)) \
        + w.zeros[None].astype(np.float64) * np.abs(q.sum(axis=2))[:, None]
    bound += 1e-5 * np.einsum("mnb,nb,mb->mn", sides, w.scales.astype(np.float64), d)
    err = np.abs(q8_matmul(x, w) - want)
    assert np.all(err <= bound)


@pytest.mark.parametrize("bits,block_size,offsets", [(4, 32, True), (4, 32, False),
                                                     (4, 16, True), (8, 32, False),
                                                     (8, 16, True)])
def test_rows_are_independent_of_the_batch_and_threads(bits, block_size, offsets):
    rng = np.random.default_rng(2)
    w = _weight(rng, bits, block_size, 160, 53, "mixed", offsets)
    x = rng.standard_normal((11, 160)).astype(np.float32)
    batch = q8_matmul(x, w)
    for m in range(11):
        np.testing.assert_array_equal(q8_matmul(x[m:m + 1], w)[0], batch[m])
    for size in (2, 3, 5):
        np.testing.assert_array_equal(q8_matmul(x[3:3 + size], w), batch[3:3 + size])
    before = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            np.testing.assert_array_equal(q8_matmul(x, w), batch)
    finally:
        numba.set_num_threads(before)


@pytest.mark.skipif(not HAS_AVX2, reason="the AVX2 kernel needs an AVX2 host")
@pytest.mark.parametrize("bits,block_size,zero,offsets", CASES)
def test_avx2_and_portable_agree_bitwise(bits, block_size, zero, offsets):
    rng = np.random.default_rng(3)
    # 160 inputs: blocks of 32, two pairs and one alone; of 16, a group of 8 and 2
    w = _weight(rng, bits, block_size, 160, 41, zero, offsets)
    x = rng.standard_normal((7, 160)).astype(np.float32)
    q, d, dq, sums = _quantized(x, w)
    offs = w.offsets if w.offsets is not None else np.zeros((41, 0), np.float32)
    fast, slow = np.empty((7, 41), np.float32), np.empty((7, 41), np.float32)
    for signed in {False, _signed_ref(w)}:
        for chunks in (1, 5, 41):
            q8_gemm(q, d, dq, sums, w.codes, w.zeros, w.scales, offs, bits, block_size, signed,
                    chunks, fast)
            q8_gemm_portable(q, d, dq, sums, w.codes, w.zeros, w.scales, offs, bits, block_size,
                             signed, chunks, slow)
            np.testing.assert_array_equal(fast, slow)


_NO_VNNI_SCRIPT = """
import sys
import numpy as np
from pagedkv_np.backends import block_q8, block_q8_ir
from pagedkv_np.backends.block_gemv import BlockWeight
# the weights' own arrays, not their compact forms (the same bits, tested
# apart): every case then takes one type signature, compiled once here
block_q8._USE_COMPACT = False
from pagedkv_np.backends.block_q8 import q8_matmul
data = np.load(sys.argv[1])
outs = {}
for i in range(int(data["count"])):
    offs = data[f"offsets{i}"]
    w = BlockWeight(int(data[f"bits{i}"]), int(data[f"bs{i}"]), 160, 41, data[f"codes{i}"],
                    data[f"zeros{i}"], data[f"scales{i}"], offs if offs.size else None)
    outs[f"out{i}"] = q8_matmul(data["x"], w)
np.savez(sys.argv[2], **outs)
print("vnni" if block_q8_ir.HAS_VNNI else "no vnni")
"""


@pytest.mark.skipif(not HAS_AVX2, reason="the AVX2 kernel needs an AVX2 host")
def test_vnni_and_avx2_byte_dots_agree_bitwise(tmp_path):
    """The kernels compiled for this CPU against the same kernels compiled
    without VNNI (``vpdpbusd``), in a process told that the CPU lacks it."""
    import os
    import subprocess
    import sys

    from llvmlite import binding as llvm_binding

    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 160)).astype(np.float32)
    arrays, want = {"x": x, "count": np.int64(len(CASES))}, []
    for i, (bits, block_size, zero, offsets) in enumerate(CASES):
        w = _weight(rng, bits, block_size, 160, 41, zero, offsets)
        arrays.update({f"bits{i}": np.int64(bits), f"bs{i}": np.int64(block_size),
                       f"codes{i}": w.codes, f"zeros{i}": w.zeros, f"scales{i}": w.scales,
                       f"offsets{i}": w.offsets if offsets else np.zeros(0, np.float32)})
        want.append(q8_matmul(x, w))
    np.savez(tmp_path / "in.npz", **arrays)
    features = llvm_binding.get_host_cpu_features()
    features["avx512vnni"] = features["avxvnni"] = False
    env = dict(os.environ, NUMBA_CPU_FEATURES=features.flatten(),
               PAGEDKV_NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _NO_VNNI_SCRIPT, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no vnni"
    got = np.load(tmp_path / "out.npz")
    for i, case in enumerate(CASES):
        np.testing.assert_array_equal(got[f"out{i}"], want[i], err_msg=str(case))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6), blocks=st.integers(1, 20),
       bits=st.sampled_from([4, 8]), block_size=st.sampled_from([16, 32]),
       offsets=st.booleans(), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_random_shapes_and_magnitudes_follow_the_order(seed, m, blocks, bits, block_size,
                                                       offsets, scale):
    rng = np.random.default_rng(seed)
    k = blocks * block_size
    w = _weight(rng, bits, block_size, k, 9, "mixed", offsets)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0
    np.testing.assert_array_equal(q8_matmul(x, w), _emulate(x, w))


@pytest.mark.parametrize("tiled", [False, True])
def test_non_finite_input_gives_non_finite_outputs_of_its_row_only(tiled):
    """Both int8 kernels: the per-output one and the tiles of :mod:`.block_q8_tiles`."""
    from pagedkv_np.backends.block_q8_tiles import q8_tiled_matmul

    product = q8_tiled_matmul if tiled else q8_matmul
    rng = np.random.default_rng(4)
    w = _weight(rng, 4, 32, 64, 20, 8, True)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 3] = np.nan
    x[2, 40] = np.inf
    got = product(x, w)
    assert np.isfinite(got[0]).all() and not np.isfinite(got[1:]).any()
    np.testing.assert_array_equal(got[0], product(x[:1], w)[0])


def test_empty_batch():
    w = _weight(np.random.default_rng(0), 4, 32, 64, 5, 8, False)
    assert q8_matmul(np.empty((0, 64), np.float32), w).shape == (0, 5)


def test_bad_input_raises_typed_errors_and_writes_nothing():
    w = _weight(np.random.default_rng(0), 4, 32, 64, 5, 8, True)
    x = np.ones((2, 64), np.float32)
    out = np.full((2, 5), 7, np.float32)
    bad = [
        (DTypeError, dict(x=x.astype(np.float64))),
        (DTypeError, dict(x=x.tolist())),
        (ShapeError, dict(x=np.ones((2, 32), np.float32))),
        (ShapeError, dict(x=np.ones(64, np.float32))),
        (DTypeError, dict(out=np.zeros((2, 5), np.float64))),
        (ShapeError, dict(out=np.zeros((2, 6), np.float32))),
        (ShapeError, dict(out=np.zeros((5, 2), np.float32).T)),
    ]
    for error, kwargs in bad:
        args = dict(x=x, out=out) | kwargs
        before = args["out"].copy()
        with pytest.raises(error):
            q8_matmul(args["x"], w, out=args["out"])
        np.testing.assert_array_equal(args["out"], before)
        np.testing.assert_array_equal(out, 7)
    frozen = np.zeros((2, 5), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ShapeError):
        q8_matmul(x, w, out=frozen)
    with pytest.raises(DTypeError):
        q8_matmul(x, object())


@numba.njit
def _jitted_caller(x, codes, zeros, scales, offsets, bits, block_size, signed, out):
    """What a jitted decode loop does once per layer: quantize, then multiply."""
    nb = x.shape[1] // block_size
    q = np.empty(x.shape, np.int8)
    d = np.empty((x.shape[0], nb), np.float32)
    dq = np.empty((x.shape[0], nb), np.float32)
    sums = np.empty((x.shape[0], nb), np.float32)
    q8_quantize(x, bits, block_size, q, d, dq, sums)
    q8_gemm(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed,
            min(codes.shape[0], 8), out)


@pytest.mark.parametrize("offsets", [False, True])
def test_callable_from_a_jitted_function(offsets):
    rng = np.random.default_rng(6)
    w = _weight(rng, 4, 32, 96, 23, 8, offsets)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    out = np.empty((3, 23), np.float32)
    offs = w.offsets if w.offsets is not None else np.zeros((23, 0), np.float32)
    # signed passed in, as a decode loop has it: a constant False would type
    # as a literal and compile q8_gemm once more for this test alone
    _jitted_caller(x, w.codes, w.zeros, w.scales, offs, 4, 32, False, out)
    np.testing.assert_array_equal(out, q8_matmul(x, w))


@pytest.mark.parametrize("kind", sorted(BLOCK_KINDS))
def test_every_ggml_type_as_imported_follows_the_order(kind):
    """The importer's MatMulNBits parts of each ggml type, passed as they come."""
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    rng = np.random.default_rng(8)
    parts = BlockQuantized(kind, random_blocks(rng, (19, 512), qtype, 1.0)).matmul_nbits()
    w = BlockWeight.from_nbits(parts)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    got = q8_matmul(x, parts)
    np.testing.assert_array_equal(got, _emulate(x, w))
    np.testing.assert_array_equal(got, q8_matmul(x, w))


def _halved(w: BlockWeight) -> BlockWeight:
    """``w`` with scales and offsets rounded to values float16 holds exactly."""
    offs = None if w.offsets is None else w.offsets.astype(np.float16).astype(np.float32)
    return BlockWeight(w.bits, w.block_size, w.in_features, w.out_features, w.codes, w.zeros,
                       w.scales.astype(np.float16).astype(np.float32), offs)


@pytest.mark.parametrize("bits,block_size,zero,offsets", CASES)
def test_compact_form_gives_the_float32_forms_bits(bits, block_size, zero, offsets):
    """float16 scales and offsets and a constant zero point as one repeated row
    give the bits of the float32 arrays, on the AVX2 kernel and the portable
    loops; q8_matmul takes float16 for 8 bits only, and a weight whose scales
    float16 cannot hold keeps float32."""
    rng = np.random.default_rng(10)
    w = _halved(_weight(rng, bits, block_size, 160, 41, zero, offsets))
    x = rng.standard_normal((7, 160)).astype(np.float32)
    got = q8_matmul(x, w)
    np.testing.assert_array_equal(got, _emulate(x, w))
    try:
        block_q8._USE_COMPACT = False
        np.testing.assert_array_equal(q8_matmul(x, w), got)
    finally:
        block_q8._USE_COMPACT = True
    compact = block_q8._compact(w)
    assert (compact is not None) == (zero != "mixed" or bits == 8)
    if compact is not None:
        assert compact[0].strides[0] == (0 if zero != "mixed" else w.zeros.strides[0])
        assert compact[1].dtype == (np.uint16 if bits == 8 else np.float32)
    zeros = np.lib.stride_tricks.as_strided(w.zeros[:1].copy(), w.zeros.shape, (0, 1)) \
        if zero != "mixed" else w.zeros
    scales = block_q8._as_halves(w.scales)
    offs = block_q8._as_halves(w.offsets) if offsets else np.zeros((41, 0), np.float32)
    q, d, dq, sums = _quantized(x, w)
    kernels = [q8_gemm_portable] + ([q8_gemm] if HAS_AVX2 else [])
    for kernel in kernels:
        y = np.empty((7, 41), np.float32)
        kernel(q, d, dq, sums, w.codes, zeros, scales, offs, bits, block_size, _signed_ref(w),
               5, y)
        np.testing.assert_array_equal(y, got)
    plain = _weight(rng, bits, block_size, 160, 41, zero, offsets)
    plain.scales[0, 0] = np.float32(1 / 3)   # not a float16
    assert block_q8._as_halves(plain.scales) is None
    compact = block_q8._compact(plain)
    assert compact is None or compact[1] is plain.scales
    np.testing.assert_array_equal(q8_matmul(x, plain), _emulate(x, plain))


def test_half_bits_widen_every_float16_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.array([block_q8._half_bits(b) for b in bits], np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()
