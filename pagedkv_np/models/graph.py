"""The Llama-family decoder graph: geometry and weights in, an ONNX model out.

RMSNorm, rotate-half rotary embedding, grouped-query attention (optional
Q/K/V bias, as Qwen2 has), a SwiGLU MLP and an LM head that is its own
matrix or the embedding's transpose. Built with ``onnx.helper``; no torch.
(Both I/O families and the NumPy reference of the same network stay in this
one module, a little over 450 lines, so that the two cannot drift apart.)

Every linear layer is either a float array (float32, or float16 stored as
such and cast once when the session loads) or a
:class:`~pagedkv_np.models.gguf.blocks.BlockQuantized` weight, kept in
its ggml blocks and run as ``com.microsoft.MatMulNBits`` with exactly the
values the blocks encode (a Q4_1 block's offset as a block-sum term).

The I/O families are those of :mod:`pagedkv_np.onnxruntime.model_io`:
``"optimum"`` (MatMul attention, past ++ new K/V into present, optional
``position_ids``) and ``"gqa"`` (``com.microsoft.GroupQueryAttention`` with
cos/sin caches). :func:`reference_logits` is the same network in NumPy,
without a cache, that the graphs are checked against.

Weight names and shapes: :mod:`pagedkv_np.models.geometry`.
"""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.models.graph needs onnx: pip install 'pagedkv-np[onnx]'") from exc

from ..errors import ConfigError
from .geometry import DecoderGeometry, Linear, check_weights, weight_names
from .gguf.blocks import BlockQuantized
from .onnx_data import ExternalData, save_decoder

__all__ = ["DecoderGeometry", "BlockQuantized", "Linear", "FAMILIES",
           "weight_names", "build_decoder", "build_linear", "reference_logits", "rope_tables",
           "save_decoder"]

FAMILIES = ("optimum", "gqa")
_OPSET = 17
_MASK_VALUE = -1e9  # finite, so fully padded rows stay finite (no NaN spreads)


def rope_tables(c: DecoderGeometry, freq_factors: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32 [max_positions, head_dim // 2] of rotate-half RoPE."""
    half = c.head_dim // 2
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(half, dtype=np.float64) / half))
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# --------------------------------------------------------------------- NumPy


def _dense(w: Linear) -> np.ndarray:
    return w.dequantize() if isinstance(w, BlockQuantized) else np.asarray(w, np.float32)


def reference_logits(geometry: DecoderGeometry, weights: dict[str, Linear],
                     token_ids: Any) -> np.ndarray:
    """Logits of every position of one sequence, in float32 NumPy without a cache.

    Parameters
    ----------
    geometry : DecoderGeometry
    weights : dict of str to ndarray or BlockQuantized
        Names as in the module docstring; blocks are dequantized.
    token_ids : sequence of int, length S >= 1

    Returns
    -------
    ndarray, shape [S, vocab_size], dtype float32
    """
    c = geometry
    w = {name: _dense(value) for name, value in weights.items()}
    ids = np.asarray(token_ids, dtype=np.int64)
    s, d, g = ids.shape[0], c.head_dim, c.num_groups
    cos, sin = rope_tables(c, w.get("rope_freqs"))
    cos, sin = cos[:s][None], sin[:s][None]          # [1, S, D/2]

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_eps) * weight

    def rope(x):                                    # [H, S, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def proj(h, i, which, n):
        y = h @ w[f"l{i}.w{which}"]
        if c.qkv_bias:
            y = y + w[f"l{i}.b{which}"]
        return y.reshape(s, n, d).transpose(1, 0, 2)

    causal = np.tril(np.ones((s, s), dtype=bool))
    x = w["embed"][ids]
    for i in range(c.num_layers):
        h = rms(x, w[f"l{i}.attn_norm"])
        q = rope(proj(h, i, "q", c.num_heads))
        k = np.repeat(rope(proj(h, i, "k", c.num_kv_heads)), g, axis=0)
        v = np.repeat(proj(h, i, "v", c.num_kv_heads), g, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(d))
        scores = np.where(causal[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(s, -1) @ w[f"l{i}.wo"]
        h = rms(x, w[f"l{i}.mlp_norm"])
        gate = h @ w[f"l{i}.w_gate"]
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[f"l{i}.w_up"])) @ w[f"l{i}.w_down"]
    head = w["embed"].T if c.tie_word_embeddings else w["lm_head"]
    return (rms(x, w["final_norm"]) @ head).astype(np.float32)


