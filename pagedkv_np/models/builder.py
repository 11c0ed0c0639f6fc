"""Nodes and initializers of a graph, and the nodes that run a weight.

:class:`GraphBuilder` collects ONNX nodes and initializers under unique
names for :mod:`pagedkv_np.models.graph`, and turns a weight into the nodes
that use it: a float array into ``MatMul`` or ``Gather``, a
:class:`~pagedkv_np.models.gguf.blocks.BlockQuantized` one into
onnxruntime's contrib ops, which read the blocks as they are:

``MatMulNBits``           ``x @ w`` (plus a block-sum term for offsets: see
                          :mod:`pagedkv_np.models.gguf.blocks`)
``GatherBlockQuantized``  an embedding's rows, dequantized as gathered

The two ops share one initializer of codes: a tied LM head and the
embedding it reads are one copy of the file's blocks (codes ``[N, blocks,
bytes]``, which is the shape MatMulNBits checks; GatherBlockQuantized
reads it with ``quantize_axis=2``, its scales reshaped to ``[N, blocks, 1]``
in the graph). GatherBlockQuantized's zero points are unpacked
``[N, blocks, 1]`` (a 4-bit one carries the zero in both nibbles); an
offset is gathered by rows and added.

Checked on onnxruntime 1.32's CPU provider: GatherBlockQuantized's rows
equal the blocks' values exactly for 4 and 8 bits, blocks of 16 and 32,
zero points 0, 4, 8, 16, 32 and 128; MatMulNBits accepts the shared codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from .geometry import Linear
from .gguf.blocks import BlockQuantized, NBits
from .onnx_data import ExternalData

__all__ = ["GraphBuilder", "BlockInputs", "pack"]


def pack(ws: list[Linear]) -> Linear | None:
    """One weight computing ``ws``' outputs side by side (columns, in order),
    or None when they cannot share one node: float arrays of one dtype, or
    blocks of one kind (a block row is an output's whole row, so the packed
    weight's rows are theirs, byte for byte). Fewer, larger nodes cost less
    per token at batch 1, where each node's fixed cost is a large part."""
    if len({w.shape[0] for w in ws}) != 1:
        return None
    if all(isinstance(w, BlockQuantized) for w in ws):
        kinds = {w.kind for w in ws}       # type: ignore[union-attr]
        if len(kinds) != 1:
            return None
        return BlockQuantized(kinds.pop(), np.concatenate([w.blocks for w in ws]))  # type: ignore[union-attr]
    arrays = [w for w in ws if isinstance(w, np.ndarray)]
    if len(arrays) == len(ws) and len({w.dtype for w in arrays}) == 1:
        return np.concatenate(arrays, axis=1)
    return None


@dataclass(frozen=True)
class BlockInputs:
    """The initializer names of one BlockQuantized weight (registered once)."""

    weight: BlockQuantized
    parts: NBits
    codes: str
    scales: str
    zero_points: str | None
    offsets: str | None      # [blocks, N], the block-sum term's matrix


class GraphBuilder:
    """Collects nodes and initializers with unique names.

    ``accuracy_level`` is MatMulNBits' default (a node may be given its own);
    with ``data`` the initializers stream into an external data file.
    """

    def __init__(self, accuracy_level: int, data: ExternalData | None = None) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self.accuracy_level = accuracy_level
        self.data = data
        self.blocksums: dict[tuple[str, int], str] = {}
        self._blocks: dict[int, BlockInputs] = {}
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: Any, hint: str = "c", dtype: Any = None) -> str:
        return self.init(np.asarray(value, dtype=dtype), self.name(hint))

    def init(self, value: np.ndarray, name: str) -> str:
        value = np.ascontiguousarray(value)
        self.initializers.append(numpy_helper.from_array(value, name) if self.data is None
                                 else self.data.tensor(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, *,
           outputs: list[str] | None = None, num_outputs: int = 1, domain: str = "",
           **attrs: Any):
        if outputs is None:
            outputs = [self.name(hint or op_type.lower()) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs,
                                           name=self.name(op_type), domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def float_init(self, value: np.ndarray, name: str) -> str:
        """An initializer read as float32 (float16 ones are cast, folded at load)."""
        self.init(value, name)
        if value.dtype == np.float16:
            return self.op("Cast", [name], to=TensorProto.FLOAT)
        return name

    def blocks(self, w: BlockQuantized, name: str) -> BlockInputs:
        """``w``'s initializers, written the first time it is asked for."""
        known = self._blocks.get(id(w))
        if known is not None:
            return known
        parts = w.matmul_nbits()
        zero_points = None
        if parts.zero_points is not None:
            zero_points = self.init(parts.zero_points, name + ".qzeros")
        inputs = BlockInputs(
            w, parts, self.init(parts.B, name + ".qweight"),
            self.init(parts.scales, name + ".scales"), zero_points,
            None if parts.offsets is None else self.init(parts.offsets, name + ".mins"))
        self._blocks[id(w)] = inputs      # the entry keeps w alive: its id stays unique
        return inputs

    def linear(self, x: str, w: Linear, name: str, out: str | None = None,
               accuracy_level: int | None = None) -> str:
        """``x @ w`` for x float32 [..., in], into ``out`` when given;
        ``accuracy_level``: this node's, if not the builder's."""
        outputs = None if out is None else [out]
        if not isinstance(w, BlockQuantized):
            return self.op("MatMul", [x, self.float_init(w, name)], outputs=outputs)
        k, n = w.shape
        b = self.blocks(w, name)
        parts = b.parts
        inputs = [x, b.codes, b.scales] + ([] if b.zero_points is None else [b.zero_points])
        level = self.accuracy_level if accuracy_level is None else accuracy_level
        y = self.op("MatMulNBits", inputs, domain="com.microsoft", K=k, N=n,
                    bits=parts.bits, block_size=parts.block_size, accuracy_level=level,
                    outputs=outputs if b.offsets is None else None)
        if b.offsets is None:
            return y
        key = (x, parts.block_size)
        if key not in self.blocksums:    # q/k/v and gate/up read the same x: sum once
            blocks = self.op("Reshape", [x, self.const(np.array([0, 0, -1, parts.block_size],
                                                                np.int64))])
            self.blocksums[key] = self.op("ReduceSum",
                                          [blocks, self.const(np.array([-1], np.int64))],
                                          keepdims=0)
        mins = self.op("MatMul", [self.blocksums[key], b.offsets])
        return self.op("Add", [y, mins], outputs=outputs)

    def linears(self, x: str, named: dict[str, Linear], name: str) -> list[str]:
        """``x @ w`` for each weight of ``named`` (same input size), as one node
        ``name`` and a ``Split`` where they pack (:func:`pack`), else one node each
        under its own name."""
        ws = list(named.values())
        packed = pack(ws)
        if packed is None:
            return [self.linear(x, w, part) for part, w in named.items()]
        y = self.linear(x, packed, name)
        sizes = self.const(np.array([w.shape[1] for w in ws], np.int64))
        return self.op("Split", [y, sizes], axis=-1, num_outputs=len(ws))

    def rows(self, w: BlockQuantized, ids: str, name: str) -> str:
        """Rows ``ids`` (int64 [B, S]) of an embedding in blocks, one row of
        blocks per token (``w.shape`` is ``(hidden, vocab)``, as a head's):
        float32 [B, S, hidden]."""
        b = self.blocks(w, name)
        parts, spec = b.parts, w.spec
        num_blocks = w.shape[0] // parts.block_size
        per_block = self.const(np.array([-1, num_blocks, 1], np.int64))
        inputs = [b.codes, ids, self.op("Reshape", [b.scales, per_block])]
        if b.zero_points is not None:
            zero = spec.zero | (spec.zero << 4) if parts.bits == 4 else spec.zero
            inputs.append(self.init(np.full((w.shape[1], num_blocks, 1), zero, np.uint8),
                                    name + ".gather_qzeros"))
        x = self.op("GatherBlockQuantized", inputs, domain="com.microsoft", bits=parts.bits,
                    block_size=parts.block_size, gather_axis=0, quantize_axis=2)
        if parts.offsets is not None:   # [B, S, blocks, 1] beside [B, S, blocks, block]
            offsets = self.init(np.ascontiguousarray(parts.offsets.T)[..., None],
                                name + ".row_mins")
            x = self.op("Add", [x, self.op("Gather", [offsets, ids], axis=0)])
        return self.op("Reshape", [x, self.const(np.array([0, 0, -1], np.int64))])
