"""Checks of the arrays a backend is handed: stores, int8 stores and gather outputs.

Each takes the backend as its first argument and uses only its public face:
``array_types`` (the array classes it accepts), ``may_share_memory`` and, for
new outputs, ``empty``. Errors name the argument; nothing is changed before
every check has passed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DTypeError, ShapeError
from ..layout import SUPPORTED_DTYPES, OutputLayout, StoreDims, StoreLayout, check_array
from ..checks import describe, is_int
from ..quant import QUANT_DTYPES, group_size

__all__ = ["STORE_DTYPES", "CODE_DTYPES", "SCALE_DTYPE", "check_kv_store",
           "check_quant_store", "gather_outputs"]

#: dtypes of float stores and of gathered K/V.
STORE_DTYPES = frozenset(SUPPORTED_DTYPES.values())
#: dtypes of the codes of a quantized store, and of its scales.
CODE_DTYPES = frozenset(fmt.code_dtype for fmt in QUANT_DTYPES.values())
SCALE_DTYPE = QUANT_DTYPES["int8"].scale_dtype


def check_kv_store(backend: Any, k_cache: Any, v_cache: Any, layout: StoreLayout,
                codes: bool = False) -> StoreDims:
    """Check a K/V store pair (int8 codes too when ``codes``) and return its sizes."""
    types = backend.array_types
    check_array(k_cache, "k_cache", ndim=5, array_type=types, contiguous=True, writeable=True)
    if k_cache.dtype not in STORE_DTYPES and not (codes and k_cache.dtype in CODE_DTYPES):
        expected = sorted(SUPPORTED_DTYPES) + (sorted(QUANT_DTYPES) if codes else [])
        hint = ("; an int8 store is written and gathered with write_quantized and "
                "gather_quantized" if k_cache.dtype in CODE_DTYPES else "")
        raise DTypeError(f"Invalid dtype of k_cache: expected one of "
                         f"{expected}, got {k_cache.dtype}{hint}")
    check_array(v_cache, "v_cache", shape=k_cache.shape, dtype=k_cache.dtype,
                array_type=types, contiguous=True, writeable=True)
    if backend.may_share_memory(k_cache, v_cache):
        raise ShapeError("Invalid v_cache: it shares memory with k_cache")
    return layout.dims(k_cache.shape)


def check_quant_store(backend: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                      layout: StoreLayout) -> StoreDims:
    """Check int8 codes and their float32 scales (see :mod:`pagedkv_np.quant`)
    and return the store's sizes."""
    types = backend.array_types
    check_array(k_cache, "k_cache", ndim=5, array_type=types, contiguous=True, writeable=True)
    if k_cache.dtype not in CODE_DTYPES:
        raise DTypeError(f"Invalid dtype of k_cache: expected one of {sorted(QUANT_DTYPES)}, "
                         f"got {k_cache.dtype}")
    check_array(v_cache, "v_cache", shape=k_cache.shape, dtype=k_cache.dtype,
                array_type=types, contiguous=True, writeable=True)
    dims = layout.dims(k_cache.shape)
    scale_shape = (*k_cache.shape[:4], dims.head_dim // group_size(dims.head_dim))
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_array(x, name, shape=scale_shape, dtype=SCALE_DTYPE, array_type=types,
                    contiguous=True, writeable=True)
    arrays = (("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
              ("v_scale", v_scale))
    for i, (name, x) in enumerate(arrays):
        for other, y in arrays[:i]:
            if backend.may_share_memory(x, y):
                raise ShapeError(f"Invalid {name}: it shares memory with {other}")
    return dims


def gather_outputs(backend: Any, out: Any, out_layout: OutputLayout, seq_lens: np.ndarray,
                   num_kv_heads: int, head_dim: int, dtype: Any, num_positions: Any,
                   stores: tuple) -> tuple[Any, Any]:
    """The checked ``out`` pair of a gather, or a new one of ``dtype``
    (any float dtype for an ``out`` given when ``dtype`` is None).

    Parameters
    ----------
    seq_lens : ndarray, shape [B], int32
        The gather's sequence lengths (checked already).
    stores : tuple of arrays
        The store arrays the gather reads, which ``out`` must not overlap.
    """
    num_seqs = seq_lens.shape[0]
    max_len = int(seq_lens.max()) if num_seqs else 0
    if out is None:
        if num_positions is None:
            num_positions = max_len
        elif not is_int(num_positions):
            raise DTypeError("Invalid num_positions: expected an integer")
        if num_positions < max_len:
            raise ShapeError(f"Invalid num_positions: expected >= max(seq_lens) = {max_len}, "
                             f"got {num_positions}")
        shape = out_layout.shape(num_seqs, int(num_positions), num_kv_heads, head_dim)
        return backend.empty(shape, dtype), backend.empty(shape, dtype)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise DTypeError(f"Invalid out: expected a (k, v) pair, got {describe(out)}")
    k_out, v_out = out
    types = backend.array_types
    check_array(k_out, "out[0]", ndim=4, array_type=types)
    num_out = out_layout.num_positions(k_out.shape)
    shape = out_layout.shape(num_seqs, num_out, num_kv_heads, head_dim)
    if dtype is None:
        if getattr(k_out, "dtype", None) not in STORE_DTYPES:
            raise DTypeError(f"Invalid dtype of out[0]: expected one of "
                             f"{sorted(SUPPORTED_DTYPES)}, got {k_out.dtype}")
        dtype = k_out.dtype
    for name, x in (("out[0]", k_out), ("out[1]", v_out)):
        check_array(x, name, shape=shape, dtype=dtype, array_type=types, contiguous=True,
                    writeable=True)
    if num_out < max_len:
        raise ShapeError(f"Invalid shape of out[0]: T = {num_out} is shorter than "
                         f"max(seq_lens) = {max_len}")
    if backend.may_share_memory(k_out, v_out):
        raise ShapeError("Invalid out: out[0] and out[1] share memory")
    for name, x in (("out[0]", k_out), ("out[1]", v_out)):
        if any(backend.may_share_memory(x, store) for store in stores):
            raise ShapeError(f"Invalid {name}: it shares memory with the store")
    return k_out, v_out
