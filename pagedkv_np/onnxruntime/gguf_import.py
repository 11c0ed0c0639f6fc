"""Deprecated: the GGUF import moved to :mod:`pagedkv_np.models.gguf.importer`.

This module re-exports its names and warns once on import; it will be removed
in a later release.
"""

import sys
import warnings

from ..models.gguf.importer import *  # noqa: F403
from ..models.gguf.importer import __all__, main  # noqa: F401

warnings.warn("pagedkv_np.onnxruntime.gguf_import moved to pagedkv_np.models.gguf.importer",
              DeprecationWarning, stacklevel=2)

if __name__ == "__main__":  # pragma: no cover - python -m of the old name
    sys.exit(main())
