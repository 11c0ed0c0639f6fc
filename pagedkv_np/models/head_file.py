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
(:mod:`pagedkv_np.models.block_file`, no prefix), its logit soft-cap (0:
none) and a format number; :func:`read_head` refuses a truncated or foreign
file with a :class:`~pagedkv_np.errors.ModelFolderError`, never half-used.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import ModelFolderError
from .block_file import get_array, load_arrays, part_arrays, read_parts
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
    arrays = {"format": np.array(_FORMAT), "softcap": np.array(softcap, np.float64),
              **part_arrays(parts)}
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
    what, where = "LM head file", os.fspath(path)
    arrays = load_arrays(path, what, _FORMAT)
    parts = read_parts(arrays, "", where, what)
    softcap = float(get_array(arrays, "softcap", np.float64, 0, where, what))
    if not np.isfinite(softcap) or softcap < 0:
        raise ModelFolderError(f"Invalid {what} {where!r}: soft-cap {softcap}")
    return parts, softcap
