"""block_matmul: products with a weight in quantized blocks match a float64
dequantize-then-matmul in NumPy for every bits x block size x zero point x
offset combination and for every ggml type as the GGUF importer lays it out;
a row's result is the same bits alone, in any batch, on any thread count; bad
input raises a typed error before any kernel runs."""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest

from pagedkv_np.errors import ConfigError, DTypeError, ShapeError
from pagedkv_np.backends.block_gemv import BlockWeight, block_matmul
from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized, NBits

from test_gguf_import import random_blocks

#: float32 error bound relative to sum |w| |x| per output (about 100 roundings
#: of 6e-8; the blocks are summed in order, at most 48 of them here)
RTOL = 1e-5


def _reference(x: np.ndarray, parts: NBits) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``x @ w`` and ``|x| @ |w|`` from the MatMulNBits parts, unpacked
    independently of the module under test."""
    n, nb, _ = parts.B.shape
    bs, bits = parts.block_size, parts.bits
    if bits == 8:
        codes = parts.B.astype(np.float64)
    else:
        codes = np.empty((n, nb, bs))
        codes[..., 0::2] = parts.B & 15
        codes[..., 1::2] = parts.B >> 4
    if parts.zero_points is None:
        zero = np.full((n, nb), 2.0 ** (bits - 1))
    else:
        zp = parts.zero_points.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)
        zero = zp[:, :nb].astype(np.float64)
    w = (codes - zero[..., None]) * parts.scales.reshape(n, nb, 1).astype(np.float64)
    w_abs = np.abs(w)
    if parts.offsets is not None:
        off = parts.offsets.T.astype(np.float64)[..., None]
        w, w_abs = w + off, w_abs + np.abs(off)
    w, w_abs = w.reshape(n, -1).T, w_abs.reshape(n, -1).T
    x64 = x.astype(np.float64)
    return x64 @ w, np.abs(x64) @ w_abs


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once: the product is exact in float64 and
    the float64 sum differs from the exact one by less than half a float64 ulp,
    which moves the float32 rounding only if it lands exactly on a float32
    midpoint (a chance of about 2**-29 per call; these tests' seeds have none)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _float32_order(x: np.ndarray, parts: NBits) -> np.ndarray:
    """The module's documented float32 arithmetic, step by step in NumPy."""
    n, nb, nbytes = parts.B.shape
    bs, bits = parts.block_size, parts.bits
    f32 = np.float32
    if parts.zero_points is None:
        zero = np.full((n, nb), 1 << (bits - 1), np.int32)
    else:
        zp = parts.zero_points.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)
        zero = zp[:, :nb].astype(np.int32)
    scales = parts.scales.reshape(n, nb)
    q = parts.B.astype(np.int32)
    lanes = np.zeros((2, x.shape[0], n, 8), f32)
    for b in range(nb):
        s, z = scales[:, b, None], zero[:, b, None]
        xs = x[:, None, b * bs:(b + 1) * bs]
        groups = []                    # (codes [n, 8], inputs [M, 1, 8]) in order
        for v in range(bs * bits // 64):
            qv = q[:, b, 8 * v:8 * v + 8]
            if bits == 8:
                groups.append((qv, xs[..., 8 * v:8 * v + 8]))
            else:
                groups.append((qv & 15, xs[..., 16 * v:16 * v + 16:2]))
                groups.append((qv >> 4, xs[..., 16 * v + 1:16 * v + 16:2]))
        for g, (codes, inputs) in enumerate(groups):
            w = s * (codes - z).astype(f32)
            lanes[g % 2] = _fma(w[None], inputs, lanes[g % 2])
    lanes = lanes[0] + lanes[1]
    width = 4
    while width:
        lanes[..., :width] = lanes[..., :width] + lanes[..., width:2 * width]
        width //= 2
    total = lanes[..., 0]
    if parts.offsets is not None:
        for b in range(nb):
            block_sum = f32(0.0) * x[:, 0]
            for i in range(bs):
                block_sum = block_sum + x[:, b * bs + i]
            total = total + block_sum[:, None] * parts.offsets[None, b, :]
    return total


def _random_parts(rng, bits, block_size, zero_points, offsets, k=96, n=37) -> NBits:
    nb = k // block_size
    b = rng.integers(0, 256, (n, nb, block_size * bits // 8), dtype=np.uint8)
    zp = None
    if zero_points:
        per_row = (nb * bits + 7) // 8
        zp = rng.integers(0, 256, n * per_row, dtype=np.uint8)
    return NBits(bits=bits, block_size=block_size, B=b,
                 scales=rng.uniform(-0.1, 0.1, n * nb).astype(np.float32),
                 zero_points=zp,
                 offsets=rng.standard_normal((nb, n)).astype(np.float32) if offsets else None)


def _check(x, parts, y):
    want, scale = _reference(x, parts)
    assert y.dtype == np.float32 and y.shape == want.shape
    assert np.all(np.abs(y - want) <= RTOL * scale + 1e-30)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_matches_float64_reference(bits, block_size, zero_points, offsets):
    rng = np.random.default_rng(bits * 100 + block_size + 2 * zero_points + offsets)
    parts = _random_parts(rng, bits, block_size, zero_points, offsets)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    _check(x, parts, block_matmul(x, parts))
    weight = BlockWeight.from_nbits(parts)
    _check(x, parts, block_matmul(x, weight))
    # one-hot rows read back every weight: codes, zero points, scales, offsets
    eye = np.eye(96, dtype=np.float32)
    want, _ = _reference(eye, parts)
    np.testing.assert_allclose(block_matmul(eye, weight), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_follows_the_documented_float32_order_bitwise(bits, block_size):
    rng = np.random.default_rng(bits + block_size)
    parts = _random_parts(rng, bits, block_size, True, True, k=128, n=29)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    np.testing.assert_array_equal(block_matmul(x, parts), _float32_order(x, parts))


@pytest.mark.parametrize("kind", sorted(BLOCK_KINDS))
def test_every_ggml_type_as_imported(kind):
    """The importer's parts of each ggml type against gguf's own dequantize."""
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, (40, 512), qtype, 1.0)
    parts = BlockQuantized(kind, raw).matmul_nbits()
    want = gguf.quants.dequantize(raw, qtype).T.astype(np.float64)   # [K, N]
    x = rng.standard_normal((3, 512)).astype(np.float32)
    y = block_matmul(x, parts)
    exact = x.astype(np.float64) @ want
    scale = np.abs(x.astype(np.float64)) @ np.abs(want)
    # the offset term's own rounding counts too: bound by the parts' |w| as well
    _, parts_scale = _reference(x, parts)
    assert np.all(np.abs(y - exact) <= RTOL * np.maximum(scale, parts_scale))


@pytest.mark.parametrize("bits,block_size,offsets", [(8, 32, False), (4, 32, True),
                                                      (8, 16, True), (4, 16, False)])
def test_rows_are_independent_of_the_batch(bits, block_size, offsets):
    """Row m of any batch is bitwise the row computed alone, on 1 or 2 threads."""
    rng = np.random.default_rng(11)
    parts = _random_parts(rng, bits, block_size, True, offsets, k=256, n=301)
    weight = BlockWeight.from_nbits(parts)
    x = rng.standard_normal((9, 256)).astype(np.float32) * 10 ** rng.uniform(-3, 3, (9, 1))
    x = x.astype(np.float32)
    alone = np.stack([block_matmul(x[m:m + 1], weight)[0] for m in range(9)])
    for m in range(1, 10):
        np.testing.assert_array_equal(block_matmul(x[:m], weight), alone[:m])
        np.testing.assert_array_equal(block_matmul(x[9 - m:], weight), alone[9 - m:])
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        np.testing.assert_array_equal(block_matmul(x, weight), alone)
    finally:
        numba.set_num_threads(before)
    out = np.full((9, 301), np.nan, np.float32)
    assert block_matmul(x, weight, out=out) is out
    np.testing.assert_array_equal(out, alone)


def test_empty_batch():
    parts = _random_parts(np.random.default_rng(0), 8, 32, False, False)
    y = block_matmul(np.zeros((0, 96), np.float32), parts)
    assert y.shape == (0, 37) and y.dtype == np.float32


def test_bad_input_raises_typed_errors_and_writes_nothing():
    parts = _random_parts(np.random.default_rng(0), 4, 32, True, True)
    weight = BlockWeight.from_nbits(parts)
    x = np.ones((2, 96), np.float32)
    out = np.full((2, 37), 7.0, np.float32)
    bad = [
        (DTypeError, x.astype(np.float64), None),
        (DTypeError, x.tolist(), None),
        (ShapeError, x[0], None),
        (ShapeError, np.ones((2, 64), np.float32), None),
        (ShapeError, np.ones((2, 96, 1), np.float32), None),
        (DTypeError, x, out.astype(np.float64)),
        (ShapeError, x, np.full((2, 36), 7.0, np.float32)),
        (ShapeError, x, np.full((37, 2), 7.0, np.float32).T),
    ]
    for error, xi, oi in bad:
        with pytest.raises(error):
            block_matmul(xi, weight, out=out if oi is None else oi)
        np.testing.assert_array_equal(out, 7.0)
    with pytest.raises(ConfigError):
        BlockWeight.from_nbits(NBits(2, 32, parts.B, parts.scales, None, None))
    with pytest.raises(ShapeError):
        BlockWeight.from_nbits(NBits(4, 32, parts.B, parts.scales[:-1], None, None))
    with pytest.raises(ShapeError):
        BlockWeight.from_nbits(NBits(4, 32, parts.B, parts.scales, None, parts.offsets.T))
    with pytest.raises(DTypeError):
        block_matmul(x, "not parts")
    with pytest.raises(ShapeError):      # rows the kernel would read past
        BlockWeight(4, 32, 96, 37, weight.codes[:, :-1], weight.zeros, weight.scales, None)
    with pytest.raises(ShapeError):
        BlockWeight(4, 32, 96, 37, weight.codes, weight.zeros,
                    np.asfortranarray(weight.scales), None)
    with pytest.raises(DTypeError):
        BlockWeight(8, 32, 96, 37, weight.codes.view(np.int8), weight.zeros, weight.scales,
                    None)
