"""Linear-layer weights kept in ggml's blocks of 32, and their MatMulNBits form.

Each block holds 32 consecutive inputs of one output row:

``q4_0``  ``w = d * (q - 8)``: 4-bit MatMulNBits, whose default zero point is 8.
``q4_1``  ``w = d * q + m``: an integer zero point cannot carry ``m``, so
          ``x @ w = MatMulNBits(x; q, d, zp=0) + blocksum(x) @ M`` with
          ``M[b, n] = m`` of block ``b`` of output ``n`` (``blocksum`` sums
          each run of 32 inputs).
``q8_0``  ``w = d * q``: 8-bit MatMulNBits on ``q + 128``, zero point 128.

``d`` and ``m`` are float16. ggml packs a 4-bit block as ``low nibbles =
elements 0..15, high nibbles = 16..31``; MatMulNBits packs consecutive
elements in one byte (low nibble first), so the nibbles are re-paired.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError, DTypeError, ShapeError

__all__ = ["BLOCK_KINDS", "BLOCK_SIZE", "BlockQuantized"]

BLOCK_SIZE = 32
# bytes per block of BLOCK_SIZE weights
BLOCK_KINDS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


@dataclass(frozen=True, eq=False)
class BlockQuantized:
    """A linear layer's weight in ggml blocks of 32 consecutive inputs.

    Attributes
    ----------
    kind : {"q4_0", "q4_1", "q8_0"}
    blocks : ndarray, shape [out_features, in_features // 32 * BLOCK_KINDS[kind]], uint8
        One row per output, as a GGUF file stores the tensor.
    """

    kind: str
    blocks: np.ndarray

    def __post_init__(self) -> None:
        size = BLOCK_KINDS.get(self.kind)
        if size is None:
            raise ConfigError(f"Invalid kind: expected one of {sorted(BLOCK_KINDS)}, "
                              f"got {self.kind!r}")
        b = self.blocks
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 2:
            raise DTypeError(f"Invalid blocks: expected a 2-D uint8 array, got {b!r:.80}")
        if b.shape[1] % size or b.shape[1] == 0:
            raise ShapeError(f"Invalid blocks: rows of {b.shape[1]} bytes are not whole "
                             f"{self.kind} blocks of {size} bytes")

    @property
    def shape(self) -> tuple[int, int]:
        """``(in_features, out_features)``, as a float weight's shape."""
        return (self.blocks.shape[1] // BLOCK_KINDS[self.kind] * BLOCK_SIZE, self.blocks.shape[0])

    def _split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(q int [N, nb, 32] in element order, d float32 [N, nb], m float32 or None)."""
        n = self.blocks.shape[0]
        blk = self.blocks.reshape(n, -1, BLOCK_KINDS[self.kind])
        d = np.ascontiguousarray(blk[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
        if self.kind == "q8_0":
            return blk[:, :, 2:].view(np.int8).astype(np.int16), d, None
        start = 2 if self.kind == "q4_0" else 4
        qs = blk[:, :, start:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)      # ggml: low = 0..15, high = 16..31
        if self.kind == "q4_0":
            return q.astype(np.int16) - 8, d, None
        m = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return q.astype(np.int16), d, m

    def dequantize(self) -> np.ndarray:
        """float32 [in_features, out_features]: the values the blocks encode."""
        q, d, m = self._split()
        w = q.astype(np.float32) * d[..., None]
        if m is not None:
            w += m[..., None]
        return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)

    def matmul_nbits(self) -> dict[str, np.ndarray]:
        """MatMulNBits inputs: ``B`` uint8 [N, nb, 32 * bits / 8], ``scales`` float32
        [N * nb], ``zero_points`` (q4_1: uint8, all 0) and ``mins`` (q4_1: float32
        [nb, N], the ``M`` of the block-sum term)."""
        q, d, m = self._split()
        n, nb = d.shape
        out: dict[str, np.ndarray] = {"scales": d.reshape(-1)}
        if self.kind == "q8_0":
            out["B"] = (q + 128).astype(np.uint8)
            return out
        u = (q + 8 if self.kind == "q4_0" else q).astype(np.uint8)
        out["B"] = np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << 4))
        if m is not None:
            out["zero_points"] = np.zeros(n * ((nb + 1) // 2), np.uint8)
            out["mins"] = np.ascontiguousarray(m.T)
        return out
