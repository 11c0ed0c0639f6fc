"""Compile every CUDA kernel source through NVRTC, as the CuPy backend does.

No GPU is needed: NVRTC is called directly through ctypes and asked for a
cubin of an explicit architecture. The text and options are those the
backend hands to ``cupy.RawModule`` (from ``pagedkv_np.backends._cuda_sources``),
plus the options CuPy itself adds (``-ftz=true``,
``--device-as-default-execution-space``, ``-arch=sm_XX``).

Usage: ``python scripts/check_nvrtc.py [--arch 80 --arch 90] [file.cu ...]``

Exit status: 0 when every file compiled, 1 when one failed, 2 when no NVRTC
library was found (the message says what to install).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedkv_np.backends import _cuda_sources  # noqa: E402

# Options CuPy appends to those of a RawModule before calling NVRTC.
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


class NvrtcNotFound(RuntimeError):
    pass


def load_nvrtc() -> ctypes.CDLL:
    """The NVRTC shared library: from the wheels (nvidia-cuda-nvrtc, found by
    cuda-pathfinder, which CuPy installs) or the CUDA toolkit."""
    try:
        from cuda import pathfinder

        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # not installed, or no NVRTC there: try the toolkit
        pass
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    # The nvidia-cuda-nvrtc wheel, when cuda-pathfinder is not there to find it.
    for entry in sys.path:
        names += [str(p) for p in sorted(Path(entry or ".").glob("nvidia/*/lib/libnvrtc.so.1*"))]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += [str(p) for p in sorted(Path(cuda_home, "lib64").glob("libnvrtc.so*"))]
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NvrtcNotFound(
        "no NVRTC library found: pip install nvidia-cuda-nvrtc (or 'cupy-cuda13x[ctk]'), "
        "or install the CUDA toolkit's libnvrtc")


class Nvrtc:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, str, int]:
        """Compile ``source``; return (ok, log, cubin size in bytes)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)),
                        "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            if result != 0:
                return False, log, 0
            cubin = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)),
                        "nvrtcGetCUBINSize")
            return True, log, cubin.value
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", default=None,
                        help="compute capability without the dot, e.g. 90 (repeatable)")
    parser.add_argument("files", nargs="*", help="kernel sources (default: all)")
    args = parser.parse_args(argv)
    archs = args.arch or ["80", "90"]
    files = [Path(f).name for f in args.files] or list(_cuda_sources.KERNEL_FILES)
    try:
        nvrtc = Nvrtc(load_nvrtc())
    except NvrtcNotFound as exc:
        print(f"check_nvrtc: {exc}", file=sys.stderr)
        return 2
    print(f"NVRTC {nvrtc.version[0]}.{nvrtc.version[1]}, sources in {_cuda_sources.kernel_dir()}")
    failed = 0
    for file_name in files:
        source = _cuda_sources.module_source(file_name)
        for arch in archs:
            options = [*_cuda_sources.compile_options(), *CUPY_OPTIONS, f"-arch=sm_{arch}"]
            ok, log, size = nvrtc.compile(source, file_name, options)
            if ok and not log.strip():
                print(f"ok    {file_name} sm_{arch} ({size} bytes of cubin)")
                continue
            failed += 1
            # Warnings fail the check too, as -Werror does for nvcc.
            message = _cuda_sources.format_compile_error(file_name, log) if not ok else log
            print(f"FAIL  {file_name} sm_{arch}\n{message}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
