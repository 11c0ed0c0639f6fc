"""The engine's own decode step for the decoders this package builds.

A graph built by :mod:`pagedkv_np.models.graph` carries its geometry in its
metadata (:data:`~pagedkv_np.models.geometry.GEOMETRY_KEY`). For such a
graph :class:`NativeDecode` computes a decode step itself, reading the
graph's own initializers: the block weights through Numba kernels that take
them as they are (:mod:`pagedkv_np.backends.block_gemv`), float ones through
:func:`~pagedkv_np.backends.decode_ops.float_matmul`, and the rest with
:mod:`pagedkv_np.backends.decode_ops`. It writes each new token's K/V into,
and attends over, the same per-layer buffers that onnxruntime's prompt runs
fill (:class:`~pagedkv_np.onnxruntime.runners.GqaRunner`), so prompts still
run through onnxruntime (its GEMMs win there) while decode steps skip its
per-node costs, and attention reads live positions only, not the buffer's
capacity.

Every kernel computes a row (one sequence's token) with the same code
whatever the batch, so a sequence's tokens do not depend on the others in
its batch. The numbers differ from onnxruntime's decode by float32
roundings (another summation order), as onnxruntime's own batch-1 and
batch-8 kernels differ from each other; greedy output is checked against
full recompute and the NumPy reference in ``tests/test_native_decode.py``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np

from ..backends import decode_ops as ops
from ..backends.block_gemv import BlockWeight, block_product
from ..backends.block_q8 import q8_operands, q8_product
from ..backends.block_q8_tiles import packs, q8_tiled_product, q8_tiles
from ..errors import ConfigError, DTypeError, ShapeError, UnsupportedModelError
from ..models.geometry import DecoderGeometry
from ..threads import StepThreads
from .graph_weights import GraphWeights

__all__ = ["FLOAT_MAX_ROWS", "NativeDecode", "NativeLinear"]

_CHUNKS_PER_THREAD = 8
# chunks per thread of a block product: 16, handed out one at a time (as
# block_matmul and q8_matmul), so that a thread that loses its core holds back little
_BLOCK_CHUNKS = 16
#: most rows a float32-activation step takes; larger batches decode through
#: the graph, whose GEMMs win there (SmolLM2, 2 threads, quiet: batch 4 1.11x
#: the graph's tokens/s, batch 8 0.70x; int8 steps take every batch, 1.35x at 8)
FLOAT_MAX_ROWS = 4
# multiply-adds of one layer's attention (positions x heads x head_dim) from which
# its heads run in parallel: SmolLM2 (9 heads of 64) from about 100 positions
_PARALLEL_ATTENTION = 1 << 16


class NativeLinear:
    """``x @ w`` for a weight in blocks (:class:`BlockWeight`) or float32 ``[K, N]``;
    ``int8``: blocks multiply activations rounded to int8 per block, from tiles
    of 16 outputs where the weight packs (:mod:`~pagedkv_np.backends.block_q8_tiles`),
    else as :func:`~pagedkv_np.backends.block_q8.q8_matmul` does.

    Calling it checks ``x`` and ``out`` against the weight's shape, then runs
    the kernel without the per-call preparation of
    :func:`~pagedkv_np.backends.block_gemv.block_matmul` (done once here).
    """

    def __init__(self, weight: BlockWeight | np.ndarray, int8: bool = False) -> None:
        self.int8 = int8
        #: whether the weight is in blocks (else float32)
        self.blocks = isinstance(weight, BlockWeight)
        if isinstance(weight, BlockWeight):
            self.in_features, self.out_features = weight.in_features, weight.out_features
        else:
            self.in_features, self.out_features = weight.shape
        blocks = weight if int8 and isinstance(weight, BlockWeight) else None
        self._tiles = q8_tiles(blocks) if blocks is not None and packs(blocks) else None
        self._operands = q8_operands(blocks) if blocks is not None and not self._tiles else None
        #: the weight as given; None where its tiles are the one copy kept
        #: (SmolLM2's body: 60 MB less resident)
        self.weight = None if self._tiles is not None else weight

    def __call__(self, x: np.ndarray, out: np.ndarray, threads: int | None = None) -> np.ndarray:
        """``out[:] = x @ w`` with ``threads`` Numba threads (default: Numba's
        current count; the caller sets ``numba.set_parallel_chunksize(1)``).

        Raises
        ------
        DTypeError
            ``x`` or ``out`` is not float32.
        ShapeError
            ``x`` or ``out`` is not a C-contiguous ``[M, K]`` / ``[M, N]``.
        """
        m = x.shape[0]
        if x.dtype != np.float32 or out.dtype != np.float32:
            raise DTypeError(f"Invalid product: x {x.dtype}, out {out.dtype}; expected float32")
        if (x.shape != (m, self.in_features) or out.shape != (m, self.out_features)
                or not x.flags.c_contiguous or not out.flags.c_contiguous):
            raise ShapeError(f"Invalid product: x {x.dtype}{x.shape}, out {out.dtype}"
                             f"{out.shape} for a [{self.in_features}, {self.out_features}] "
                             f"weight")
        if m == 0:
            return out
        if threads is None:
            threads = numba.get_num_threads()
        if self._tiles is not None:
            q8_tiled_product(x, self._tiles, threads, out)
        elif self._operands is not None:
            chunks = 0 if threads == 1 else min(self.out_features, threads * _BLOCK_CHUNKS)
            q8_product(x, self._operands, chunks, out)
        elif isinstance(self.weight, BlockWeight):
            block_product(x, self.weight, min(self.out_features, threads * _BLOCK_CHUNKS), out)
        else:
            chunks = min(self.out_features, threads * _CHUNKS_PER_THREAD)
            ops.float_matmul(x, self.weight, chunks, out)   # type: ignore[arg-type]
        return out


def _linears(init: GraphWeights, packed: str, parts: tuple[str, ...], shape: tuple[int, int],
             int8: bool) -> list[NativeLinear]:
    """One packed linear, else one per part (:meth:`GraphWeights.product`)."""
    return [NativeLinear(w, int8) for w in init.product(packed, parts, shape)]


class _Layer:
    def __init__(self, init: GraphWeights, c: DecoderGeometry, i: int,
                 tables: tuple[np.ndarray, np.ndarray], int8: bool) -> None:
        p = f"l{i}."
        nq, nkv, hidden, inter = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                  c.hidden_size, c.intermediate_size)
        self.qkv = _linears(init, p + "wqkv", (p + "wq", p + "wk", p + "wv"),
                            (hidden, nq + 2 * nkv), int8)
        bias = None
        if c.qkv_bias:
            bias = (init.floats(p + "bqkv") if p + "bqkv" in init else
                    np.concatenate([init.floats(p + f"b{w}") for w in "qkv"]))
        self.bias = bias
        self.q_norm = init.floats(p + "q_norm") if c.qk_norm else None
        self.k_norm = init.floats(p + "k_norm") if c.qk_norm else None
        self.wo, = _linears(init, p + "wo", (), (nq, hidden), int8)
        self.gate_up = _linears(init, p + "w_gate_up", (p + "w_gate", p + "w_up"),
                                (hidden, 2 * inter), int8)
        self.down, = _linears(init, p + "w_down", (), (inter, hidden), int8)
        self.attn_norm = init.floats(p + "attn_norm")
        self.mlp_norm = init.floats(p + "mlp_norm")
        none = np.zeros(0, np.float32)      # add_norm's "no post-norm"
        self.post_attn = init.floats(p + "post_attn_norm") if c.post_norms else none
        self.post_mlp = init.floats(p + "post_mlp_norm") if c.post_norms else none
        self.window = c.window(i)
        self.cos, self.sin = tables


class NativeDecode:
    """A decode step of a graph built by :mod:`pagedkv_np.models.graph`.

    Parameters
    ----------
    proto : onnx.ModelProto
        The graph (its external data is read from ``base``).
    geometry : DecoderGeometry
        What its metadata says.
    base : str, optional
        The folder of the model file, for external data.
    threads : int, optional
        Numba threads for a step on a quiet machine (default: the caller's
        count); a step takes 1 instead while that has been faster lately
        (:class:`~pagedkv_np.threads.StepThreads`).
    int8 : bool
        Multiply block weights by activations rounded to int8 per block
        (:mod:`pagedkv_np.backends.block_q8`): faster, not exact.
    with_head : bool
        Compute logits (the graph's own head); False when the engine runs a
        head of its own (:class:`~pagedkv_np.onnxruntime.head.BlockHead`) on
        the final-normed states this then returns.
    """

    def __init__(self, proto: Any, geometry: DecoderGeometry, base: str | None = None,
                 threads: int | None = None, with_head: bool = True,
                 int8: bool = False) -> None:
        c = self.geometry = geometry
        self.int8 = int8
        init = GraphWeights(proto, base)
        gqa = [n for n in init.nodes if n.op_type == "GroupQueryAttention"]
        if len(gqa) != c.num_layers:
            raise UnsupportedModelError(f"the graph has {len(gqa)} GroupQueryAttention nodes "
                                        f"for {c.num_layers} layers")
        tables: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        for node in gqa:
            key = (node.input[7], node.input[8])
            if key not in tables:
                tables[key] = (init.floats(key[0]), init.floats(key[1]))
        self.layers = [_Layer(init, c, i, tables[(node.input[7], node.input[8])], int8)
                       for i, node in enumerate(gqa)]
        init.check_used()
        self.max_positions = min(t[0].shape[0] for t in tables.values())
        embed = init.required("embed")
        self.embed = embed
        self.final_norm = init.floats("final_norm")
        self.head: NativeLinear | None = None
        if with_head:
            head = init.weight("lm_head")
            if head is None:             # tied: the embedding's blocks, or its transpose
                head = embed if isinstance(embed, BlockWeight) else \
                    np.ascontiguousarray(embed.T)
            self.head = NativeLinear(head, int8)
        pool = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        #: the thread count of each step: ``threads`` (default Numba's) on a quiet
        #: machine, 1 when that has been faster lately (see StepThreads)
        self.step_threads = StepThreads(min(threads or numba.get_num_threads(), pool))
        self._buffers: dict[int, dict[str, np.ndarray]] = {}
        #: decode steps computed so far
        self.steps = 0
        self._threads, self._forced = self.step_threads.counts[0], 0   # _forced: warmup's
        self.activation = ops.ACT_SILU if c.activation == "silu" else ops.ACT_GELU_TANH

    @classmethod
    def from_source(cls, source: Any, proto: Any, geometry: DecoderGeometry,
                    threads: int | None = None, with_head: bool = True,
                    int8: bool = False) -> NativeDecode:
        """From what :func:`~pagedkv_np.onnxruntime.session.load_model` returned."""
        base = os.path.dirname(os.path.abspath(source)) if isinstance(source, str) else None
        return cls(proto, geometry, base, threads, with_head, int8)

    def share_embedding(self, weight: BlockWeight) -> bool:
        """Read embedding rows from ``weight`` (an engine-side head's blocks)
        instead of this step's own copy, when they hold the same values (a
        tied head): one copy of them in memory. Returns whether they did."""
        own = self.embed
        if not isinstance(own, BlockWeight) or (own.bits, own.block_size, own.in_features,
                                                 own.out_features) != (
                weight.bits, weight.block_size, weight.in_features, weight.out_features):
            return False
        pairs = [(own.codes, weight.codes), (own.zeros, weight.zeros),
                 (own.scales, weight.scales)]
        if own.offsets is not None and weight.offsets is not None:
            pairs.append((own.offsets, weight.offsets))
        elif (own.offsets is None) != (weight.offsets is None):
            return False
        if not all(np.array_equal(a, b) for a, b in pairs):
            return False
        self.embed = weight
        # its arrays may differ from the own copy's in type (writeable, not
        # read-only), so the embedding kernel compiles for them now, not in a step
        self._embed(np.zeros(1, np.int64), np.empty((1, self.geometry.hidden_size), np.float32))
        return True

    def float_linears(self) -> int:
        """How many of the layers' products have a float32 weight, not blocks."""
        return sum(not lin.blocks for layer in self.layers for lin
                   in (*layer.qkv, layer.wo, *layer.gate_up, layer.down))

    def threads_now(self) -> int:
        """The Numba thread count of the latest step (:attr:`step_threads`'s
        pick; before any step, the count it would try first)."""
        return self._threads

    @property
    def out_features(self) -> int:
        c = self.geometry
        return c.hidden_size if self.head is None else self.head.out_features

    def takes(self, rows: int) -> bool:
        """Whether this step computes a batch of ``rows`` (else the graph does):
        every batch with int8 activations (whose numbers must not depend on
        the batch), up to :data:`FLOAT_MAX_ROWS` with float32 ones."""
        return self.int8 or rows <= FLOAT_MAX_ROWS

    def warmup(self) -> None:
        """Compile the kernels now (seconds the first time, then from Numba's
        cache): a step with each thread count :attr:`step_threads` may pick
        (one thread runs serial versions of the products), and both forms of
        attention, so that no step of a request waits for a compile."""
        c = self.geometry
        # one row and two: with two, the parts of a packed product's output are
        # strided views (other kernel types than one row's contiguous ones:
        # compiling them in a server's first batch stalled its streams for 5 s)
        # and attention takes its parallel form even for one K/V head
        # (two rows that are past enough for attention's parallel path)
        past = min(self.max_positions, -(-_PARALLEL_ATTENTION // (2 * c.num_heads
                                                                  * c.head_dim)) + 1)
        for rows, length in ((1, 1), (2, past)):
            shape = (rows, c.num_kv_heads, length, c.head_dim)
            kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                  for _ in range(c.num_layers)]
            positions = np.full(rows, length - 1, np.int64)
            for n in self.step_threads.counts:       # each count a step picks
                self._forced = n
                try:
                    self(np.zeros(rows, np.int64), positions, kv)
                finally:
                    self._forced = 0
        self.step_threads.forget()
        self.steps = 0

    @contextlib.contextmanager
    def _numba_threads(self, size: int) -> Iterator[None]:
        """Numba threads for a step of ``size`` rows, as :attr:`step_threads`
        picks them, restored after; the step's time is recorded."""
        before = numba.get_num_threads()
        n = self._forced or self.step_threads.pick(size)
        numba.set_num_threads(n)
        chunksize = numba.set_parallel_chunksize(1)
        self._threads = n
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step_threads.record(size, n, time.perf_counter() - start)
            numba.set_parallel_chunksize(chunksize)
            numba.set_num_threads(before)

    def _buffers_for(self, b: int) -> dict[str, np.ndarray]:
        bufs = self._buffers.get(b)
        if bufs is None:
            c = self.geometry
            nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            widths = {"x": c.hidden_size, "h": c.hidden_size, "attn": nq, "o": c.hidden_size,
                      "act": c.intermediate_size, "down": c.hidden_size,
                      "q": nq, "k": nkv, "v": nkv, "gate": c.intermediate_size,
                      "up": c.intermediate_size, "qkv": nq + 2 * nkv,
                      "gate_up": 2 * c.intermediate_size}
            bufs = {name: np.empty((b, w), np.float32) for name, w in widths.items()}
            self._buffers = {b: bufs}      # one batch size at a time
        return bufs

    def _run(self, linears: list[NativeLinear], x: np.ndarray, bufs: dict,
             packed: str, names: list[str]) -> list[np.ndarray]:
        if len(linears) == 1:
            y = linears[0](x, bufs[packed], self._threads)
            out, lo = [], 0
            for name in names:
                width = bufs[name].shape[1]
                out.append(y[:, lo:lo + width])
                lo += width
            return out
        return [lin(x, bufs[name], self._threads) for lin, name in zip(linears, names)]

    def __call__(self, tokens: np.ndarray, positions: np.ndarray,
                 kv: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """One decode step: ``tokens[b]`` at ``positions[b]`` for each sequence
        ``b``, its K/V written into ``kv[layer]`` (``[B, kv_heads, capacity,
        head_dim]`` each) at that position; returns float32 ``[B, vocab]``
        logits, or ``[B, hidden]`` final-normed states without a head.

        Raises
        ------
        ConfigError
            A position past the buffers' capacity or the RoPE tables.
        """
        c = self.geometry
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        b = tokens.shape[0]
        capacity = kv[0][0].shape[2]
        if positions.shape != (b,) or len(kv) != c.num_layers:
            raise ConfigError(f"Invalid decode step: {b} tokens, positions "
                              f"{positions.shape}, K/V of {len(kv)} layers")
        if b and (positions.min() < 0 or positions.max() >= min(capacity, self.max_positions)
                  or tokens.min() < 0 or tokens.max() >= c.vocab_size):
            raise ConfigError(f"Invalid decode step: positions {positions.min()}.."
                              f"{positions.max()} for capacity {capacity} / "
                              f"{self.max_positions}, or a token outside the vocabulary")
        bufs = self._buffers_for(b)
        self.steps += 1
        with self._numba_threads(b):
            return self._step(tokens, positions, kv, bufs)

    def _embed(self, tokens: np.ndarray, x: np.ndarray) -> None:
        """``x[b]`` = the embedding row of ``tokens[b]``, scaled."""
        e, scale = self.embed, np.float32(self.geometry.embed_scale)
        if isinstance(e, BlockWeight):
            offsets = e.offsets if e.offsets is not None else np.zeros((e.out_features, 0),
                                                                        np.float32)
            ops.embed_blocks(e.codes, e.zeros, e.scales, offsets, e.bits, e.block_size,
                             tokens, scale, x)
        else:
            ops.embed_float(e, tokens, scale, x)

    def _step(self, tokens, positions, kv, bufs) -> np.ndarray:
        c = self.geometry
        x, h = bufs["x"], bufs["h"]
        self._embed(tokens, x)
        eps, hd, scale = np.float32(c.rms_eps), c.head_dim, np.float32(c.query_scale)
        # heads in parallel once the pasts are long enough to pay for a parallel region
        work = int(positions.sum()) * c.num_heads * hd
        attend = ops.attend if work >= _PARALLEL_ATTENTION else ops.attend_serial
        # each residual add runs with the norm after it (the next layer's, at
        # the end the final one): fewer calls, the same bits
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        ops.rms_norm(x, self.layers[0].attn_norm, eps, h)
        for layer, (kbuf, vbuf), next_norm in zip(self.layers, kv, norms):
            q, k, v = self._run(layer.qkv, h, bufs, "qkv", ["q", "k", "v"])
            if layer.bias is not None:
                qkv = np.concatenate([q, k, v], axis=1) + layer.bias
                q, k, v = np.split(qkv, [q.shape[1], q.shape[1] + k.shape[1]], axis=1)
            if layer.q_norm is not None:
                ops.head_norm(q, c.num_heads, hd, layer.q_norm, eps)
                ops.head_norm(k, c.num_kv_heads, hd, layer.k_norm, eps)
            ops.rope_write_kv(q, k, v, c.num_heads, c.num_kv_heads, hd, layer.cos, layer.sin,
                              positions, kbuf, vbuf)
            attend(q, c.num_heads, c.num_kv_heads, hd, kbuf, vbuf, positions,
                   layer.window, scale, bufs["attn"])
            o = layer.wo(bufs["attn"], bufs["o"], self._threads)
            ops.add_norm(x, o, layer.post_attn, layer.mlp_norm, eps, h)
            gate, up = self._run(layer.gate_up, h, bufs, "gate_up", ["gate", "up"])
            ops.gated(gate, up, self.activation, bufs["act"])
            d = layer.down(bufs["act"], bufs["down"], self._threads)
            ops.add_norm(x, d, layer.post_mlp, next_norm, eps, h)
        if self.head is None:
            return h.copy()
        logits = self.head(h, np.empty((h.shape[0], self.head.out_features), np.float32),
                           self._threads)
        if c.final_softcap:
            cap = np.float32(c.final_softcap)
            np.tanh(logits / cap, out=logits)
            logits *= cap
        return logits

