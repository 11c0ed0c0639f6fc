"""The decoder graph: geometry and weights in, an ONNX model out.

One pre-norm block for every architecture: RMSNorm, rotate-half rotary
embedding, grouped-query attention and a gated MLP, with the variations that
:class:`~pagedkv_np.models.geometry.DecoderGeometry` describes (Q/K/V bias,
per-head Q/K RMSNorm, norms after attention and MLP, SwiGLU or GeGLU, a scaled
embedding, sliding-window layers with RoPE tables of their own, a custom query
scale, final logit soft-capping) and an LM head that is its own matrix or the
embedding's transpose. Built with ``onnx.helper`` through
:class:`~pagedkv_np.models.builder.GraphBuilder`; no torch.

Every linear layer is either a float array (float32, or float16 stored as
such and cast once when the session loads) or a
:class:`~pagedkv_np.models.gguf.blocks.BlockQuantized` weight, kept in
its ggml blocks and run as ``com.microsoft.MatMulNBits`` with exactly the
values the blocks encode (a Q4_1 block's offset as a block-sum term). The
embedding may be blocks too (``GatherBlockQuantized``); a tied head then
reads the same blocks, at ``head_accuracy_level`` when it has one.

The I/O families are those of :mod:`pagedkv_np.onnxruntime.model_io`:
``"optimum"`` (MatMul attention, past ++ new K/V into present, optional
``position_ids``) and ``"gqa"`` (``com.microsoft.GroupQueryAttention`` with
cos/sin caches). Sliding windows: the ``"gqa"`` family sets the op's
``local_window_size`` on the sliding layers; the ``"optimum"`` family adds a
banded mask there, with each key's position taken from the running sum of
``attention_mask``, so that a past with masked holes (a batch's shorter rows)
keeps the right distances. :func:`~pagedkv_np.models.reference.reference_logits`
is the same network in NumPy, without a cache, that the graphs are checked
against.

Fewer, larger nodes: at batch 1 each node's fixed cost is a large part of a
token's time, so Q, K and V run as one linear node where their weights pack
(:func:`~pagedkv_np.models.builder.pack`: one dtype or one block kind), and
GroupQueryAttention takes them packed; gate and up likewise, split after; an
RMSNorm is onnxruntime's ``SimplifiedLayerNormalization`` and a residual add
with the norm after it one ``SkipSimplifiedLayerNormalization``. Packed
weights are named ``l{i}.wqkv``, ``l{i}.bqkv`` and ``l{i}.w_gate_up``.

Weight names and shapes: :mod:`pagedkv_np.models.geometry`. One concept in
~470 lines: the two families share every layer piece (:class:`_Layers`) and
differ only in how attention is wired, so splitting them would put the
shared pieces behind a private cross-module interface.
"""

from __future__ import annotations

import os
from typing import cast

import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.models.graph needs onnx: pip install 'pagedkv-np[onnx]'") from exc

from ..errors import ConfigError
from .builder import GraphBuilder, pack
from .head_file import HIDDEN_OUTPUT, METADATA_KEY
from .geometry import (GEOMETRY_KEY, DecoderGeometry, Linear, check_weights, geometry_json,
                       rope_tables, weight_names)
from .gguf.blocks import BlockQuantized
from .onnx_data import ExternalData, save_decoder
from .reference import reference_logits

__all__ = ["DecoderGeometry", "BlockQuantized", "Linear", "FAMILIES", "weight_names",
           "build_decoder", "build_linear", "reference_logits", "rope_tables", "save_decoder"]

FAMILIES = ("optimum", "gqa")
_OPSET = 17
_MASK_VALUE = -1e9  # finite, so fully padded rows stay finite (no NaN spreads)


def _shape_at(g: GraphBuilder, x: str, axis: int) -> str:
    """int64 [1]: ``x.shape[axis]``."""
    return g.op("Gather", [g.op("Shape", [x]), g.const(np.array([axis], np.int64))], axis=0)


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str) -> str:
    """Rotate-half RoPE of x [B, H, S, D] with cos/sin [B, 1, S, D/2]."""
    x1, x2 = g.op("Split", [x], num_outputs=2, axis=-1)
    first = g.op("Sub", [g.op("Mul", [x1, cos]), g.op("Mul", [x2, sin])])
    second = g.op("Add", [g.op("Mul", [x2, cos]), g.op("Mul", [x1, sin])])
    return g.op("Concat", [first, second], axis=-1)


