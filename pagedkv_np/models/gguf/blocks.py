"""Linear-layer weights kept in ggml's quantized blocks, and their MatMulNBits form.

Every ggml type this module reads decodes, per sub-block of ``sub``
consecutive inputs of one output row, to ``w = scale * (u - zero) + offset``
with unsigned codes ``u``, a float ``scale`` per sub-block, a ``zero``
fixed by the type and an ``offset`` per sub-block (only the ``_1`` and most
K types have one). That is onnxruntime's ``com.microsoft.MatMulNBits``
(codes, scales, integer zero points) plus, for an offset, a block-sum term:
``x @ w = MatMulNBits(x; u, scale, zero) + blocksum(x) @ OFFSET`` with
``OFFSET[b, n]`` the offset of sub-block ``b`` of output ``n`` and
``blocksum`` the sum of each run of ``sub`` inputs. Both are exact (float32
arithmetic on the file's values); an integer zero point cannot carry an
offset, and a float zero point dequantizes the whole weight on every call.

=====  ======  =======  ====  ==========================  =====  ===  ======
type   bytes   weights  sub   ``scale``                   code   u0   offset
=====  ======  =======  ====  ==========================  =====  ===  ======
Q4_0   18      32       32    d                           4      8    -
Q4_1   20      32       32    d                           4      0    m
Q5_0   22      32       32    d                           5 (8)  16   -
Q5_1   24      32       32    d                           5 (8)  0    m
Q8_0   34      32       32    d                           8      128  -
Q2_K   84      256      16    d * (sc & 15)               2 (4)  0    -dmin * (sc >> 4)
Q3_K   110     256      16    d * (sc6 - 32)              3 (4)  4    -
Q4_K   144     256      32    d * sc6                     4      0    -dmin * m6
Q5_K   176     256      32    d * sc6                     5 (8)  0    -dmin * m6
Q6_K   210     256      16    d * sc8 (int8)              6 (8)  32   -
=====  ======  =======  ====  ==========================  =====  ===  ======

("code" is the bits a value takes, in brackets the MatMulNBits ``bits`` it
runs as; ``sc6``/``m6`` are the K types' 6-bit scales and mins, packed 8 + 8
in 12 bytes; ``d``, ``dmin`` and ``m`` are float16.) Layouts as in ggml's
``ggml-common.h``; every decoder here is checked against
``gguf.quants.dequantize`` in ``tests/test_gguf_types.py``.

Why each type runs as it does: ``scripts/bench_gguf_types.py``, a 2048 x
2048 weight of random blocks, one thread, milliseconds (best of 50 calls at
M = 1 row of activations, best of 10 at M = 32), onnxruntime 1.32 on this
2-core machine under load (load average 12, 2026-12-01)::

    layer                      M=1 acc0  acc4    M=32 acc0  acc4
    float32 MatMul               1.18               9.8
    Q4_0 4-bit / 32              0.81    0.17       9.0     3.5
    Q4_1 4-bit / 32 + sums       1.02    0.23       9.3     8.0
    Q4_K 4-bit / 32 + sums       1.02    0.23       9.2     8.2
    Q3_K 4-bit / 16              0.96    0.26       9.3    12.2
    Q2_K 4-bit / 16 + sums       1.16    0.30       5.5     9.2
    Q5_0 8-bit / 32             56.9     0.19      62.0     5.3
    Q5_1 8-bit / 32 + sums      45.6     0.22      69.1    10.0
    Q5_K 8-bit / 32 + sums      42.5     0.21      44.5     5.7
    Q6_K 8-bit / 16             33.8     0.27     112.0    15.4
    Q8_0 8-bit / 32             43.2     0.19      48.1     9.5

(An earlier run: float32 2.4 ms, 8-bit at level 0 56-78 ms; 2-bit
MatMulNBits, tried for Q2_K, 23-68 ms at either level.) So codes of 4 bits
or fewer (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K) run as 4-bit MatMulNBits at any
level, at float32's speed or better with a seventh of its bytes (Q2_K's and
Q3_K's codes widened to 4 bits: onnxruntime's 2-bit kernels are slow), and
the 5-8-bit types run as 8-bit MatMulNBits only with int8 activations
(:func:`~pagedkv_np.models.gguf.reader.kept_blocks`); at level 0 they are
dequantized to float32, which is exact and 30-50x faster than 8-bit there.
(Two 4-bit MatMulNBits of the low and high nibbles would carry an 8-bit
code exactly at level 0 with a quarter of float32's bytes, but took 2.7 ms
against float32's 1.2 in a first trial.)

ggml stores a 4-bit block as ``low nibbles = first half, high nibbles =
second half``; MatMulNBits packs consecutive codes in a byte (low nibble
first), so codes are decoded to element order and packed again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError, DTypeError, ShapeError

__all__ = ["BLOCK_KINDS", "BLOCK_SIZE", "BlockKind", "BlockQuantized", "NBits",
           "concat_nbits"]

#: inputs per block of the ``_0``/``_1`` types (the K types' sub-blocks are 16 or 32)
BLOCK_SIZE = 32


@dataclass(frozen=True)
class BlockKind:
    """One ggml type's block: ``nbytes`` bytes hold ``nweights`` weights in
    sub-blocks of ``sub``, codes of ``code_bits`` bits run as ``bits``-bit
    MatMulNBits with zero point ``zero``; ``offset``: sub-blocks have one."""

    nbytes: int
    nweights: int
    sub: int
    code_bits: int
    bits: int
    zero: int
    offset: bool


#: the ggml types kept as blocks, by lower-case ggml name
BLOCK_KINDS = {
    "q4_0": BlockKind(18, 32, 32, 4, 4, 8, False),
    "q4_1": BlockKind(20, 32, 32, 4, 4, 0, True),
    "q5_0": BlockKind(22, 32, 32, 5, 8, 16, False),
    "q5_1": BlockKind(24, 32, 32, 5, 8, 0, True),
    "q8_0": BlockKind(34, 32, 32, 8, 8, 128, False),
    "q2_k": BlockKind(84, 256, 16, 2, 4, 0, True),
    "q3_k": BlockKind(110, 256, 16, 3, 4, 4, False),
    "q4_k": BlockKind(144, 256, 32, 4, 4, 0, True),
    "q5_k": BlockKind(176, 256, 32, 5, 8, 0, True),
    "q6_k": BlockKind(210, 256, 16, 6, 8, 32, False),
}


@dataclass(frozen=True, eq=False)
class NBits:
    """A weight as MatMulNBits inputs (and its block-sum term).

    Attributes
    ----------
    bits, block_size : int
        MatMulNBits' attributes.
    B : ndarray, shape [N, K // block_size, block_size * bits // 8], uint8
    scales : ndarray, shape [N * (K // block_size)], float32
    zero_points : ndarray or None, uint8
        Packed as B, shape [N * ceil(K // block_size * bits / 8)]; None for
        MatMulNBits' default ``2 ** (bits - 1)``.
    offsets : ndarray or None, shape [K // block_size, N], float32
        The block-sum term's matrix (None: no offsets).
    """

    bits: int
    block_size: int
    B: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    offsets: np.ndarray | None


def concat_nbits(parts: list[NBits]) -> NBits | None:
    """One weight computing ``parts``' outputs side by side, or None where
    they differ in input size, block size, bits (8 only: one zero point a
    block) or in having offsets. A part without zero points gets its
    default ``128`` written out, so 8-bit kinds of other zeros (Q5_0's 16,
    Q8_0's 128) share one weight."""
    first = parts[0]
    nbs = {p.B.shape[1] for p in parts}
    if len(nbs) != 1 or any(p.bits != 8 or p.block_size != first.block_size
                            or (p.offsets is None) != (first.offsets is None) for p in parts):
        return None
    zero_points = None
    if any(p.zero_points is not None for p in parts):
        zero_points = np.concatenate([
            p.zero_points if p.zero_points is not None else
            np.full(p.B.shape[0] * p.B.shape[1], 128, np.uint8) for p in parts])
    offsets = None if first.offsets is None else np.concatenate(
        [p.offsets for p in parts], axis=1)      # type: ignore[misc]
    return NBits(8, first.block_size, np.concatenate([p.B for p in parts]),
                 np.concatenate([p.scales for p in parts]), zero_points, offsets)


def _f16(b: np.ndarray, start: int) -> np.ndarray:
    """float32 [...]: the float16 at bytes ``start:start + 2`` of every block."""
    return np.ascontiguousarray(b[..., start:start + 2]).view(np.float16)[..., 0] \
        .astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit halves: low nibbles are the first half, high nibbles the second."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit ``e`` of the little-endian bytes ``qh``, as uint8 0/1 [..., 8 * bytes]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins from 12 bytes [..., 12]."""
    lo, hi = s[..., 0:4], s[..., 4:8]
    tail = s[..., 8:12]
    sc = np.concatenate([lo & 63, (tail & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K: sixteen 6-bit scales (minus 32) from 12 bytes [..., 12]."""
    a, b, t = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    six = np.concatenate([(a & 15) | ((t & 3) << 4), (b & 15) | (((t >> 2) & 3) << 4),
                          (a >> 4) | (((t >> 4) & 3) << 4), (b >> 4) | ((t >> 6) << 4)],
                         axis=-1)
    return six.astype(np.float32) - 32.0


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: 64 bytes hold two runs of 128 codes; code ``j*32 + l``
    of a run is bits ``2j, 2j+1`` of byte ``l`` of the run's 32 bytes."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    shifts = np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)
    return ((runs >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def _decode(kind: str, blk: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes uint8 [..., nweights], scales and offsets float32 [..., nweights // sub]
    of blocks ``blk`` uint8 [..., nbytes]."""
    if kind == "q4_0":
        return _nibbles(blk[..., 2:]), _f16(blk, 0)[..., None], None
    if kind == "q4_1":
        return _nibbles(blk[..., 4:]), _f16(blk, 0)[..., None], _f16(blk, 2)[..., None]
    if kind in ("q5_0", "q5_1"):
        at = 2 if kind == "q5_0" else 4
        u = _nibbles(blk[..., at + 4:]) | (_high_bits(blk[..., at:at + 4]) << 4)
        return u, _f16(blk, 0)[..., None], None if at == 2 else _f16(blk, 2)[..., None]
    if kind == "q8_0":
        return blk[..., 2:] ^ np.uint8(128), _f16(blk, 0)[..., None], None
    if kind == "q2_k":
        sc = blk[..., 0:16]
        scale = _f16(blk, 80)[..., None] * (sc & 15).astype(np.float32)
        offset = -(_f16(blk, 82)[..., None] * (sc >> 4).astype(np.float32))
        return _crumbs(blk[..., 16:80]), scale, offset
    if kind == "q3_k":
        hbit = _high_bits(blk[..., 0:32]).reshape(*blk.shape[:-1], 32, 8)  # [l, bit]
        high = np.moveaxis(hbit, -1, -2).reshape(*blk.shape[:-1], 256)     # bit*32 + l
        u = _crumbs(blk[..., 32:96]) | (high << 2)
        return u, _f16(blk, 108)[..., None] * _q3_scales(blk[..., 96:108]), None
    if kind in ("q4_k", "q5_k"):
        sc, mn = _k_scales(blk[..., 4:16])
        qs = blk[..., 16:144] if kind == "q4_k" else blk[..., 48:176]
        quads = qs.reshape(*qs.shape[:-1], 4, 32)
        u = np.stack([quads & 15, quads >> 4], axis=-2)                     # [4, 2, 32]
        if kind == "q5_k":
            bits = _high_bits(blk[..., 16:48]).reshape(*blk.shape[:-1], 32, 8)
            u = u | (np.moveaxis(bits, -1, -2).reshape(u.shape) << 4)
        u = u.reshape(*qs.shape[:-1], 256)
        return u, _f16(blk, 0)[..., None] * sc, -(_f16(blk, 2)[..., None] * mn)
    # q6_k: two runs of 128; code k*32 + l of a run: low nibble of ql byte
    # l (k = 0, 2: low, 1, 3: high nibble) of ql half k % 2, top 2 bits from qh bits 2k
    ql = blk[..., 0:128].reshape(*blk.shape[:-1], 2, 2, 32)                 # [run, half, l]
    qh = blk[..., 128:192].reshape(*blk.shape[:-1], 2, 1, 32)
    low = np.stack([ql & 15, ql >> 4], axis=-3)                             # [run, nib, half, l]
    low = low.reshape(*blk.shape[:-1], 2, 4, 32)                            # k = 2 * nib + half
    high = (qh >> np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)) & 3     # [run, k, l]
    u = (low | (high << 4)).reshape(*blk.shape[:-1], 256)
    sc = blk[..., 192:208].view(np.int8).astype(np.float32)
    return u, _f16(blk, 208)[..., None] * sc, None


def _pack(u: np.ndarray, bits: int) -> np.ndarray:
    """Codes uint8 [..., n] packed as MatMulNBits packs them (low bits first)."""
    if bits == 8:
        return np.ascontiguousarray(u)
    return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << 4))


@dataclass(frozen=True, eq=False)
class BlockQuantized:
    """A linear layer's weight in ggml blocks (see the module docstring).

    Attributes
    ----------
    kind : str
        A key of :data:`BLOCK_KINDS` (``"q4_0"``, ``"q4_k"``, ``"q6_k"``, ...).
    blocks : ndarray, shape [out_features, in_features // nweights * nbytes], uint8
        One row per output, as a GGUF file stores the tensor.
    """

    kind: str
    blocks: np.ndarray

    def __post_init__(self) -> None:
        spec = BLOCK_KINDS.get(self.kind)
        if spec is None:
            raise ConfigError(f"Invalid kind: expected one of {sorted(BLOCK_KINDS)}, "
                              f"got {self.kind!r}")
        b = self.blocks
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 2:
            raise DTypeError(f"Invalid blocks: expected a 2-D uint8 array, got {b!r:.80}")
        if b.shape[1] % spec.nbytes or b.shape[1] == 0:
            raise ShapeError(f"Invalid blocks: rows of {b.shape[1]} bytes are not whole "
                             f"{self.kind} blocks of {spec.nbytes} bytes")

    @property
    def spec(self) -> BlockKind:
        return BLOCK_KINDS[self.kind]

    @property
    def shape(self) -> tuple[int, int]:
        """``(in_features, out_features)``, as a float weight's shape."""
        s = self.spec
        return (self.blocks.shape[1] // s.nbytes * s.nweights, self.blocks.shape[0])

    def decode(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Codes, scales and offsets by output row.

        Returns
        -------
        u : ndarray, shape [out_features, in_features // sub, sub], uint8
            Codes in element order, ``0 <= u < 2 ** code_bits``.
        scale : ndarray, shape [out_features, in_features // sub], float32
        offset : ndarray of the same shape, or None
        """
        s = self.spec
        n = self.blocks.shape[0]
        u, scale, offset = _decode(self.kind, self.blocks.reshape(n, -1, s.nbytes))
        sub_shape = (n, -1)
        return (u.reshape(n, -1, s.sub), np.ascontiguousarray(scale.reshape(sub_shape)),
                None if offset is None else np.ascontiguousarray(offset.reshape(sub_shape)))

    def dequantize_rows(self) -> np.ndarray:
        """float32 [out_features, in_features]: the values the blocks encode, by
        row as the file stores them (``gguf.quants.dequantize``'s values; 2.5x
        faster on Gemma 3's Q8_0 embedding here, computed in place)."""
        u, scale, offset = self.decode()
        w = u.astype(np.float32)
        del u
        w -= np.float32(self.spec.zero)
        w *= scale[..., None]
        if offset is not None:
            w += offset[..., None]
        return w.reshape(w.shape[0], -1)

    def dequantize(self) -> np.ndarray:
        """float32 [in_features, out_features]: the values the blocks encode."""
        return np.ascontiguousarray(self.dequantize_rows().T)

    def matmul_nbits(self) -> NBits:
        """The MatMulNBits inputs that compute ``x @ dequantize()`` exactly."""
        s = self.spec
        u, scale, offset = self.decode()
        n, nb = scale.shape
        zero_points = None
        if s.zero != 1 << (s.bits - 1):
            per_row = (nb * s.bits + 7) // 8
            zp = np.full((n, per_row * 8 // s.bits), s.zero, np.uint8)
            zero_points = _pack(zp, s.bits).reshape(-1)
        return NBits(bits=s.bits, block_size=s.sub, B=_pack(u, s.bits),
                     scales=scale.reshape(-1), zero_points=zero_points,
                     offsets=None if offset is None else np.ascontiguousarray(offset.T))
