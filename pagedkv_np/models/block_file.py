"""Weights in blocks kept beside a graph, in uncompressed ``.npz`` files.

Each weight is stored as its MatMulNBits parts
(:class:`~pagedkv_np.models.gguf.blocks.NBits`: ``bits``, ``block_size``,
``codes``, ``scales`` and, where it has them, ``zero_points`` and
``offsets``), its array names behind a prefix of its own. :func:`read_parts`
checks every array's dtype and shape against the others, so a truncated or
foreign file is refused with a :class:`~pagedkv_np.errors.ModelFolderError`,
never half-used.

Two files use it:

- the LM head file (:mod:`pagedkv_np.models.head_file`);
- the step file (:data:`STEP_FILE`), named by the graph's metadata under
  :data:`STEP_METADATA_KEY`: the layer weights of 5-8-bit block types
  (Q5_0, Q6_K, Q8_0, ...) that a GGUF import at ``accuracy_level=0`` makes
  float32 in the graph, kept in their blocks as well, for the engine's own
  decode step (:mod:`pagedkv_np.onnxruntime.native`). onnxruntime 1.32's
  8-bit ``MatMulNBits`` at level 0 took 45x a float32 ``MatMul``'s time for
  one row, 4.4x for 64 and 1.1x for 512 here (640 x 2048, 2 threads), so
  prompts keep the float32 copy; a decode step reads a quarter of its bytes
  from the blocks (Gemma 3 270M Q4_K_M: 100 MB of 5-8-bit layer weights
  against 400 MB in float32).
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from ..errors import ModelFolderError, UnsupportedModelError
from .gguf.blocks import NBits

__all__ = ["STEP_METADATA_KEY", "STEP_FILE", "part_arrays", "load_arrays", "get_array",
           "read_parts", "beside", "save_step_blocks", "read_step_blocks"]

#: the ONNX model's metadata key whose value is the step file's name (in its folder)
STEP_METADATA_KEY = "pagedkv_np.step_blocks"
#: the step file's name in a model folder
STEP_FILE = "step_blocks.npz"
_STEP_FORMAT = 1
_PARTS = ("bits", "block_size", "codes", "scales", "zero_points", "offsets")


def part_arrays(parts: NBits, prefix: str = "") -> dict[str, np.ndarray]:
    """``parts`` as named arrays, each name behind ``prefix``."""
    arrays = {"bits": np.array(parts.bits, np.int64),
              "block_size": np.array(parts.block_size, np.int64),
              "codes": parts.B, "scales": parts.scales}
    if parts.zero_points is not None:
        arrays["zero_points"] = parts.zero_points
    if parts.offsets is not None:
        arrays["offsets"] = parts.offsets
    return {prefix + name: a for name, a in arrays.items()}


def load_arrays(path: str | os.PathLike, what: str, form: int) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path``, whose ``format`` must be
    ``form`` (``what``: the file's kind, for errors).

    Raises
    ------
    ModelFolderError
        No such file, not an ``.npz`` without pickles, or another format.
    """
    where = os.fspath(path)
    try:
        with np.load(where, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ModelFolderError(f"Invalid {what} {where!r}: {exc}") from exc
    found = int(get_array(arrays, "format", np.int64, 0, where, what))
    if found != form:
        raise ModelFolderError(f"Invalid {what} {where!r}: format {found}, expected {form}")
    return arrays


def beside(model_path: str | None, name: str, what: str) -> str:
    """The path of the file ``name`` that a model's metadata names, in the
    folder of the model file ``model_path`` (``what``: the file's kind, with
    its article, for errors).

    Raises
    ------
    UnsupportedModelError
        The model was not loaded from a path (``None``: bytes or a proto),
        or ``name`` points outside its folder.
    """
    if model_path is None:
        raise UnsupportedModelError(
            f"the model names {what} {name!r} of its folder: load it from its path (or "
            "OrtDecoder.from_pretrained(folder)), not from bytes")
    if os.path.basename(name) != name:
        raise UnsupportedModelError(f"the model names {what} {name!r} outside its folder")
    return os.path.join(os.path.dirname(os.path.abspath(model_path)), name)


def get_array(arrays: dict, name: str, dtype: type, ndim: int, where: str,
              what: str) -> np.ndarray:
    """``arrays[name]``, refused unless an ``ndim``-D ``dtype`` array."""
    a = arrays.get(name)
    if a is None or a.dtype != dtype or a.ndim != ndim:
        raise ModelFolderError(
            f"Invalid {what} {where!r}: {name!r} should be a {ndim}-D {dtype.__name__} "
            f"array, got {None if a is None else (a.dtype, a.shape)}")
    return a


def read_parts(arrays: dict, prefix: str, where: str, what: str) -> NBits:
    """The weight whose arrays :func:`part_arrays` named behind ``prefix``.

    Raises
    ------
    ModelFolderError
        A part missing, or dtypes and shapes that do not fit together.
    """
    def get(name: str, dtype: type, ndim: int) -> np.ndarray:
        return get_array(arrays, prefix + name, dtype, ndim, where, what)

    bits, block = int(get("bits", np.int64, 0)), int(get("block_size", np.int64, 0))
    codes, scales = get("codes", np.uint8, 3), get("scales", np.float32, 1)
    n, num_blocks, width = codes.shape
    if bits not in (4, 8) or block not in (16, 32) or width != block * bits // 8 \
            or scales.shape != (n * num_blocks,) or n == 0 or num_blocks == 0:
        raise ModelFolderError(
            f"Invalid {what} {where!r}: {prefix}{bits}-bit blocks of {block} with codes "
            f"{codes.shape} and scales {scales.shape} do not fit together")
    zero_points = offsets = None
    if prefix + "zero_points" in arrays:
        zero_points = get("zero_points", np.uint8, 1)
        if zero_points.shape[0] != n * ((num_blocks * bits + 7) // 8):
            raise ModelFolderError(f"Invalid {what} {where!r}: {prefix}zero points "
                                   f"{zero_points.shape} for {n} rows of {num_blocks} blocks")
    if prefix + "offsets" in arrays:
        offsets = get("offsets", np.float32, 2)
        if offsets.shape != (num_blocks, n):
            raise ModelFolderError(f"Invalid {what} {where!r}: {prefix}offsets "
                                   f"{offsets.shape}, expected {(num_blocks, n)}")
    return NBits(bits, block, codes, scales, zero_points, offsets)


def save_step_blocks(path: str | os.PathLike, weights: dict[str, NBits]) -> None:
    """Write ``weights`` (graph name -> ``[in, out]`` weight's parts) to ``path``."""
    arrays = {"format": np.array(_STEP_FORMAT, np.int64)}
    for name, parts in weights.items():
        if not name or "/" in name:
            raise ModelFolderError(f"Invalid weight name {name!r} for a step file")
        arrays.update(part_arrays(parts, name + "/"))
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def read_step_blocks(path: str | os.PathLike) -> dict[str, NBits]:
    """The weights by graph name of a file :func:`save_step_blocks` wrote.

    Raises
    ------
    ModelFolderError
        No such file, not an ``.npz``, another format, an array that belongs
        to no weight, or a weight whose arrays do not fit together.
    """
    what, where = "step file", os.fspath(path)
    arrays = load_arrays(path, what, _STEP_FORMAT)
    names = set()
    for key in arrays:
        if key != "format":
            name, _, part = key.rpartition("/")
            if not name or part not in _PARTS:
                raise ModelFolderError(f"Invalid {what} {where!r}: array {key!r} belongs to "
                                       "no weight")
            names.add(name)
    return {name: read_parts(arrays, name + "/", where, what) for name in sorted(names)}