class _Layers:
    """The per-layer pieces shared by both families."""

    def __init__(self, g: GraphBuilder, c: DecoderGeometry, w: dict[str, Linear],
                 head_accuracy_level: int | None = None) -> None:
        self.g, self.c, self.w = g, c, w
        self.head_accuracy_level = head_accuracy_level
        self.names: dict[str, str] = {}

    def array(self, name: str) -> np.ndarray:
        """A weight that check_weights has confirmed to be a float array."""
        return cast(np.ndarray, self.w[name])

    def vec(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = self.g.float_init(self.array(name), name)
        return self.names[name]

    def rope(self, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables of the global (or the sliding) layers."""
        factors = self.array("rope_freqs") if "rope_freqs" in self.w else None
        return rope_tables(self.c, factors, local=local)

    def norm(self, x: str, name: str) -> str:
        """RMSNorm over the last axis: onnxruntime's one-node form."""
        return self.g.op("SimplifiedLayerNormalization", [x, self.vec(name)], axis=-1,
                         epsilon=float(self.c.rms_eps))

    def add_norm(self, x: str, out: str | None, name: str) -> tuple[str, str]:
        """The residual ``x + out`` (``x`` when ``out`` is None) and its RMSNorm,
        in one node: (normed, residual)."""
        if out is None:
            return self.norm(x, name), x
        g = self.g
        h, _, _, total = g.op("SkipSimplifiedLayerNormalization", [out, x, self.vec(name)],
                              outputs=[g.name("normed"), "", "", g.name("residual")],
                              domain="com.microsoft", epsilon=float(self.c.rms_eps))
        return h, total

    def qkv(self, h: str, i: int, packed: bool = False) -> list[str]:
        """Q, K, V [B, S, heads * head_dim], Q and K normed per head with qk_norm;
        with ``packed``, where they can be, one tensor of the three side by side
        (GroupQueryAttention's packed input)."""
        g, c = self.g, self.c
        ws = [self.w[f"l{i}.w{which}"] for which in "qkv"]
        if packed and not c.qk_norm and pack(ws) is not None:
            y = g.linear(h, cast(Linear, pack(ws)), f"l{i}.wqkv")
            if c.qkv_bias:
                y = g.op("Add", [y, g.float_init(np.concatenate(
                    [self.array(f"l{i}.b{which}") for which in "qkv"]), f"l{i}.bqkv")])
            return [y]
        out = []
        for which, n, y in zip("qkv", (c.num_heads, c.num_kv_heads, c.num_kv_heads),
                               g.linears(h, dict(zip((f"l{i}.w{part}" for part in "qkv"), ws)),
                                         f"l{i}.wqkv")):
            if c.qkv_bias:
                y = g.op("Add", [y, self.vec(f"l{i}.b{which}")])
            if c.qk_norm and which != "v":
                y = g.op("Reshape", [y, g.const(np.array([0, 0, n, c.head_dim], np.int64))])
                y = self.norm(y, f"l{i}.{which}_norm")
                y = g.op("Reshape", [y, g.const(np.array([0, 0, n * c.head_dim], np.int64))])
            out.append(y)
        return out

    def act(self, gate: str) -> str:
        g = self.g
        if self.c.activation == "silu":
            return g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        # tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), standard ops only
        cube = g.op("Mul", [g.op("Mul", [gate, gate]), gate])
        inner = g.op("Add", [gate, g.op("Mul", [cube, g.const(np.float32(0.044715))])])
        t = g.op("Tanh", [g.op("Mul", [inner, g.const(np.float32(np.sqrt(2.0 / np.pi)))])])
        half = g.op("Mul", [gate, g.const(np.float32(0.5))])
        return g.op("Mul", [half, g.op("Add", [t, g.const(np.float32(1.0))])])

    def finish(self, x: str, attn: str, i: int) -> tuple[str, str]:
        """After attention: its projection added to the residual, then the MLP
        block (post-norms before each add); returns the residual and the MLP's
        output, not yet added (the next norm adds it)."""
        g, w = self.g, self.w
        out = g.linear(attn, w[f"l{i}.wo"], f"l{i}.wo")
        if self.c.post_norms:
            out = self.norm(out, f"l{i}.post_attn_norm")
        h, x = self.add_norm(x, out, f"l{i}.mlp_norm")
        gate, up = g.linears(h, {f"l{i}.w_{part}": w[f"l{i}.w_{part}"] for part in ("gate", "up")},
                             f"l{i}.w_gate_up")
        out = g.linear(g.op("Mul", [self.act(gate), up]), w[f"l{i}.w_down"], f"l{i}.w_down")
        if self.c.post_norms:
            out = self.norm(out, f"l{i}.post_mlp_norm")
        return x, out


def _optimum_layers(layers: _Layers, x: str, position_ids: str | None) -> str:
    g, c = layers.g, layers.c
    d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
    one = g.const(np.array([1], np.int64))
    past_len = _shape_at(g, "past_key_values.0.key", 2)
    seq_len = _shape_at(g, "input_ids", 1)
    total_len = _shape_at(g, "attention_mask", 1)
    if position_ids is None:
        # positions from the mask: the k-th unmasked column is position k
        running = g.op("CumSum", ["attention_mask", g.const(np.array(1, np.int64))])
        running = g.op("Sub", [running, g.const(np.array(1, np.int64))])
        running = g.op("Slice", [running, past_len, total_len, one])
        position_ids = g.op("Max", [running, g.const(np.array(0, np.int64))])

    def rotary(local: bool) -> tuple[str, str]:
        cos_tab, sin_tab = layers.rope(local)
        return (g.op("Unsqueeze", [g.op("Gather", [g.const(cos_tab, "cos"), position_ids]), one]),
                g.op("Unsqueeze", [g.op("Gather", [g.const(sin_tab, "sin"), position_ids]), one]))

    tables = {False: rotary(False)}
    tables[True] = rotary(True) if c.local_rope else tables[False]
    # additive mask [B, 1, S, T]: key j is visible to query i iff j <= past + i and
    # attention_mask[b, j] == 1
    zero_i, one_i = g.const(np.array(0, np.int64)), g.const(np.array(1, np.int64))
    cols = g.op("Range", [zero_i, g.op("Squeeze", [total_len]), one_i])
    rows = g.op("Range", [g.op("Squeeze", [past_len]),
                          g.op("Squeeze", [g.op("Add", [past_len, seq_len])]), one_i])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [cols, g.const(np.array([0], np.int64))]),
                                  g.op("Unsqueeze", [rows, one])])                # [S, T]
    keep = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)
    keep = g.op("Unsqueeze", [keep, g.const(np.array([1, 2], np.int64))])       # [B,1,1,T]
    allowed = g.op("And", [g.op("Unsqueeze", [causal, g.const(np.array([0, 1], np.int64))]),
                           keep])
    biases = {0: _bias(g, c, allowed)}
    windows = sorted({c.window(i) for i in range(c.num_layers)} - {0})
    if windows:
        # a key's position is its column's running count of unmasked columns, so that
        # masked holes in the past (a batch's shorter rows) do not count as distance
        key_pos = g.op("Sub", [g.op("CumSum", ["attention_mask", g.const(np.array(1, np.int64))]),
                               g.const(np.array(1, np.int64))])
        query_pos = g.op("Unsqueeze", [position_ids, g.const(np.array([1, 3], np.int64))])
        behind = g.op("Sub", [query_pos, g.op("Unsqueeze", [key_pos,
                                                           g.const(np.array([1, 2], np.int64))])])
        for window in windows:                                                # [B,1,S,T]
            near = g.op("Less", [behind, g.const(np.array(window, np.int64))])
            biases[window] = _bias(g, c, g.op("And", [allowed, near]))
    scale = g.const(np.float32(c.query_scale))

    def heads(t: str, n: int) -> str:
        t = g.op("Reshape", [t, g.const(np.array([0, 0, n, d], np.int64))])
        return g.op("Transpose", [t], perm=[0, 2, 1, 3])

    out: str | None = None       # the last block's output, added by the next norm
    for i in range(c.num_layers):
        h, x = layers.add_norm(x, out, f"l{i}.attn_norm")
        q, k, v = layers.qkv(h, i)
        cos, sin = tables[c.window(i) > 0]
        bias = biases[c.window(i)]
        q, k = _rotate(g, heads(q, nh), cos, sin), _rotate(g, heads(k, nkv), cos, sin)
        k_all = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2,
                     outputs=[f"present.{i}.key"])
        v_all = g.op("Concat", [f"past_key_values.{i}.value", heads(v, nkv)], axis=2,
                     outputs=[f"present.{i}.value"])
        qg = g.op("Reshape", [q, g.const(np.array([0, nkv, -1, d], np.int64))])
        scores = g.op("MatMul", [qg, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
        scores = g.op("Add", [g.op("Mul", [scores, scale]), bias])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v_all])
        attn = g.op("Reshape", [attn, g.const(np.array([0, nh, -1, d], np.int64))])
        attn = g.op("Transpose", [attn], perm=[0, 2, 1, 3])
        attn = g.op("Reshape", [attn, g.const(np.array([0, 0, nh * d], np.int64))])
        x, out = layers.finish(x, attn, i)
    return x if out is None else g.op("Add", [x, out])


