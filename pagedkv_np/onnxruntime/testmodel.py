"""A small Llama-architecture ONNX decoder with seeded random weights.

RMSNorm, rotary position embedding (rotate-half), grouped-query attention
with fewer K/V heads than query heads and a SwiGLU MLP, built with
``onnx.helper`` from NumPy weights: no torch, no download. The same weights
come in the two I/O families that :class:`~pagedkv_np.onnxruntime.OrtDecoder`
reads:

``"optimum"``
    What optimum / ``torch.onnx`` exports look like: attention from
    MatMul/Softmax, ``past_key_values.{i}.key|value`` concatenated with the
    new tokens' K/V into ``present.{i}.key|value``; inputs ``input_ids``,
    ``attention_mask`` and (unless ``position_ids=False``, in which case
    positions come from the mask's running sum) ``position_ids``.
``"gqa"``
    What the onnxruntime-genai model builder writes: one
    ``com.microsoft.GroupQueryAttention`` node per layer, rotary inside the
    op, no ``position_ids``; ``seqlens_k`` and ``total_sequence_length`` come
    from ``attention_mask``; past inputs and present outputs are listed all
    keys, then all values.

:func:`reference_logits` runs the same network in NumPy (no cache), so the
ONNX graphs themselves can be checked. The LM head is scaled so that logits
spread over tens of units: greedy argmax then does not hinge on rounding
differences between batched and unbatched runs. Attention is sharpened (a
larger query scale) so that the next token depends on the whole context, not
only on the last token; ``tests/test_testmodel.py`` checks both properties.

Command line (writes a model for benchmarks)::

    python -m pagedkv_np.onnxruntime.testmodel model.onnx --family gqa \\
        --hidden 512 --layers 4 --heads 8 --kv-heads 2 --vocab 1024
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.onnxruntime.testmodel needs onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

from ..errors import ConfigError
from ..layout import check_positive_int

__all__ = ["DecoderConfig", "FAMILIES", "make_weights", "build_model", "save_model",
           "reference_logits", "main"]

FAMILIES = ("optimum", "gqa")
_OPSET = 17
_MASK_VALUE = -1e9  # finite, so fully padded rows stay finite (no NaN spreads)


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and seed of the test decoder.

    ``head_dim = hidden_size // num_heads``; ``num_heads`` must be a multiple
    of ``num_kv_heads``; ``intermediate_size`` defaults to ``3 * hidden_size``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int | None = None
    max_positions: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    logit_scale: float = 30.0
    query_scale: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_positions"):
            check_positive_int(getattr(self, name), name)
        if self.intermediate_size is not None:
            check_positive_int(self.intermediate_size, "intermediate_size")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"Invalid hidden_size: {self.hidden_size} is not a multiple of "
                              f"num_heads = {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"Invalid num_kv_heads: num_heads = {self.num_heads} is not a "
                              f"multiple of {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"Invalid num_heads: head_dim = {self.head_dim} must be even "
                              "for rotary embedding")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 3 * self.hidden_size

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def make_weights(config: DecoderConfig) -> dict[str, np.ndarray]:
    """Seeded float32 weights (``x @ w`` convention: ``w`` is [in, out])."""
    rng = np.random.default_rng(config.seed)
    h, d, f = config.hidden_size, config.head_dim, config.ffn_size
    nq, nkv = config.num_heads * d, config.num_kv_heads * d

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {"embed": normal((config.vocab_size, h), 1.0)}
    for i in range(config.num_layers):
        w[f"l{i}.attn_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
        w[f"l{i}.wq"] = normal((h, nq), config.query_scale / np.sqrt(h))
        w[f"l{i}.wk"] = normal((h, nkv), 1.0 / np.sqrt(h))
        w[f"l{i}.wv"] = normal((h, nkv), 1.0 / np.sqrt(h))
        w[f"l{i}.wo"] = normal((nq, h), 1.0 / np.sqrt(nq))
        w[f"l{i}.mlp_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
        w[f"l{i}.w_gate"] = normal((h, f), 1.0 / np.sqrt(h))
        w[f"l{i}.w_up"] = normal((h, f), 1.0 / np.sqrt(h))
        w[f"l{i}.w_down"] = normal((f, h), 1.0 / np.sqrt(f))
    w["final_norm"] = (1.0 + normal((h,), 0.1)).astype(np.float32)
    w["lm_head"] = normal((h, config.vocab_size), config.logit_scale / np.sqrt(h))
    return w


def _rope_tables(config: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32 [max_positions, head_dim // 2]."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))
    angles = np.arange(config.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# --------------------------------------------------------------------- NumPy


def reference_logits(config: DecoderConfig, token_ids: Any,
                     weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Logits of every position of one sequence, computed in NumPy without a cache.

    Parameters
    ----------
    token_ids : sequence of int, length S >= 1
    weights : dict, optional
        From :func:`make_weights` (made from ``config`` when omitted).

    Returns
    -------
    ndarray, shape [S, vocab_size], dtype float32
    """
    w = make_weights(config) if weights is None else weights
    ids = np.asarray(token_ids, dtype=np.int64)
    s, d, g = ids.shape[0], config.head_dim, config.num_groups
    cos, sin = _rope_tables(config)
    cos, sin = cos[:s][None], sin[:s][None]          # [1, S, D/2]

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_eps) * weight

    def rope(x):                                    # [H, S, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.tril(np.ones((s, s), dtype=bool))
    x = w["embed"][ids]
    for i in range(config.num_layers):
        h = rms(x, w[f"l{i}.attn_norm"])
        q = rope((h @ w[f"l{i}.wq"]).reshape(s, config.num_heads, d).transpose(1, 0, 2))
        k = rope((h @ w[f"l{i}.wk"]).reshape(s, config.num_kv_heads, d).transpose(1, 0, 2))
        v = (h @ w[f"l{i}.wv"]).reshape(s, config.num_kv_heads, d).transpose(1, 0, 2)
        k, v = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.where(causal[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(s, -1) @ w[f"l{i}.wo"]
        h = rms(x, w[f"l{i}.mlp_norm"])
        gate = h @ w[f"l{i}.w_gate"]
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[f"l{i}.w_up"])) @ w[f"l{i}.w_down"]
    return (rms(x, w["final_norm"]) @ w["lm_head"]).astype(np.float32)


