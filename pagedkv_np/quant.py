"""The int8 page format that every backend shares: codes, scales and rounding.

A quantized store keeps, beside each K (or V) code array, a float32 scale
array in the same page geometry, with ``head_dim`` replaced by the number
of groups::

    codes:  int8    [num_layers, num_pages, page_size, num_kv_heads, head_dim]   (NHD)
    scales: float32 [num_layers, num_pages, page_size, num_kv_heads, num_groups]

(HND swaps ``page_size`` and ``num_kv_heads`` in both.) One page of one
layer is contiguous in both arrays, so copying a page's codes and its
scales is the whole of a page copy.

The format, chosen by measurement (``scripts/quant_quality.py --only groups``):

* **Groups of 32 along head_dim** (:func:`group_size`), one scale per
  token, head and group; a head_dim that 32 does not divide is one group.
  On K with outlier channels (4 of 128 channels 12x larger, as K has) the
  RMS error was 1.1% of the signal with groups of 32 against 1.8% with one
  scale per head; on plain Gaussian V 0.54% against 0.65%.
* **Symmetric**, no zero point: ``code = rint(x / scale)`` in
  ``[-127, 127]`` with ``scale = amax / 127``; K and V are centred, and a
  zero point would cost a second array and a subtraction in every gather.
* **float32 scales**: 4 bytes per 32 values (1.125 bytes a value, 3.56x
  the tokens of a float32 store, 1.78x those of a float16 one). A float16
  scale would save 0.0625 bytes a value but cannot hold the scale of
  values above 8.3e6 nor below 7.6e-6 without overflow or subnormals,
  which bfloat16 and float32 inputs reach.
* **8 bits, not 4**: on SmolLM2-135M (``scripts/quant_quality.py``, 999
  tokens of this project's README, every past position read back from the
  pages) int8 pages gave 3.5446 nats a token against 3.5463 with float32
  pages (-0.05%); the same groups at 4 bits (codes -7..7) gave +2.5%, five
  times the +0.5% this format allows itself, so there is no int4 type.

Every step is a single, correctly rounded float32 operation (a division,
``rint``, a multiplication), so the Numba and CUDA kernels repeat it bit
for bit:

1. the input is widened to float32 (exact for float16 and bfloat16);
2. NaN and subnormal inputs (``|x| < 2**-126``) count as 0; infinities
   count as 0 for the scale and saturate to +-127;
3. ``amax`` is the largest remaining finite ``|x|`` of the group;
   ``scale = amax / 127``, capped at :data:`SCALE_MAX` (so that
   ``127 * scale`` stays finite); a scale below :data:`SCALE_MIN`
   (``2**-126``: every value of the group below ``127 * 2**-126``,
   zero included) is stored as 0, with every code 0;
4. ``code = clip(rint(x / scale), -127, 127)``, rint rounding half to even;
5. dequantized, ``value = float32(code) * scale``, then rounded to the
   output dtype (float16 and bfloat16 round to nearest, ties to even).

No arithmetic meets a subnormal float32 on the way (inputs are flushed,
scales are normal or zero, products of a code and a normal scale are
normal or zero), so a GPU compiled to flush subnormals gives the same bits.

The round trip of a finite, normal value is within half a step:
``|dequant(quant(x)) - x| <= scale / 2`` (plus one rounding of the final
product), and exact for 0 and for the group's largest value's sign.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DTypeError
from .layout import resolve_dtype

__all__ = [
    "QUANT_DTYPES",
    "QMAX",
    "GROUP_SIZE",
    "SCALE_DTYPE",
    "SCALE_MIN",
    "SCALE_MAX",
    "QuantFormat",
    "resolve_quant",
    "group_size",
    "quantize",
    "dequantize",
]

#: Largest code magnitude: codes are symmetric, -128 is never stored.
QMAX = 127
#: Values per scale along head_dim, when head_dim is a multiple of it.
GROUP_SIZE = 32
SCALE_DTYPE = np.dtype(np.float32)
_F32 = np.float32
#: Smallest stored non-zero scale: the smallest normal float32.
SCALE_MIN = _F32(np.finfo(np.float32).tiny)


def _largest_finite_scale() -> np.float32:
    s = _F32(np.finfo(np.float32).max) / _F32(QMAX)
    with np.errstate(over="ignore"):
        while not np.isfinite(_F32(QMAX) * s):
            s = np.nextafter(s, _F32(0))
    return _F32(s)


#: Largest stored scale: the largest float32 whose product with 127 is finite.
SCALE_MAX = _largest_finite_scale()

_CODE_DTYPE = np.dtype(np.int8)


@dataclass(frozen=True)
class QuantFormat:
    """A quantized page format.

    Attributes
    ----------
    name : str
        ``"int8"``.
    code_dtype : numpy.dtype
        dtype of the code arrays (int8).
    scale_dtype : numpy.dtype
        dtype of the scale arrays (float32).
    """

    name: str
    code_dtype: np.dtype
    scale_dtype: np.dtype

    def num_groups(self, head_dim: int) -> int:
        """Scales per token and head."""
        return head_dim // group_size(head_dim)


#: Quantized store dtypes by name.
QUANT_DTYPES: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", _CODE_DTYPE, SCALE_DTYPE),
}


def resolve_quant(dtype: Any) -> QuantFormat | None:
    """The :class:`QuantFormat` named by ``dtype`` (``"int8"`` or
    ``np.int8``), or None when ``dtype`` names no quantized format."""
    if isinstance(dtype, QuantFormat):
        return dtype
    if isinstance(dtype, str):
        return QUANT_DTYPES.get(dtype.lower())
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    for fmt in QUANT_DTYPES.values():
        if dt == fmt.code_dtype:
            return fmt
    return None


def group_size(head_dim: int) -> int:
    """Values per scale: :data:`GROUP_SIZE` when it divides ``head_dim``,
    else ``head_dim`` (one scale per token and head)."""
    return GROUP_SIZE if head_dim % GROUP_SIZE == 0 else head_dim


def _as_float32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    resolve_dtype(x.dtype, "x")  # float32, float16 or bfloat16
    return x.astype(np.float32)


def quantize(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Quantize values along their last axis (the reference of every backend).

    Parameters
    ----------
    x : ndarray, shape [..., head_dim], dtype float32, float16 or bfloat16

    Returns
    -------
    codes : ndarray, shape [..., head_dim], dtype int8
    scales : ndarray, shape [..., num_groups], dtype float32
        ``num_groups = head_dim // group_size(head_dim)``.
    """
    xf = _as_float32(x)
    if xf.ndim == 0:
        raise DTypeError("Invalid x: expected an array with a head_dim axis, got a scalar")
    head_dim = xf.shape[-1]
    g = group_size(head_dim) if head_dim else 1
    grouped = xf.reshape(*xf.shape[:-1], head_dim // g if head_dim else 0, g)
    mag = np.abs(grouped)
    with np.errstate(invalid="ignore"):
        usable = (mag >= SCALE_MIN) & (mag <= np.finfo(np.float32).max)  # NaN: False
        values = np.where(usable | np.isinf(grouped), grouped, _F32(0))
        amax = np.where(usable, mag, _F32(0)).max(axis=-1, initial=_F32(0))
    scales = np.minimum(amax / _F32(QMAX), SCALE_MAX).astype(np.float32)
    scales[scales < SCALE_MIN] = 0
    divisor = np.where(scales > 0, scales, _F32(1))[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(np.rint(values / divisor), -QMAX, QMAX)
    q = np.where(scales[..., None] > 0, q, _F32(0))
    return q.astype(np.int8).reshape(xf.shape), scales


def dequantize(codes: Any, scales: Any, dtype: Any = "float32") -> np.ndarray:
    """Values of ``codes`` and ``scales`` (from :func:`quantize`) in ``dtype``.

    Parameters
    ----------
    codes : ndarray, shape [..., head_dim], dtype int8
    scales : ndarray, shape [..., num_groups], dtype float32
    dtype : {"float32", "float16", "bfloat16"}

    Returns
    -------
    ndarray, shape [..., head_dim], dtype ``dtype``
    """
    out_dtype = resolve_dtype(dtype)
    codes, scales = np.asarray(codes), np.asarray(scales)
    head_dim = codes.shape[-1]
    g = group_size(head_dim) if head_dim else 1
    grouped = codes.reshape(*codes.shape[:-1], head_dim // g if head_dim else 0, g)
    values = grouped.astype(np.float32) * scales.astype(np.float32)[..., None]
    with np.errstate(over="ignore"):  # past float16's range is its infinity
        return values.reshape(codes.shape).astype(out_dtype)