def _bias(g: GraphBuilder, c: DecoderGeometry, allowed: str) -> str:
    """The additive attention mask [B, 1 or groups * S, S, T] of a bool one."""
    bias = g.op("Where", [allowed, g.const(np.float32(0.0)), g.const(np.float32(_MASK_VALUE))])
    if c.num_groups > 1:
        # queries are grouped as [B, kv_heads, groups * S, D]: repeat mask rows per group
        bias = g.op("Tile", [bias, g.const(np.array([1, 1, c.num_groups, 1], np.int64))])
    return bias


def _gqa_layers(layers: _Layers, x: str) -> str:
    g, c = layers.g, layers.c
    # seqlens_k = valid tokens - 1 (right padding), total = mask width, as the
    # genai builder wires them
    total = g.op("ReduceSum", ["attention_mask", g.const(np.array([1], np.int64))], keepdims=0)
    seqlens_k = g.op("Cast", [g.op("Sub", [total, g.const(np.array(1, np.int64))])],
                     to=TensorProto.INT32)
    total_len = g.op("Cast", [g.op("Squeeze", [_shape_at(g, "attention_mask", 1)])],
                     to=TensorProto.INT32)
    caches = {False: tuple(g.const(t, "cos_sin_cache") for t in layers.rope(False))}
    caches[True] = (tuple(g.const(t, "cos_sin_cache_local") for t in layers.rope(True))
                    if c.local_rope else caches[False])
    out: str | None = None       # the last block's output, added by the next norm
    for i in range(c.num_layers):
        h, x = layers.add_norm(x, out, f"l{i}.attn_norm")
        qkv = layers.qkv(h, i, packed=True)
        q, k, v = qkv if len(qkv) == 3 else (qkv[0], "", "")     # "": packed in the query
        cos, sin = caches[c.window(i) > 0]
        # local_window_size counts the keys a query sees, itself included (checked
        # against the NumPy reference in prompt and decode steps); -1: all
        attn = g.op(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             seqlens_k, total_len, cos, sin],
            outputs=[g.name("gqa_out"), f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft", num_heads=c.num_heads, kv_num_heads=c.num_kv_heads,
            do_rotary=1, rotary_interleaved=0, scale=float(c.query_scale),
            local_window_size=c.window(i) or -1)[0]
        x, out = layers.finish(x, attn, i)
    return x if out is None else g.op("Add", [x, out])


