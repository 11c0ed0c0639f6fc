"""The names of ``pagedkv bench``'s operations and default dtypes.

A module of their own, without NumPy, so that the command's ``--help``
(which lists them) imports nothing heavy; :mod:`.cases` measures them.
"""

from __future__ import annotations

__all__ = ["OPS", "DATA_OPS", "DEFAULT_DTYPES"]

OPS = ("gather", "prefill_write", "decode_write", "copy_pages", "alloc_free", "prefix_lookup")
# the operations that move K/V, and so run per backend and dtype
DATA_OPS = OPS[:4]
DEFAULT_DTYPES = ("float32", "float16")
