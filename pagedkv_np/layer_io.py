"""LayerIO: one layer's K/V written and gathered through a plan, against one
store and its backend.

The cache checks the plan (its own, still current) and the lock; what is left
here is the layer, the data and the output sizes, before the backend's kernels
run without checking the plan's indices again.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

from .backends import Backend
from .errors import AllocationError, ConfigError, DTypeError, PagedKVError, PageIdError, ShapeError
from .layout import check_array, resolve_dtype, shown
from .plan import Plan
from .store import KVStore

__all__ = ["LayerIO"]

# NumPy refuses arrays of more bytes than a signed pointer can count.
_MAX_ARRAY_BYTES = sys.maxsize


class LayerIO:
    """Writes and gathers of ``store`` through ``backend``.

    Parameters
    ----------
    store : KVStore
    backend : Backend
        The store's backend.
    """

    def __init__(self, store: KVStore, backend: Backend) -> None:
        self.store, self.backend = store, backend
        self._kernel_store = backend._kernel_views(store.k, store.v)

    def layer_id(self, layer: Any) -> int:
        """``layer`` as an index of the store's layers, else a typed error."""
        num_layers = self.store.num_layers
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise DTypeError(f"Invalid layer: expected an integer, got {type(layer).__name__}")
        if not 0 <= int(layer) < num_layers:
            raise PageIdError(f"Invalid layer: expected 0 <= layer < {num_layers}, "
                              f"got {shown(layer)}")
        return int(layer)

    def write(self, layer: int, plan: Plan, k: Any, v: Any) -> None:
        """Write the K/V of the plan's new tokens into ``layer`` (an index in
        range); see :meth:`PagedKVCache.write`."""
        # The store was checked when it was made and the plan when it was
        # built: what is left to check is the data, and then the backend's
        # kernel can be called directly.
        store, backend = self.store, self.backend
        if store.quant is not None:
            backend.write_quantized(store.k, store.v, store.k_scale, store.v_scale, layer,
                                    plan.slot_mapping, k, v, layout=store.layout,
                                    check_indices=False)
            return
        shape = (plan.slot_mapping.shape[0], store.num_kv_heads, store.head_dim)
        check_array(k, "k", shape=shape, dtype=store.dtype, array_type=backend.array_types)
        check_array(v, "v", shape=shape, dtype=store.dtype, array_type=backend.array_types)
        backend.check_sources((k, v), (store.k, store.v))
        if shape[0]:
            backend._write(*self._kernel_store, layer, plan.slot_mapping, k, v, store.layout)

    def gather(self, layer: Any, plan: Plan, layout: Any, out: Any, num_positions: Any,
               dtype: Any) -> tuple[Any, Any]:
        """Gather ``layer`` of the plan's sequences; see :meth:`PagedKVCache.gather`."""
        layer = self.layer_id(layer)
        if out is None:
            self._check_gather_size(plan, num_positions)
        try:
            return self._gather(layer, plan, layout, out, num_positions, dtype)
        except MemoryError as exc:
            if isinstance(exc, PagedKVError):
                raise
            raise AllocationError(
                f"Invalid num_positions: the gathered K and V of {plan.num_seqs} "
                f"sequence(s) could not be allocated ({exc})") from None

    def _check_gather_size(self, plan: Plan, num_positions: Any) -> None:
        """Refuse output buffers whose size no allocator can take (the
        backend checks the type and lower bound of ``num_positions``)."""
        if not isinstance(num_positions, numbers.Integral) or isinstance(num_positions, bool):
            return
        max_len = int(plan.seq_lens.max()) if plan.num_seqs else 0
        if int(num_positions) < max_len:
            raise ShapeError(f"Invalid num_positions: expected >= max(seq_lens) = {max_len}, "
                             f"got {shown(num_positions)}")
        store = self.store
        nbytes = (2 * plan.num_seqs * int(num_positions) * store.num_kv_heads * store.head_dim
                  * 4)   # at most 4 bytes an element, whatever the output dtype
        if nbytes > _MAX_ARRAY_BYTES:
            raise ConfigError(
                f"Invalid num_positions: {shown(num_positions)} positions of {plan.num_seqs} "
                f"sequence(s) need {shown(nbytes)} bytes for K and V, more than an array "
                "can hold")

    def _gather(self, layer: int, plan: Plan, layout: Any, out: Any, num_positions: Any,
                dtype: Any) -> tuple[Any, Any]:
        store = self.store
        if store.quant is not None:
            return self.backend.gather_quantized(
                store.k, store.v, store.k_scale, store.v_scale, layer, plan.page_table,
                plan.seq_lens, layout=store.layout, out_layout=layout, out=out,
                num_positions=num_positions, dtype=dtype, check_indices=False)
        if dtype is not None and resolve_dtype(dtype) != store.dtype:
            raise DTypeError(f"Invalid dtype: a {store.dtype} cache gathers {store.dtype}, "
                             f"got {dtype!r}")
        return self.backend.gather(store.k, store.v, layer, plan.page_table, plan.seq_lens,
                                   layout=store.layout, out_layout=layout, out=out,
                                   num_positions=num_positions, check_indices=False)