# ---------------------------------------------------------------------- ONNX


class _Graph:
    """Collects nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: Any, hint: str = "c", dtype: Any = None) -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, *,
           outputs: list[str] | None = None, num_outputs: int = 1, domain: str = "",
           **attrs: Any):
        if outputs is None:
            outputs = [self._name(hint or op_type.lower()) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs,
                                           name=self._name(op_type), domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    ms = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(np.float32(eps))])])])
    return g.op("Mul", [g.op("Mul", [x, inv]), weight])


def _mlp(g: _Graph, x: str, w: dict[str, str], i: int, eps: float) -> str:
    h = _rms_norm(g, x, w[f"l{i}.mlp_norm"], eps)
    gate = g.op("MatMul", [h, w[f"l{i}.w_gate"]])
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    up = g.op("MatMul", [h, w[f"l{i}.w_up"]])
    return g.op("Add", [x, g.op("MatMul", [g.op("Mul", [act, up]), w[f"l{i}.w_down"]])])


def _scalar_from_shape(g: _Graph, x: str, axis: int) -> str:
    """int64 [1]: ``x.shape[axis]``."""
    return g.op("Gather", [g.op("Shape", [x]), g.const(np.array([axis], np.int64))], axis=0)


def _rotate(g: _Graph, x: str, cos: str, sin: str) -> str:
    """Rotate-half RoPE of x [B, H, S, D] with cos/sin [B, 1, S, D/2]."""
    x1, x2 = g.op("Split", [x], num_outputs=2, axis=-1)
    first = g.op("Sub", [g.op("Mul", [x1, cos]), g.op("Mul", [x2, sin])])
    second = g.op("Add", [g.op("Mul", [x2, cos]), g.op("Mul", [x1, sin])])
    return g.op("Concat", [first, second], axis=-1)


def _optimum_layers(g: _Graph, c: DecoderConfig, w: dict[str, str], x: str,
                    position_ids: str | None) -> str:
    d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
    one = g.const(np.array([1], np.int64))
    past_len = _scalar_from_shape(g, "past_key_values.0.key", 2)
    seq_len = _scalar_from_shape(g, "input_ids", 1)
    total_len = _scalar_from_shape(g, "attention_mask", 1)
    if position_ids is None:
        # positions from the mask: the k-th unmasked column is position k
        running = g.op("CumSum", ["attention_mask", g.const(np.array(1, np.int64))])
        running = g.op("Sub", [running, g.const(np.array(1, np.int64))])
        running = g.op("Slice", [running, past_len, total_len, one])
        position_ids = g.op("Max", [running, g.const(np.array(0, np.int64))])
    cos_tab, sin_tab = _rope_tables(c)
    cos = g.op("Unsqueeze", [g.op("Gather", [g.const(cos_tab, "cos"), position_ids]),
                             one])
    sin = g.op("Unsqueeze", [g.op("Gather", [g.const(sin_tab, "sin"), position_ids]),
                             one])
    # additive mask [B, 1, S, T]: key j is visible to query i iff j <= past + i and
    # attention_mask[b, j] == 1
    zero_i = g.const(np.array(0, np.int64))
    one_i = g.const(np.array(1, np.int64))
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
    for i in range(c.num_layers):
        h = _rms_norm(g, x, w[f"l{i}.attn_norm"], c.rms_eps)

        def heads(t: str, n: int) -> str:
            t = g.op("Reshape", [t, g.const(np.array([0, 0, n, d], np.int64))])
            return g.op("Transpose", [t], perm=[0, 2, 1, 3])

        q = _rotate(g, heads(g.op("MatMul", [h, w[f"l{i}.wq"]]), nh), cos, sin)
        k = _rotate(g, heads(g.op("MatMul", [h, w[f"l{i}.wk"]]), nkv), cos, sin)
        v = heads(g.op("MatMul", [h, w[f"l{i}.wv"]]), nkv)
        k_all = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2,
                     outputs=[f"present.{i}.key"])
        v_all = g.op("Concat", [f"past_key_values.{i}.value", v], axis=2,
                     outputs=[f"present.{i}.value"])
        qg = g.op("Reshape", [q, g.const(np.array([0, nkv, -1, d], np.int64))])
        scores = g.op("MatMul", [qg, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
        scores = g.op("Add", [g.op("Mul", [scores, scale]), bias])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v_all])
        attn = g.op("Reshape", [attn, g.const(np.array([0, nh, -1, d], np.int64))])
        attn = g.op("Transpose", [attn], perm=[0, 2, 1, 3])
        attn = g.op("Reshape", [attn, g.const(np.array([0, 0, nh * d], np.int64))])
        x = g.op("Add", [x, g.op("MatMul", [attn, w[f"l{i}.wo"]])])
        x = _mlp(g, x, w, i, c.rms_eps)
    return x


def _gqa_layers(g: _Graph, c: DecoderConfig, w: dict[str, str], x: str) -> str:
    # seqlens_k = valid tokens - 1 (right padding), total = mask width, as the
    # genai builder wires them
    total = g.op("ReduceSum", ["attention_mask", g.const(np.array([1], np.int64))], keepdims=0)
    seqlens_k = g.op("Cast", [g.op("Sub", [total, g.const(np.array(1, np.int64))])],
                     to=TensorProto.INT32)
    total_len = g.op("Cast", [g.op("Squeeze", [_scalar_from_shape(g, "attention_mask", 1)])],
                     to=TensorProto.INT32)
    cos_tab, sin_tab = _rope_tables(c)
    cos, sin = g.const(cos_tab, "cos_cache"), g.const(sin_tab, "sin_cache")
    for i in range(c.num_layers):
        h = _rms_norm(g, x, w[f"l{i}.attn_norm"], c.rms_eps)
        q = g.op("MatMul", [h, w[f"l{i}.wq"]])
        k = g.op("MatMul", [h, w[f"l{i}.wk"]])
        v = g.op("MatMul", [h, w[f"l{i}.wv"]])
        attn = g.op(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             seqlens_k, total_len, cos, sin],
            outputs=[g._name("gqa_out"), f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft", num_heads=c.num_heads, kv_num_heads=c.num_kv_heads,
            do_rotary=1, rotary_interleaved=0, local_window_size=-1)[0]
        x = g.op("Add", [x, g.op("MatMul", [attn, w[f"l{i}.wo"]])])
        x = _mlp(g, x, w, i, c.rms_eps)
    return x


def build_model(config: DecoderConfig | None = None, *, family: str = "optimum",
                position_ids: bool = True, **sizes: Any) -> "onnx.ModelProto":
    """Build the test decoder as an ONNX model.

    Parameters
    ----------
    config : DecoderConfig, optional
        Sizes and seed; keyword ``sizes`` (e.g. ``hidden_size=512``) override
        its fields.
    family : {"optimum", "gqa"}
        I/O family (see the module docstring).
    position_ids : bool
        Whether an ``"optimum"`` model takes ``position_ids`` (ignored for
        ``"gqa"``, which never does).

    Returns
    -------
    onnx.ModelProto
        Inputs ``input_ids`` int64 [B, S], ``attention_mask`` int64 [B, P + S],
        (``position_ids`` int64 [B, S]), past K/V float32
        [B, num_kv_heads, P, head_dim]; outputs ``logits`` float32 [B, S, vocab]
        and present K/V float32 [B, num_kv_heads, P + S, head_dim].
    """
    config = replace(config or DecoderConfig(), **sizes)
    if family not in FAMILIES:
        raise ConfigError(f"Invalid family: expected one of {FAMILIES}, got {family!r}")
    weights = make_weights(config)
    g = _Graph()
    w = {}
    for name, value in weights.items():
        w[name] = name
        g.initializers.append(numpy_helper.from_array(value, name))
    x = g.op("Gather", [w["embed"], "input_ids"], axis=0)
    use_positions = family == "optimum" and position_ids
    if family == "optimum":
        x = _optimum_layers(g, config, w, x, "position_ids" if use_positions else None)
    else:
        x = _gqa_layers(g, config, w, x)
    g.op("MatMul", [_rms_norm(g, x, w["final_norm"], config.rms_eps), w["lm_head"]],
         outputs=["logits"])

    c, f32, i64 = config, TensorProto.FLOAT, TensorProto.INT64
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
    graph = helper.make_graph(g.nodes, f"pagedkv_test_decoder_{family}", inputs, outputs,
                              g.initializers)
    opsets = [helper.make_opsetid("", _OPSET)]
    if family == "gqa":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="pagedkv_np")
    model.ir_version = 8
    return model


def save_model(model: "onnx.ModelProto", path: str) -> None:
    """Write ``model`` to ``path`` (weights over 1 GiB go to ``path + '.data'``)."""
    large = model.ByteSize() > (1 << 30)
    onnx.save_model(model, path, save_as_external_data=large, all_tensors_to_one_file=True,
                    location=path.rsplit("/", 1)[-1] + ".data" if large else None)


def main(argv: list[str] | None = None) -> int:
    """Write a test decoder to a file (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_np.onnxruntime.testmodel",
        description="Write a seeded random Llama-style ONNX decoder.")
    parser.add_argument("path", help="output .onnx file")
    parser.add_argument("--family", choices=FAMILIES, default="optimum")
    parser.add_argument("--no-position-ids", action="store_true",
                        help="optimum family: take positions from attention_mask")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                           max_positions=args.max_positions, seed=args.seed)
    model = build_model(config, family=args.family, position_ids=not args.no_position_ids)
    save_model(model, args.path)
    print(f"wrote {args.path}: {args.family} family, {config}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
