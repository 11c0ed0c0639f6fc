"""Sizes for ``pagedkv serve``'s options: byte counts such as ``2GiB``, and
the pages a byte budget buys (``--kv-cache-memory``).

A page holds ``page_size`` tokens of every layer's K and V:
``2 x num_layers x page_size x num_kv_heads x head_dim`` values of the page
dtype (int8 pages also keep a float32 scale per group of a head's values).
The geometry is read from the graph's ``past_key_values.{i}.key`` inputs,
without loading the weights; the bytes are those of a one-page
:class:`~pagedkv_np.PagedKVCache` of that geometry, so they are what the
pool really allocates.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError

__all__ = ["parse_bytes", "page_bytes", "pages_for_bytes", "check_kv_dtype"]

_UNITS = {"": 1, "B": 1, "K": 10 ** 3, "KB": 10 ** 3, "M": 10 ** 6, "MB": 10 ** 6,
          "G": 10 ** 9, "GB": 10 ** 9, "T": 10 ** 12, "TB": 10 ** 12, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_PAST_KEY = re.compile(r"^past_key_values\.(\d+)\.key$")


def parse_bytes(text: str, name: str) -> int:
    """Bytes of ``"2GiB"``, ``"512MB"``, ``"1.5G"`` or ``"4096"`` (G = 10^9, GiB = 2^30).

    Raises
    ------
    ConfigError
        Not a size, or below one byte.
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{name} must be a size such as 2GiB, 512MB or 4096, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{name} must be at least 1 byte, got {text!r}")
    return value


def _geometry(model_path: str, num_kv_heads: int | None,
              head_dim: int | None) -> tuple[int, int, int, Any]:
    """num_layers, num_kv_heads, head_dim and the K/V numpy dtype of a graph."""
    import onnx
    from onnx import helper

    graph = onnx.load(model_path, load_external_data=False).graph
    keys = {int(m.group(1)): i for i in graph.input if (m := _PAST_KEY.match(i.name))}
    if not keys:
        raise ConfigError(f"cannot size the pool by bytes: {model_path} has no "
                          "past_key_values.{i}.key inputs; give --num-pages")
    first = keys[min(keys)].type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in first.shape.dim]
    heads = dims[1] if len(dims) == 4 and dims[1] else num_kv_heads
    width = dims[3] if len(dims) == 4 and dims[3] else head_dim
    if heads is None or width is None:
        raise ConfigError("cannot size the pool by bytes: the graph leaves the K/V heads or "
                          "head size symbolic; give --num-pages")
    return len(keys), int(heads), int(width), helper.tensor_dtype_to_np_dtype(first.elem_type)


def check_kv_dtype(model_path: str, kv_dtype: str | None) -> None:
    """Refuse a float ``kv_dtype`` other than the model's K/V dtype (read off
    the graph, before its weights load): pages hold the model's dtype or int8.

    Raises
    ------
    ConfigError
        The dtypes differ.
    """
    import numpy as np

    if kv_dtype is None or kv_dtype == "int8":
        return
    import onnx
    from onnx import helper

    graph = onnx.load(model_path, load_external_data=False).graph
    keys = [i for i in graph.input if _PAST_KEY.match(i.name)]
    if not keys:
        return   # the engine reports a graph without past inputs
    model = np.dtype(helper.tensor_dtype_to_np_dtype(keys[0].type.tensor_type.elem_type))
    if model.name != kv_dtype:
        raise ConfigError(f"--kv-dtype {kv_dtype}: the model's K/V are {model.name}, so "
                          f"pages hold {model.name} or int8")


def page_bytes(model_path: str, page_size: int, kv_dtype: Any = None,
               num_kv_heads: int | None = None, head_dim: int | None = None) -> int:
    """Bytes one page of the model's pool takes (every layer, K and V, scales).

    Parameters
    ----------
    model_path : str
        The ONNX graph.
    kv_dtype : str, optional
        The pages' dtype (default: the model's K/V dtype).
    num_kv_heads, head_dim : int, optional
        Where the graph leaves them symbolic (the folder's configuration).
    """
    from ..cache import PagedKVCache

    num_layers, heads, width, dtype = _geometry(model_path, num_kv_heads, head_dim)
    probe = PagedKVCache(num_layers, 1, page_size, heads, width,
                         dtype=dtype if kv_dtype is None else kv_dtype, backend="numpy",
                         enable_prefix_caching=False)
    return int(probe.nbytes)


def pages_for_bytes(num_bytes: int, bytes_per_page: int) -> int:
    """Whole pages that fit ``num_bytes``.

    Raises
    ------
    ConfigError
        Not even one page fits.
    """
    num_pages = num_bytes // bytes_per_page
    if num_pages < 1:
        raise ConfigError(f"--kv-cache-memory {num_bytes:,} bytes holds no page: one page "
                          f"takes {bytes_per_page:,} bytes")
    return num_pages