# ---------------------------------------------------------------------- ONNX


class _Graph:
    """Collects nodes and initializers with unique names."""

    def __init__(self, accuracy_level: int, data: ExternalData | None = None) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self.accuracy_level = accuracy_level
        self.data = data
        self.blocksums: dict[tuple[str, int], str] = {}
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

    def linear(self, x: str, w: Linear, name: str, out: str | None = None) -> str:
        """``x @ w`` for x float32 [..., in], into ``out`` when given."""
        outputs = None if out is None else [out]
        if not isinstance(w, BlockQuantized):
            return self.op("MatMul", [x, self.float_init(w, name)], outputs=outputs)
        k, n = w.shape
        parts = w.matmul_nbits()
        inputs = [self.init(parts.B, name + ".qweight"),
                  self.init(parts.scales, name + ".scales")]
        if parts.zero_points is not None:
            inputs.append(self.init(parts.zero_points, name + ".qzeros"))
        y = self.op("MatMulNBits", [x] + inputs, domain="com.microsoft", K=k, N=n,
                    bits=parts.bits, block_size=parts.block_size,
                    accuracy_level=self.accuracy_level,
                    outputs=outputs if parts.offsets is None else None)
        if parts.offsets is None:
            return y
        key = (x, parts.block_size)
        if key not in self.blocksums:    # q/k/v and gate/up read the same x: sum once
            blocks = self.op("Reshape", [x, self.const(np.array([0, 0, -1, parts.block_size],
                                                                np.int64))])
            self.blocksums[key] = self.op("ReduceSum",
                                          [blocks, self.const(np.array([-1], np.int64))],
                                          keepdims=0)
        mins = self.op("MatMul", [self.blocksums[key], self.init(parts.offsets, name + ".mins")])
        return self.op("Add", [y, mins], outputs=outputs)


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    ms = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(np.float32(eps))])])])
    return g.op("Mul", [g.op("Mul", [x, inv]), weight])


def _shape_at(g: _Graph, x: str, axis: int) -> str:
    """int64 [1]: ``x.shape[axis]``."""
    return g.op("Gather", [g.op("Shape", [x]), g.const(np.array([axis], np.int64))], axis=0)


def _rotate(g: _Graph, x: str, cos: str, sin: str) -> str:
    """Rotate-half RoPE of x [B, H, S, D] with cos/sin [B, 1, S, D/2]."""
    x1, x2 = g.op("Split", [x], num_outputs=2, axis=-1)
    first = g.op("Sub", [g.op("Mul", [x1, cos]), g.op("Mul", [x2, sin])])
    second = g.op("Add", [g.op("Mul", [x2, cos]), g.op("Mul", [x1, sin])])
    return g.op("Concat", [first, second], axis=-1)


