"""Array backends behind one interface, looked up by name.

========  =====================================================  ===========
name      what it is                                             needs
========  =====================================================  ===========
numpy     the reference: plain NumPy, bit-exact, always there    numpy
numba     the CPU engine: JIT kernels, parallel for large moves  numba
cupy      the GPU engine: CUDA kernels from ``kernels/``         cupy + GPU
========  =====================================================  ===========

A backend's library is imported only when that backend is asked for.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from ..errors import BackendUnavailable, ConfigError
from .base import Backend
from .prepared import PreparedIndices

__all__ = ["Backend", "PreparedIndices", "get_backend", "available_backends", "register_backend",
           "default_backend_name"]

# name -> (module, class, pip extra that provides its library)
_BUILTIN: dict[str, tuple[str, str, str | None]] = {
    "numpy": ("pagedkv_np.backends.numpy_ref", "NumpyBackend", None),
    "numba": ("pagedkv_np.backends.numba_cpu", "NumbaBackend", None),
    "cupy": ("pagedkv_np.backends.cupy_gpu", "CupyBackend", "cuda"),
}
_CUSTOM: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
_LOCK = threading.Lock()


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register a backend under ``name``; ``factory()`` returns the instance."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"Invalid name: expected a non-empty string, got {name!r}")
    with _LOCK:
        _CUSTOM[name] = factory
        _INSTANCES.pop(name, None)


def _load_class(name: str):
    module_name, class_name, extra = _BUILTIN[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" (install it with: pip install 'pagedkv-np[{extra}]')" if extra else ""
        raise BackendUnavailable(
            f"backend {name!r} is unavailable: {exc}{hint}") from exc
    return getattr(module, class_name)


def get_backend(name: str | Backend | None = None) -> Backend:
    """Return the backend called ``name`` (an instance passes through).

    ``None`` or ``"auto"`` gives :func:`default_backend_name`.

    Raises
    ------
    BackendUnavailable
        The backend's library or device is missing; the message says why and
        what to install.
    ConfigError
        No backend has that name.
    """
    if isinstance(name, Backend):
        return name
    if name is None or name == "auto":
        name = default_backend_name()
    if not isinstance(name, str):
        raise ConfigError(f"Invalid backend: expected a name, got {type(name).__name__}")
    with _LOCK:
        inst = _INSTANCES.get(name)
        if inst is not None:
            return inst
        if name in _CUSTOM:
            inst = _CUSTOM[name]()
        elif name in _BUILTIN:
            cls = _load_class(name)
            reason = cls.availability()
            if reason is not None:
                raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")
            inst = cls()
        else:
            known = sorted(set(_BUILTIN) | set(_CUSTOM))
            raise ConfigError(f"Invalid backend: {name!r} is not one of {known}")
        _INSTANCES[name] = inst
        return inst


def available_backends() -> list[str]:
    """Names of the backends that can be used on this machine now."""
    names = []
    for name in list(_BUILTIN) + list(_CUSTOM):
        try:
            get_backend(name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def default_backend_name() -> str:
    """``"numba"`` when Numba imports, else ``"numpy"``."""
    try:
        get_backend("numba")
    except BackendUnavailable:
        return "numpy"
    return "numba"