def _lm_head(layers: _Layers, x: str, with_head: bool) -> None:
    g, c, w = layers.g, layers.c, layers.w
    # the head's last rows, 0: all. A plain input, not an initializer with a default
    # (onnxruntime warned of that at every load), named as onnxruntime-genai feeds it
    x = g.op("Slice", [x, g.op("Neg", ["num_logits_to_keep"]),
                       g.const(np.array([2 ** 62], np.int64)), g.const(np.array([1], np.int64))])
    h = layers.norm(x, "final_norm")
    if not with_head:          # the engine multiplies by the head (models.head_file)
        g.op("Identity", [h], outputs=[HIDDEN_OUTPUT])
        return
    out = g.name("raw_logits") if c.final_softcap else "logits"
    if not c.tie_word_embeddings:
        g.linear(h, w["lm_head"], "lm_head", out=out, accuracy_level=layers.head_accuracy_level)
    else:
        _tied_head(layers, h, out)
    if c.final_softcap:
        cap = np.float32(c.final_softcap)
        capped = g.op("Tanh", [g.op("Mul", [out, g.const(np.float32(1.0) / cap)])])
        g.op("Mul", [capped, g.const(cap)], outputs=["logits"])


def _tied_head(layers: _Layers, h: str, out: str) -> None:
    g, c, embed = layers.g, layers.c, layers.w["embed"]
    if isinstance(embed, BlockQuantized):     # the embedding's codes, as MatMulNBits reads them
        g.linear(h, embed, "embed", out=out, accuracy_level=layers.head_accuracy_level)
        return
    # the embedding's transpose without a second copy: Gemm reads it transposed
    flat = g.op("Reshape", [h, g.const(np.array([-1, c.hidden_size], np.int64))])
    logits = g.op("Gemm", [flat, layers.vec("embed")], transB=1)
    shape = g.op("Concat", [_shape_at(g, h, 0), _shape_at(g, h, 1),
                            g.const(np.array([c.vocab_size], np.int64))], axis=0)
    g.op("Reshape", [logits, shape], outputs=[out])


