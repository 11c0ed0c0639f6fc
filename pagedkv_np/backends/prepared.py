"""A plan's index arrays as one backend's kernels take them.

:meth:`Backend.prepare <pagedkv_np.backends.base.Backend.prepare>` turns a
plan (anything with ``slot_mapping``, ``page_table`` and ``seq_lens`` host
int32 arrays) into a :class:`PreparedIndices`, which the caller then passes,
beside the same host arrays, to every write and gather of that plan. Checks
still run on the host arrays; the kernels get :meth:`PreparedIndices.get` of
them. For a CPU backend that is the host array itself; a device backend
uploads each array once per device and hands out the copy from then on, so a
step over many layers uploads its indices once instead of once a layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..layout import check_array
from ..plan import Plan

__all__ = ["PreparedIndices"]

_NAMES = ("slot_mapping", "page_table", "seq_lens")
_INDEX_DTYPE = np.dtype(np.int32)


class PreparedIndices:
    """The index arrays of one plan, with the kernels' copies of them.

    Parameters
    ----------
    plan : Plan or any object with ``slot_mapping``, ``page_table`` and
        ``seq_lens`` host int32 arrays (1-D, 2-D and 1-D), which must not
        change afterwards (a :class:`~pagedkv_np.plan.Plan`'s are read-only).

    Raises
    ------
    ConfigError, DTypeError, ShapeError
        ``plan`` lacks one of the arrays, or one is not a host int32 array of
        its number of dimensions.
    """

    __slots__ = ("slot_mapping", "page_table", "seq_lens")

    def __init__(self, plan: Any) -> None:
        # checked once here, so that a call given these arrays need not again
        # (a Plan's were checked when it was built, and are read-only)
        for name, ndim in zip(_NAMES, (1, 2, 1)) if type(plan) is not Plan else ():
            if not hasattr(plan, name):
                raise ConfigError(f"Invalid plan: expected an object with a {name} array, "
                                  f"got {type(plan).__name__}")
            check_array(getattr(plan, name), name, ndim=ndim, dtype=_INDEX_DTYPE)
        self.slot_mapping = plan.slot_mapping
        self.page_table = plan.page_table
        self.seq_lens = plan.seq_lens

    def get(self, host: Any) -> Any:
        """The kernels' form of ``host``, one of the plan's three arrays.

        Raises
        ------
        ConfigError
            ``host`` is not one of the arrays this was prepared from (an
            index array of another plan would address other pages).
        """
        if host is self.slot_mapping or host is self.page_table or host is self.seq_lens:
            return self.kernel_form(host)
        raise ConfigError("Invalid prepared: it was made from another plan's index arrays")

    def kernel_form(self, host: Any) -> Any:
        """``host`` as the kernels take it: the array itself here; a device
        backend's subclass returns its copy on the current device."""
        return host

    def __repr__(self) -> str:
        return (f"<{type(self).__name__}: {self.seq_lens.shape[0]} sequence(s), "
                f"{self.slot_mapping.shape[0]} new token(s)>")
