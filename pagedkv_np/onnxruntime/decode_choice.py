"""Which decode step and LM head an :class:`~pagedkv_np.onnxruntime.OrtDecoder`
runs for a graph: the engine's own step (:class:`~pagedkv_np.onnxruntime.native.NativeDecode`)
where the graph allows it and it wins, and a head in blocks beside the graph
where its metadata names one (:class:`~pagedkv_np.onnxruntime.head.BlockHead`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, DTypeError
from ..models.block_file import beside
from ..models.geometry import geometry_from_json
from .head import BlockHead
from .native import NativeDecode

__all__ = ["engine_head", "from_gguf", "native_decode_step"]


def engine_head(source: Any, head_file: str, threads: int | None, int8: bool,
                 int8x2: bool = False) -> BlockHead:
    """The head a graph's metadata names, beside its file, compiled now."""
    path = beside(source if isinstance(source, str) else None, head_file, "an LM head file")
    head = BlockHead(path, threads, int8, int8x2)
    head.warmup()
    return head


def from_gguf(model_folder: Any) -> bool:
    """Whether ``model_folder`` was imported from a GGUF file."""
    config = getattr(model_folder, "config", None) or {}
    imported = config.get("pagedkv_np")
    return isinstance(imported, dict) and str(imported.get("source", "")).lower().endswith(
        ".gguf")


def native_decode_step(wanted: bool | None, source: Any, proto: Any, facts: Any, family: str,
                   providers: list | None, threads: int | None,
                   int8: bool | None, gguf: bool = False) -> NativeDecode | None:
    """The engine's own decode step where the graph allows it and ``wanted``
    is not False; True where it cannot be is a ConfigError. ``int8`` None:
    int8 activations where the graph's products take them, or the model was
    imported from a GGUF file (``gguf``)."""
    if wanted is not None and not isinstance(wanted, bool):
        raise DTypeError(f"Invalid native_decode: expected a bool or None, got {wanted!r}")
    why = None
    if facts.geometry is None:
        why = "the graph carries no geometry (only graphs that pagedkv_np builds do)"
    elif not facts.has_gqa or family not in ("auto", "gqa"):
        why = "the graph is not of the gqa family"
    elif providers and any(p != "CPUExecutionProvider" for p in providers):
        why = "the session runs on another provider than the CPU's"
    if int8 is not None and not isinstance(int8, bool):
        raise DTypeError(f"Invalid int8_activations: expected a bool or None, got {int8!r}")
    if int8 and (wanted is False or why is not None):
        raise ConfigError("Invalid int8_activations: they need the engine's own decode step, "
                          f"and {why or 'native_decode is False'}")
    if wanted is False or (why is not None and wanted is None):
        return None
    if why is not None:
        raise ConfigError(f"Invalid native_decode: {why}")
    by_default = int8 is None and not facts.int8_matmuls and gguf
    int8 = (facts.int8_matmuls or gguf) if int8 is None else int8
    if wanted is None and not int8:
        # float32 activations: onnxruntime's MatMulNBits beat the step's kernels
        # (SmolLM2 Q4_1, 2 threads, quiet: 65.6 against 41.3 tok/s at batch 1,
        # 85.8 against 72.3 at batch 4; scripts/bench_decode.py)
        return None
    native = NativeDecode.from_source(source, proto, geometry_from_json(facts.geometry),
                                      threads, with_head=facts.head_file is None, int8=int8)
    if wanted is None and by_default and native.float_linears():
        # the GGUF default, but weights the import made float32 (5-8-bit types at
        # accuracy_level 0): onnxruntime's graph multiplies those faster (Gemma 3
        # 270M Q4_K_M: 27.8 tok/s against 9.5; scripts/bench_decode.py)
        return None
    native.warmup()
    return native