def build_decoder(geometry: DecoderGeometry, weights: dict[str, Linear], *,
                  family: str = "gqa", position_ids: bool = True, accuracy_level: int = 0,
                  head_accuracy_level: int | None = None, name: str = "pagedkv_decoder",
                  external_data: str | os.PathLike | None = None,
                  head_file: str | None = None) -> onnx.ModelProto:
    """Build the decoder as an ONNX model.

    Parameters
    ----------
    geometry : DecoderGeometry
    weights : dict of str to ndarray or BlockQuantized
        Names and shapes as in the module docstring; the norms are float
        arrays; a BlockQuantized ``embed`` has one row of blocks per token
        (its ``shape`` is ``(hidden, vocab)``, as a head's), gathered by
        GatherBlockQuantized and, when tied, read by the head's MatMulNBits
        (:mod:`pagedkv_np.models.builder`).
    family : {"optimum", "gqa"}
    position_ids : bool
        Whether an ``"optimum"`` model takes ``position_ids`` (otherwise
        positions come from the running sum of ``attention_mask``); ``"gqa"``
        models never do.
    accuracy_level : {0, 1, 2, 3, 4}
        MatMulNBits' ``accuracy_level``: 0 computes with the blocks' exact
        values in float32; 4 quantizes activations to int8 (faster, inexact).
    head_accuracy_level : {0, 1, 2, 3, 4}, optional
        The LM head's own, when it is BlockQuantized (default: ``accuracy_level``).
    name : str
        Of the ONNX graph.
    external_data : str or path, optional
        A file to write the weights into while the graph is built (see
        :mod:`pagedkv_np.models.onnx_data`): the model then holds only
        references to it, and must be saved in the same folder
        (:func:`save_decoder`). Without it the weights are inside the model.
    head_file : str, optional
        Leave the LM head (and the final soft-cap) out: the graph outputs
        ``hidden`` (float32 [B, S, hidden], the final-normed states of the
        kept positions) instead of ``logits``, and its metadata names this
        file of the model's folder, which the caller writes
        (:mod:`pagedkv_np.models.head_file`). The head's weights are then
        not read here, except a tied embedding's, which the graph gathers.

    Returns
    -------
    onnx.ModelProto
        Inputs ``input_ids`` int64 [B, S], ``attention_mask`` int64 [B, P + S],
        (``position_ids`` int64 [B, S]), past K/V float32 [B, num_kv_heads, P, head_dim],
        ``num_logits_to_keep`` int64 [1] (0: every position); outputs ``logits``
        float32 [B, S, vocab] (the last ``num_logits_to_keep`` positions unless 0) and
        present K/V float32 [B, num_kv_heads, P + S, head_dim].

    Raises
    ------
    ConfigError, ShapeError, DTypeError
        An unknown family, a missing weight or one of the wrong shape or type.
        (onnxruntime's CPU GroupQueryAttention also needs ``head_dim`` to be a
        multiple of 16; it says so when the model runs.)
    """
    if family not in FAMILIES:
        raise ConfigError(f"Invalid family: expected one of {FAMILIES}, got {family!r}")
    for what, level in (("accuracy_level", accuracy_level),
                        ("head_accuracy_level", head_accuracy_level)):
        if level is not None and level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"Invalid {what}: expected 0..4, got {level!r}")
    c = geometry
    check_weights(c, weights)
    data = None if external_data is None else ExternalData(external_data)
    try:
        return _decoder_model(c, weights, family, position_ids, name,
                              GraphBuilder(accuracy_level, data), head_accuracy_level, head_file)
    finally:
        if data is not None:
            data.close()


