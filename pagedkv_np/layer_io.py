"""LayerIO: one layer's K/V written and gathered through a plan, against one
store and its backend.

The cache checks the plan (its own, still current) and the lock; what is left
here is the layer and the output sizes. Every call then goes through the
backend's public methods (so a backend's own ``write`` or ``gather`` runs:
CuPy's picks the device and uploads host data), telling it what is known
already: the store is the one it was made with and checked then
(``check_store=False``), the plan's indices were checked when it was built
(``check_indices=False``), and the backend prepared them once for every layer
(``prepared=``). The backend still checks the K/V data and the outputs.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .backends import Backend
from .backends.prepared import PreparedIndices
from .errors import AllocationError, ConfigError, DTypeError, PagedKVError, ShapeError
from .checks import check_index, is_int, shown
from .layout import OutputLayout, resolve_dtype
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

    def layer_id(self, layer: Any) -> int:
        """``layer`` as an index of the store's layers, else a typed error."""
        return check_index(layer, "layer", self.store.num_layers)

    def write(self, layer: int, plan: Plan, k: Any, v: Any,
              prepared: PreparedIndices | None) -> None:
        """Write the K/V of the plan's new tokens into ``layer`` (an index in
        range); see :meth:`PagedKVCache.write`. ``prepared`` is the
        backend's :meth:`~pagedkv_np.backends.base.Backend.prepare` of ``plan``."""
        store = self.store
        if store.quant is not None:
            self.backend.write_quantized(
                store.k, store.v, store.k_scale, store.v_scale, layer, plan.slot_mapping, k, v,
                layout=store.layout, check_indices=False, check_store=False, prepared=prepared)
        else:
            self.backend.write(store.k, store.v, layer, plan.slot_mapping, k, v,
                               layout=store.layout, check_indices=False, check_store=False,
                               prepared=prepared)

    def gather(self, layer: Any, plan: Plan, layout: Any, out: Any, num_positions: Any,
               dtype: Any, prepared: PreparedIndices | None,
               host: bool = False) -> tuple[Any, Any]:
        """Gather ``layer`` of the plan's sequences; see :meth:`PagedKVCache.gather`
        (``prepared`` as in :meth:`write`)."""
        if host and np.ndarray not in self.backend.array_types:
            return self._gather_to_host(layer, plan, layout, out, num_positions, dtype, prepared)
        layer = self.layer_id(layer)
        if out is None:
            self._check_gather_size(plan, num_positions)
        try:
            return self._gather(layer, plan, layout, out, num_positions, dtype, prepared)
        except MemoryError as exc:
            if isinstance(exc, PagedKVError):
                raise
            raise AllocationError(
                f"Invalid num_positions: the gathered K and V of {plan.num_seqs} "
                f"sequence(s) could not be allocated ({exc})") from None

    def _gather_to_host(self, layer: Any, plan: Plan, layout: Any, out: Any,
                        num_positions: Any, dtype: Any,
                        prepared: PreparedIndices | None) -> tuple[Any, Any]:
        """A device backend's gather copied down to host NumPy arrays (into
        ``out`` when given, which is then host memory of the gather's shape)."""
        to_numpy = self.backend.to_numpy
        if out is None:
            k, v = self.gather(layer, plan, layout, None, num_positions, dtype, prepared)
            return to_numpy(k), to_numpy(v)
        t_axis = OutputLayout.parse(layout).t_axis
        gathered = self.gather(layer, plan, layout, None, out[0].shape[t_axis],
                               out[0].dtype if self.store.quant is not None else dtype,
                               prepared)
        for dst, src in zip(out, gathered):
            dst[...] = to_numpy(src)
        return out

    def _check_gather_size(self, plan: Plan, num_positions: Any) -> None:
        """Refuse output buffers whose size no allocator can take (the
        backend checks the type and lower bound of ``num_positions``)."""
        if not is_int(num_positions):
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
                dtype: Any, prepared: PreparedIndices | None) -> tuple[Any, Any]:
        store = self.store
        if store.quant is not None:
            return self.backend.gather_quantized(
                store.k, store.v, store.k_scale, store.v_scale, layer, plan.page_table,
                plan.seq_lens, layout=store.layout, out_layout=layout, out=out,
                num_positions=num_positions, dtype=dtype, check_indices=False,
                check_store=False, prepared=prepared)
        if dtype is not None and resolve_dtype(dtype) != store.dtype:
            raise DTypeError(f"Invalid dtype: a {store.dtype} cache gathers {store.dtype}, "
                             f"got {dtype!r}")
        return self.backend.gather(store.k, store.v, layer, plan.page_table, plan.seq_lens,
                                   layout=store.layout, out_layout=layout, out=out,
                                   num_positions=num_positions, check_indices=False,
                                   check_store=False, prepared=prepared)
