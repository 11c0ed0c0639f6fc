"""The CUDA sources of the CuPy backend: where they are and how they compile.

The sources live at the top of a source checkout (``<repo>/kernels``) and
travel inside the wheel as ``pagedkv_np/_kernels``; :func:`kernel_dir` finds
either. Each ``.cu`` file becomes one ``cupy.RawModule``, compiled by NVRTC
the first time one of its kernels is asked for on a device and kept for the
life of the process (CuPy also keeps the binary in its on-disk cache).

Nothing here imports CuPy at module level, so the compile checks in
``scripts/`` and the packaging tests can use the same sources and options on
a machine without CuPy or a GPU.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable

__all__ = [
    "KERNEL_FILES",
    "COMMON_HEADER",
    "kernel_dir",
    "read_source",
    "module_source",
    "compile_options",
    "format_compile_error",
    "get_kernel",
]

# Each file holds one kernel template and its entry points <stem>_b{2,4,8,16}
# (copy_pages also _b1, for int8 stores); paged_quant.cu holds the int8
# store's write and gather, with entry points per K/V type.
KERNEL_FILES: tuple[str, ...] = ("paged_write.cu", "paged_gather.cu", "copy_pages.cu",
                                 "paged_quant.cu")
COMMON_HEADER = "pagedkv_common.cuh"

_PACKAGE_DIR = Path(__file__).resolve().parent.parent

# (device id, file name) -> cupy.RawModule; (device id, entry point) -> kernel
_MODULES: dict[tuple[int, str], Any] = {}
_KERNELS: dict[tuple[int, str], Any] = {}
_LOCK = threading.Lock()

# "paged_write.cu(42): error: ..." as NVRTC writes it.
_ERROR_LINE = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?:catastrophic )?error\b.*$",
                         re.MULTILINE)


def kernel_dir() -> Path:
    """The folder that holds the CUDA sources.

    The installed copy (``pagedkv_np/_kernels``) wins over a checkout's
    ``kernels/`` beside the package, so an installed wheel never picks up
    sources from whatever directory it happens to sit next to.

    Raises
    ------
    BackendUnavailable
        Neither folder holds the sources (a broken install).
    """
    candidates = (_PACKAGE_DIR / "_kernels", _PACKAGE_DIR.parent / "kernels")
    for folder in candidates:
        if (folder / COMMON_HEADER).is_file():
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise BackendUnavailable(
        f"the CUDA kernel sources of pagedkv_np were not found (looked in {looked}); "
        "reinstall the package")


def read_source(file_name: str) -> str:
    """The text of one kernel source or header, as shipped."""
    if file_name not in KERNEL_FILES and file_name != COMMON_HEADER:
        raise BackendUnavailable(f"unknown CUDA source {file_name!r}")
    return (kernel_dir() / file_name).read_text(encoding="utf-8")


def module_source(file_name: str) -> str:
    """The text handed to NVRTC for ``file_name``.

    Two lines go in front of the file: a digest of the shared header, because
    CuPy's on-disk cache keys on this text and the options but not on the
    headers they include; and ``#line 1 "<file>"``, so that compiler messages
    name the ``.cu`` file and its own line numbers rather than a temporary file.
    """
    digest = hashlib.sha256(read_source(COMMON_HEADER).encode("utf-8")).hexdigest()[:16]
    return (f"// {COMMON_HEADER} sha256 {digest}\n"
            f'#line 1 "{file_name}"\n'
            f"{read_source(file_name)}")


def compile_options() -> tuple[str, ...]:
    """NVRTC options for every module (CuPy adds ``-arch`` for the device)."""
    return ("-std=c++17", f"-I{kernel_dir()}")


def format_compile_error(file_name: str, log: str) -> str:
    """A one-paragraph message for a failed compile: the first error with its
    file and line, then the whole compiler log."""
    match = _ERROR_LINE.search(log)
    first = match.group(0).strip() if match else "see the log below"
    return (f"the CUDA kernel source {file_name} failed to compile with NVRTC: {first}\n"
            f"{log.strip()}")


def get_kernel(file_name: str, entry_point: str) -> Any:
    """The kernel ``entry_point`` of ``file_name``, compiled for the current device.

    Modules are built once per device and file, kernels looked up once per
    device and name.

    Raises
    ------
    BackendUnavailable
        The source failed to compile (the message names the file and line) or
        lacks ``entry_point``.
    """
    import cupy  # only reached through the CuPy backend, which imported it

    device_id = cupy.cuda.runtime.getDevice()
    kernel = _KERNELS.get((device_id, entry_point))
    if kernel is not None:
        return kernel
    with _LOCK:
        kernel = _KERNELS.get((device_id, entry_point))
        if kernel is not None:
            return kernel
        module = _MODULES.get((device_id, file_name))
        try:
            if module is None:
                module = cupy.RawModule(code=module_source(file_name),
                                        options=compile_options())
                module.compile()
                _MODULES[(device_id, file_name)] = module
            kernel = module.get_function(entry_point)
        except cupy.cuda.compiler.CompileException as exc:
            raise BackendUnavailable(format_compile_error(file_name, str(exc))) from exc
        except cupy.cuda.driver.CUDADriverError as exc:
            raise BackendUnavailable(
                f"the CUDA kernel {entry_point} of {file_name} could not be loaded: {exc}"
            ) from exc
        _KERNELS[(device_id, entry_point)] = kernel
        return kernel