def _decoder_model(c: DecoderGeometry, weights: dict[str, Linear], family: str,
                   position_ids: bool, name: str, g: GraphBuilder,
                   head_accuracy_level: int | None, head_file: str | None) -> onnx.ModelProto:
    layers = _Layers(g, c, weights, head_accuracy_level)
    embed = weights["embed"]
    x = (g.rows(embed, "input_ids", "embed") if isinstance(embed, BlockQuantized)
         else g.op("Gather", [layers.vec("embed"), "input_ids"], axis=0))
    if c.embed_scale != 1.0:
        x = g.op("Mul", [x, g.const(np.float32(c.embed_scale))])
    use_positions = family == "optimum" and position_ids
    if family == "optimum":
        x = _optimum_layers(layers, x, "position_ids" if use_positions else None)
    else:
        x = _gqa_layers(layers, x)
    _lm_head(layers, x, head_file is None)

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv_shape: list[str | int] = ["batch_size", c.num_kv_heads, "past_sequence_length",
                                 c.head_dim]
    present_shape: list[str | int] = ["batch_size", c.num_kv_heads, "total_sequence_length",
                                      c.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", i64,
                                            ["batch_size", "total_sequence_length"])]
    if use_positions:
        inputs.append(helper.make_tensor_value_info("position_ids", i64,
                                                    ["batch_size", "sequence_length"]))
    if family == "optimum":   # interleaved per layer, as torch exports list them
        order = [(i, kind) for i in range(c.num_layers) for kind in ("key", "value")]
    else:                     # all keys, then all values, as the genai builder does
        order = [(i, kind) for kind in ("key", "value") for i in range(c.num_layers)]
    inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, kv_shape)
               for i, kind in order]
    inputs.append(helper.make_tensor_value_info("num_logits_to_keep", i64, [1]))
    outputs = [helper.make_tensor_value_info("logits", f32,
                                             ["batch_size", "logits_length", c.vocab_size])
               if head_file is None else
               helper.make_tensor_value_info(HIDDEN_OUTPUT, f32,
                                             ["batch_size", "logits_length", c.hidden_size])]
    outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present_shape)
                for i, kind in order]
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", _OPSET)]
    if any(n.domain == "com.microsoft" for n in g.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="pagedkv_np")
    model.ir_version = 8
    helper.set_model_props(model, {GEOMETRY_KEY: geometry_json(c),   # for the engine's decode
                                   **({} if head_file is None else {METADATA_KEY: head_file})})
    return model


def build_linear(weight: Linear, *, accuracy_level: int = 0) -> onnx.ModelProto:
    """One linear layer as a model: input ``x`` float32 [B, S, in], output ``y``
    float32 [B, S, out] = ``x @ weight`` (as :func:`build_decoder` computes it)."""
    g = GraphBuilder(accuracy_level)
    k, n = weight.shape
    g.linear("x", weight, "w", out="y")
    graph = helper.make_graph(
        g.nodes, "pagedkv_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", n])],
        g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model
