"""A built graph's weights as the engine's own decode step reads them.

:class:`GraphWeights` reads a graph's constants on demand (initializers,
``Constant`` nodes, external data from the model's folder) and gives each
product's weight as :class:`~pagedkv_np.backends.block_gemv.BlockWeight`
where it has blocks: those of the graph's ``MatMulNBits`` and
``GatherBlockQuantized`` nodes, or, for a weight that the graph holds as
float32, those of the step file its metadata names
(:mod:`pagedkv_np.models.block_file`): :meth:`GraphWeights.product` checks
each product's weights against the geometry, and :meth:`GraphWeights.check_used`
that the file holds no weight the graph lacks.
"""

from __future__ import annotations

import os
import types
from typing import Any

import numpy as np

from ..backends.block_gemv import BlockWeight
from ..errors import ModelFolderError, UnsupportedModelError
from ..models.block_file import STEP_METADATA_KEY, beside, read_step_blocks

__all__ = ["GraphWeights"]


class GraphWeights:
    """A graph's constants by name (external data and the step file from ``base``).

    Raises
    ------
    UnsupportedModelError
        The metadata names a step file but the graph was not loaded from its
        folder (``base`` None), or names one outside that folder.
    ModelFolderError
        The step file is unreadable.
    """

    def __init__(self, proto: Any, base: str | None) -> None:
        from onnx import numpy_helper

        self._to_array = numpy_helper.to_array
        self.base = base
        self.tensors = {t.name: t for t in proto.graph.initializer}
        for node in proto.graph.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        self.tensors[node.output[0]] = attr.t
        self.nodes = list(proto.graph.node)
        self._bits = _block_attrs(self.nodes)
        self._used: set[str] = set()
        props = {p.key: p.value for p in proto.metadata_props}
        self.step_blocks = {} if STEP_METADATA_KEY not in props else \
            self._step_blocks(props[STEP_METADATA_KEY])

    def _step_blocks(self, name: str) -> dict[str, BlockWeight]:
        # base is the model file's folder: any file name in it will do
        path = beside(None if self.base is None else os.path.join(self.base, "model.onnx"),
                      name, "a step file")
        return {key: BlockWeight.from_nbits(parts)
                for key, parts in read_step_blocks(path).items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def array(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise UnsupportedModelError(f"the graph has no initializer {name!r}")
        return np.asarray(self._to_array(self.tensors[name], base_dir=self.base or ""))

    def floats(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.array(name), dtype=np.float32)

    def weight(self, name: str) -> BlockWeight | np.ndarray | None:
        """The weight ``name`` as blocks or float32 ``[K, N]``, None when absent."""
        codes = name + ".qweight"
        if codes in self:
            if codes not in self._bits:
                raise UnsupportedModelError(f"no node reads {codes!r}: cannot tell its bits")
            bits, block_size = self._bits[codes]
            parts = types.SimpleNamespace(
                bits=bits, block_size=block_size, B=self.array(codes),
                scales=self.array(name + ".scales"),
                zero_points=self.array(name + ".qzeros") if name + ".qzeros" in self else None,
                offsets=self.array(name + ".mins") if name + ".mins" in self else None)
            return BlockWeight.from_nbits(parts)
        if name in self.step_blocks:
            return self.step_blocks[name]
        return self.floats(name) if name in self else None

    def required(self, name: str) -> BlockWeight | np.ndarray:
        """:meth:`weight`, which must be there."""
        w = self.weight(name)
        if w is None:
            raise UnsupportedModelError(f"the graph has no weight {name!r}")
        return w

    def product(self, name: str, parts: tuple[str, ...] = (), shape: tuple[int, int] = (0, 0)
                ) -> list[BlockWeight | np.ndarray]:
        """The weights of one ``[K, N]`` product: ``name``'s, else (the graph
        holding no such weight, or holding it in float32 while the step file
        has every part in blocks) each of ``parts``' (their outputs side by
        side).

        Raises
        ------
        UnsupportedModelError
            Neither ``name`` nor all of ``parts``.
        ModelFolderError
            Weights whose shapes do not make ``shape`` (a foreign step file).
        """
        # the parts first where the step file has them all and not the whole:
        # the graph's float32 whole is then never read
        split = name not in self.step_blocks and bool(parts) and all(
            p in self.step_blocks for p in parts)
        whole = None if split else self.weight(name)
        found = [whole] if whole is not None else [self.weight(p) for p in parts]
        if not found or any(w is None for w in found):
            raise UnsupportedModelError(f"the graph has neither {name!r} nor all of "
                                        f"{list(parts)}")
        dims = [_dims(w) for w in found]    # type: ignore[arg-type]
        if {k for k, _ in dims} != {shape[0]} or sum(n for _, n in dims) != shape[1]:
            raise ModelFolderError(f"Invalid weights for {name!r}: {dims}, expected "
                                   f"{list(shape)} (the graph's geometry)")
        self._used.update(w for w in (name, *parts) if w in self.step_blocks)
        return found    # type: ignore[return-value]

    def check_used(self) -> None:
        """Raise ModelFolderError where the step file has a weight no product read."""
        left = sorted(set(self.step_blocks) - self._used)
        if left:
            raise ModelFolderError(f"Invalid step file: weights {left[:4]} are not the "
                                   "graph's")


def _dims(w: BlockWeight | np.ndarray) -> tuple[int, int]:
    if isinstance(w, BlockWeight):
        return w.in_features, w.out_features
    return int(w.shape[0]), int(w.shape[1])


def _block_attrs(nodes: list) -> dict[str, tuple[int, int]]:
    """Codes initializer -> (bits, block_size), from the nodes that read it."""
    found = {}
    for node in nodes:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            attrs = {a.name: a.i for a in node.attribute}
            codes = node.input[1] if node.op_type == "MatMulNBits" else node.input[0]
            found[codes] = (int(attrs.get("bits", 4)), int(attrs["block_size"]))
    return found