class _Layers:
    """The per-layer pieces shared by both families."""

    def __init__(self, g: _Graph, c: DecoderGeometry, w: dict[str, Linear]) -> None:
        self.g, self.c, self.w = g, c, w
        self.names: dict[str, str] = {}

    def array(self, name: str) -> np.ndarray:
        """A weight that check_weights has confirmed to be a float array."""
        return cast(np.ndarray, self.w[name])

    def vec(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = self.g.float_init(self.array(name), name)
        return self.names[name]

    def rope(self) -> tuple[np.ndarray, np.ndarray]:
        factors = self.array("rope_freqs") if "rope_freqs" in self.w else None
        return rope_tables(self.c, factors)

    def norm(self, x: str, name: str) -> str:
        return _rms_norm(self.g, x, self.vec(name), self.c.rms_eps)

    def qkv(self, h: str, i: int) -> list[str]:
        out = []
        for which in "qkv":
            y = self.g.linear(h, self.w[f"l{i}.w{which}"], f"l{i}.w{which}")
            if self.c.qkv_bias:
                y = self.g.op("Add", [y, self.vec(f"l{i}.b{which}")])
            out.append(y)
        return out

    def finish(self, x: str, attn: str, i: int) -> str:
        """Residual after attention, then the MLP block."""
        g, w = self.g, self.w
        x = g.op("Add", [x, g.linear(attn, w[f"l{i}.wo"], f"l{i}.wo")])
        h = self.norm(x, f"l{i}.mlp_norm")
        gate = g.linear(h, w[f"l{i}.w_gate"], f"l{i}.w_gate")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        up = g.linear(h, w[f"l{i}.w_up"], f"l{i}.w_up")
        return g.op("Add", [x, g.linear(g.op("Mul", [act, up]), w[f"l{i}.w_down"],
                                        f"l{i}.w_down")])


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
    cos_tab, sin_tab = layers.rope()
    cos = g.op("Unsqueeze", [g.op("Gather", [g.const(cos_tab, "cos"), position_ids]), one])
    sin = g.op("Unsqueeze", [g.op("Gather", [g.const(sin_tab, "sin"), position_ids]), one])
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
    bias = g.op("Where", [allowed, g.const(np.float32(0.0)), g.const(np.float32(_MASK_VALUE))])
    if c.num_groups > 1:
        # queries are grouped as [B, kv_heads, groups * S, D]: repeat mask rows per group
        bias = g.op("Tile", [bias, g.const(np.array([1, 1, c.num_groups, 1], np.int64))])
    scale = g.const(np.float32(1.0 / np.sqrt(d)))

    def heads(t: str, n: int) -> str:
        t = g.op("Reshape", [t, g.const(np.array([0, 0, n, d], np.int64))])
        return g.op("Transpose", [t], perm=[0, 2, 1, 3])

    for i in range(c.num_layers):
        q, k, v = layers.qkv(layers.norm(x, f"l{i}.attn_norm"), i)
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
        x = layers.finish(x, attn, i)
    return x


def _gqa_layers(layers: _Layers, x: str) -> str:
    g, c = layers.g, layers.c
    # seqlens_k = valid tokens - 1 (right padding), total = mask width, as the
    # genai builder wires them
    total = g.op("ReduceSum", ["attention_mask", g.const(np.array([1], np.int64))], keepdims=0)
    seqlens_k = g.op("Cast", [g.op("Sub", [total, g.const(np.array(1, np.int64))])],
                     to=TensorProto.INT32)
    total_len = g.op("Cast", [g.op("Squeeze", [_shape_at(g, "attention_mask", 1)])],
                     to=TensorProto.INT32)
    cos_tab, sin_tab = layers.rope()
    cos, sin = g.const(cos_tab, "cos_cache"), g.const(sin_tab, "sin_cache")
    for i in range(c.num_layers):
        q, k, v = layers.qkv(layers.norm(x, f"l{i}.attn_norm"), i)
        attn = g.op(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             seqlens_k, total_len, cos, sin],
            outputs=[g.name("gqa_out"), f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft", num_heads=c.num_heads, kv_num_heads=c.num_kv_heads,
            do_rotary=1, rotary_interleaved=0, local_window_size=-1)[0]
        x = layers.finish(x, attn, i)
    return x


def _lm_head(layers: _Layers, x: str) -> None:
    g, c, w = layers.g, layers.c, layers.w
    h = layers.norm(x, "final_norm")
    if not c.tie_word_embeddings:
        g.linear(h, w["lm_head"], "lm_head", out="logits")
        return
    # the embedding's transpose without a second copy: Gemm reads it transposed
    flat = g.op("Reshape", [h, g.const(np.array([-1, c.hidden_size], np.int64))])
    logits = g.op("Gemm", [flat, layers.vec("embed")], transB=1)
    shape = g.op("Concat", [_shape_at(g, "input_ids", 0), _shape_at(g, "input_ids", 1),
                            g.const(np.array([c.vocab_size], np.int64))], axis=0)
    g.op("Reshape", [logits, shape], outputs=["logits"])


def build_decoder(geometry: DecoderGeometry, weights: dict[str, Linear], *,
                  family: str = "gqa", position_ids: bool = True, accuracy_level: int = 0,
                  name: str = "pagedkv_decoder",
                  external_data: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Build the decoder as an ONNX model.

    Parameters
    ----------
    geometry : DecoderGeometry
    weights : dict of str to ndarray or BlockQuantized
        Names and shapes as in the module docstring; ``embed`` and the norms
        are float arrays.
    family : {"optimum", "gqa"}
    position_ids : bool
        Whether an ``"optimum"`` model takes ``position_ids`` (otherwise
        positions come from the running sum of ``attention_mask``); ``"gqa"``
        models never do.
    accuracy_level : {0, 1, 2, 3, 4}
        MatMulNBits' ``accuracy_level``: 0 computes with the blocks' exact
        values in float32; 4 quantizes activations to int8 (faster, inexact).
    name : str
        Of the ONNX graph.
    external_data : str or path, optional
        A file to write the weights into while the graph is built (see
        :mod:`pagedkv_np.models.onnx_data`): the model then holds only
        references to it, and must be saved in the same folder
        (:func:`save_decoder`). Without it the weights are inside the model.

    Returns
    -------
    onnx.ModelProto
        Inputs ``input_ids`` int64 [B, S], ``attention_mask`` int64 [B, P + S],
        (``position_ids`` int64 [B, S]), past K/V float32
        [B, num_kv_heads, P, head_dim]; outputs ``logits`` float32 [B, S, vocab]
        and present K/V float32 [B, num_kv_heads, P + S, head_dim].

    Raises
    ------
    ConfigError, ShapeError, DTypeError
        An unknown family, a missing weight or one of the wrong shape or type.
        (onnxruntime's CPU GroupQueryAttention also needs ``head_dim`` to be a
        multiple of 16; it says so when the model runs.)
    """
    if family not in FAMILIES:
        raise ConfigError(f"Invalid family: expected one of {FAMILIES}, got {family!r}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ConfigError(f"Invalid accuracy_level: expected 0..4, got {accuracy_level!r}")
    c = geometry
    check_weights(c, weights)
    data = None if external_data is None else ExternalData(external_data)
    try:
        return _decoder_model(c, weights, family, position_ids, name,
                              _Graph(accuracy_level, data))
    finally:
        if data is not None:
            data.close()


def _decoder_model(c: DecoderGeometry, weights: dict[str, Linear], family: str,
                   position_ids: bool, name: str, g: _Graph) -> onnx.ModelProto:
    layers = _Layers(g, c, weights)
    embed = layers.vec("embed")
    x = g.op("Gather", [embed, "input_ids"], axis=0)
    use_positions = family == "optimum" and position_ids
    if family == "optimum":
        x = _optimum_layers(layers, x, "position_ids" if use_positions else None)
    else:
        x = _gqa_layers(layers, x)
    _lm_head(layers, x)

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
    outputs = [helper.make_tensor_value_info("logits", f32,
                                             ["batch_size", "sequence_length", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present_shape)
                for i, kind in order]
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", _OPSET)]
    if any(n.domain == "com.microsoft" for n in g.nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="pagedkv_np")
    model.ir_version = 8
    return model


def build_linear(weight: Linear, *, accuracy_level: int = 0) -> onnx.ModelProto:
    """One linear layer as a model: input ``x`` float32 [B, S, in], output ``y``
    float32 [B, S, out] = ``x @ weight`` (as :func:`build_decoder` computes it)."""
    g = _Graph(accuracy_level)
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
