"""An LM head kept in its blocks beside the graph, for the engine to run.

onnxruntime 1.32's CPU ``MatMulNBits`` runs 5-8-bit blocks (Q8_0, Q6_K,
...: the tied heads of both real GGUF files here) fast only on int8
activations, which changes answers; exact, it would be a float32 matrix
four times the bytes, read once per token (113 MB for SmolLM2-135M, 671 MB
for Gemma 3 270M). So a GGUF import may leave such a head out of the graph:
the graph's output is then ``hidden`` (the final-normed hidden states of the
kept positions, float32 [B, S, hidden]), the model's metadata names this
file (:data:`METADATA_KEY`), and the engine multiplies by the blocks itself
(:mod:`pagedkv_np.onnxruntime.head`).

The file is an uncompressed ``.npz`` of the head's MatMulNBits parts
(:class:`~pagedkv_np.models.gguf.blocks.NBits`), its logit soft-cap (0:
none) and a format number. :func:`read_head` checks every array's dtype and
shape against the others, so a truncated or foreign file is refused with a
:class:`~pagedkv_np.errors.ModelFolderError`, never half-used.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from ..errors import ModelFolderError
from .gguf.blocks import NBits

__all__ = ["METADATA_KEY", "HEAD_FILE", "HIDDEN_OUTPUT", "save_head", "read_head"]

#: the ONNX model's metadata key whose value is the head file's name (in its folder)
METADATA_KEY = "pagedkv_np.lm_head"
#: the file's name in a model folder
HEAD_FILE = "lm_head.npz"
#: the graph output the head reads
HIDDEN_OUTPUT = "hidden"
_FORMAT = 1


def save_head(path: str | os.PathLike, parts: NBits, softcap: float = 0.0) -> None:
    """Write ``parts`` (a ``[hidden, vocab]`` head) and its soft-cap to ``path``."""
    arrays = {"format": np.array(_FORMAT), "bits": np.array(parts.bits),
              "block_size": np.array(parts.block_size), "codes": parts.B,
              "scales": parts.scales, "softcap": np.array(softcap, np.float64)}
    if parts.zero_points is not None:
        arrays["zero_points"] = parts.zero_points
    if parts.offsets is not None:
        arrays["offsets"] = parts.offsets
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def read_head(path: str | os.PathLike) -> tuple[NBits, float]:
    """``(parts, softcap)`` of a file :func:`save_head` wrote.

    Raises
    ------
    ModelFolderError
        No such file, not an ``.npz``, another format, or arrays whose
        dtypes or shapes do not fit together.
    """
    where = os.fspath(path)
    try:
        with np.load(where, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ModelFolderError(f"Invalid LM head file {where!r}: {exc}") from exc

    def get(name: str, dtype: type, ndim: int) -> np.ndarray:
        a = arrays.get(name)
        if a is None or a.dtype != dtype or a.ndim != ndim:
            raise ModelFolderError(
                f"Invalid LM head file {where!r}: {name!r} should be a {ndim}-D {dtype.__name__} "
                f"array, got {None if a is None else (a.dtype, a.shape)}")
        return a

    if int(get("format", np.int64, 0)) != _FORMAT:
        raise ModelFolderError(f"Invalid LM head file {where!r}: format {arrays['format']}, "
                               f"expected {_FORMAT}")
    bits, block = int(get("bits", np.int64, 0)), int(get("block_size", np.int64, 0))
    codes, scales = get("codes", np.uint8, 3), get("scales", np.float32, 1)
    n, num_blocks, width = codes.shape
    if bits not in (4, 8) or block not in (16, 32) or width != block * bits // 8 \
            or scales.shape != (n * num_blocks,) or n == 0 or num_blocks == 0:
        raise ModelFolderError(
            f"Invalid LM head file {where!r}: {bits}-bit blocks of {block} with codes "
            f"{codes.shape} and scales {scales.shape} do not fit together")
    zero_points = offsets = None
    if "zero_points" in arrays:
        zero_points = get("zero_points", np.uint8, 1)
        if zero_points.shape[0] != n * ((num_blocks * bits + 7) // 8):
            raise ModelFolderError(f"Invalid LM head file {where!r}: zero points "
                                   f"{zero_points.shape} for {n} rows of {num_blocks} blocks")
    if "offsets" in arrays:
        offsets = get("offsets", np.float32, 2)
        if offsets.shape != (num_blocks, n):
            raise ModelFolderError(f"Invalid LM head file {where!r}: offsets {offsets.shape}, "
                                   f"expected {(num_blocks, n)}")
    softcap = float(get("softcap", np.float64, 0))
    if not np.isfinite(softcap) or softcap < 0:
        raise ModelFolderError(f"Invalid LM head file {where!r}: soft-cap {softcap}")
    return NBits(bits, block, codes, scales, zero_points, offsets), softcap
