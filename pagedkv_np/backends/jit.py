"""Where compiled Numba kernels live on disk, and compiling them ahead of use.

The Numba kernels compile lazily, once per dtype width, on first use (about a
second each; :func:`pagedkv_np.warmup` compiles them ahead). Compiled code is
cached on disk so that later processes start warm. The cache directory is, in order of precedence:

1. ``$PAGEDKV_NUMBA_CACHE_DIR``,
2. ``$NUMBA_CACHE_DIR`` (Numba's own setting, honoured when the user set it),
3. ``$XDG_CACHE_HOME/pagedkv_np/numba``, else ``~/.cache/pagedkv_np/numba``.

A directory is used only if it can be created and written to. When it cannot,
the kernels compile without a disk cache and one :class:`RuntimeWarning` says
so: Numba itself would make ``cache=True`` functions fail at import time when
no cache directory is writable, and a read-only home must not break the
package.

Numba resolves the cache directory of a function when the function is
decorated, from ``numba.config.CACHE_DIR``; :func:`jit_kernel` sets that value
for the duration of the decoration only, so Numba code outside this package
keeps its own setting. Numba's cache index does not tell apart compile flags,
so kernels compiled with ``NUMBA_BOUNDSCHECK=1`` go to a ``boundscheck``
subdirectory instead of overwriting (or being served) unchecked code.

This module imports nothing of Numba until a function here is called.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["ENV_CACHE_DIR", "cache_dir", "resolve_cache_dir", "jit_kernel"]

ENV_CACHE_DIR = "PAGEDKV_NUMBA_CACHE_DIR"

_LOCK = threading.Lock()
_UNSET = object()
_resolved: Any = _UNSET  # the directory chosen for this process, or None
_compile_listener: Any = None   # says once that kernels compile (_note_compiles)

logger = logging.getLogger(__name__)


def _default_cache_dir() -> str | None:
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if not home or home == "~":
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "pagedkv_np", "numba")


def _is_writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        # os.access is not trusted: it says yes to root on read-only mounts.
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def resolve_cache_dir() -> tuple[str | None, str]:
    """The cache directory the environment asks for, and where that came from.

    Returns
    -------
    path : str or None
        The candidate directory (not yet checked for writability), or None when
        neither an environment variable nor a home directory gives one.
    source : str
        ``"PAGEDKV_NUMBA_CACHE_DIR"``, ``"NUMBA_CACHE_DIR"`` or ``"default"``.
    """
    for var in (ENV_CACHE_DIR, "NUMBA_CACHE_DIR"):
        value = os.environ.get(var)
        if value:
            return os.path.abspath(os.path.expanduser(value)), var
    return _default_cache_dir(), "default"


def cache_dir() -> str | None:
    """The directory this process caches compiled kernels in, or None.

    Decided once per process, on the first call; warns once (RuntimeWarning)
    when the chosen directory is not writable.
    """
    global _resolved
    with _LOCK:
        if _resolved is _UNSET:
            path, source = resolve_cache_dir()
            if path is not None and _is_writable_dir(path):
                _resolved = path
            else:
                _resolved = None
                where = f"{path!r} (from {source})" if path else "no home directory"
                warnings.warn(
                    f"pagedkv_np: the Numba kernel cache directory {where} is not "
                    f"writable; kernels will be compiled in every process. Set "
                    f"{ENV_CACHE_DIR} to a writable directory to cache them.",
                    RuntimeWarning, stacklevel=3)
        return _resolved


def _note_compiles() -> None:
    """Log once per process, at INFO, when one of this package's kernels starts
    compiling (Numba's ``numba:compile`` event, sent on a disk-cache miss only),
    so that a first call that takes seconds says why."""
    global _compile_listener
    if _compile_listener is not None:
        return
    from numba.core import event

    class CompileNote(event.Listener):
        noted = False

        def on_start(self, ev: Any) -> None:
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            if self.noted or not getattr(func, "__module__", "").startswith("pagedkv_np."):
                return
            self.noted = True
            path = cache_dir()
            where = f"then cached in {path}" if path else "in every process: no writable cache"
            # measured: a SmolLM2 decoder's first chat took 21.5 s with nothing cached
            logger.info("compiling the Numba kernels on their first use: about 20 s for a "
                        "decoder's first request on 2 cores, more on a busy machine, once; "
                        "%s (pagedkv_np.warmup() compiles them ahead)", where)

        def on_end(self, ev: Any) -> None:
            pass

    _compile_listener = CompileNote()
    event.register("numba:compile", _compile_listener)


def jit_kernel(func: Callable | None = None, *, parallel: bool = False,
               error_model: Literal["python", "numpy"] = "python",
               fastmath: Any = False) -> Any:
    """``numba.njit`` with this package's cache policy (see the module docstring).

    Use as ``@jit_kernel`` or ``@jit_kernel(parallel=True)``. ``error_model``
    is Numba's: ``"numpy"`` drops the zero-divisor check of every float
    division (for kernels that divide only by values they checked).
    ``fastmath`` is Numba's too (a set of LLVM flags, e.g. ``{"reassoc"}`` to
    let a reduction be vectorized: its order is then the compiler's, the same
    on every call of one build).
    """
    if func is None:
        return lambda f: jit_kernel(f, parallel=parallel, error_model=error_model,
                                    fastmath=fastmath)
    from ..threads import openmp_defaults

    openmp_defaults()           # before Numba's first parallel kernel loads libgomp
    import numba
    from numba.core import config

    _note_compiles()
    path = cache_dir()
    if path is None:
        return numba.njit(cache=False, parallel=parallel, error_model=error_model,
                          fastmath=fastmath)(func)
    # numba.config copies its options into its globals at run time (from the
    # environment), so mypy sees none of them: hence the ignores below.
    if config.BOUNDSCHECK:  # type: ignore[attr-defined]
        path = os.path.join(path, "boundscheck")
    with _LOCK:
        saved = config.CACHE_DIR  # type: ignore[attr-defined]
        config.CACHE_DIR = path  # type: ignore[attr-defined]
        try:
            return numba.njit(cache=True, parallel=parallel, error_model=error_model,
                              fastmath=fastmath)(func)
        finally:
            config.CACHE_DIR = saved  # type: ignore[attr-defined]
