"""The decoder of :mod:`pagedkv_np.models.graph` in NumPy, without a cache.

:func:`reference_logits` computes every position's logits of one sequence in
float32 from a :class:`~pagedkv_np.models.geometry.DecoderGeometry` and its
weights (ggml blocks are dequantized), with every field of the geometry
honoured: it is what the ONNX graphs are checked against, and what
:mod:`pagedkv_np.models.testmodel` hands the engine tests. (Tests of the GGUF
import check against a forward pass of their own, written from the file's
tensors, so that a misreading shared by the reader and this module shows.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .geometry import DecoderGeometry, Linear, rope_tables
from .gguf.blocks import BlockQuantized

__all__ = ["reference_logits", "gelu_tanh"]


def _dense(w: Linear) -> np.ndarray:
    return w.dequantize() if isinstance(w, BlockQuantized) else np.asarray(w, np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (PyTorch's ``approximate="tanh"``)."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi))
                                    * (x + np.float32(0.044715) * x * x * x)))


def reference_logits(geometry: DecoderGeometry, weights: dict[str, Linear],
                     token_ids: Any) -> np.ndarray:
    """Logits of every position of one sequence, in float32 NumPy without a cache.

    Parameters
    ----------
    geometry : DecoderGeometry
    weights : dict of str to ndarray or BlockQuantized
        Names as in :mod:`pagedkv_np.models.geometry`; blocks are dequantized.
    token_ids : sequence of int, length S >= 1

    Returns
    -------
    ndarray, shape [S, vocab_size], dtype float32
    """
    c = geometry
    w = {name: _dense(value) for name, value in weights.items()}
    ids = np.asarray(token_ids, dtype=np.int64)
    s, d, g = ids.shape[0], c.head_dim, c.num_groups
    tables = {local: tuple(t[:s][None] for t in rope_tables(c, w.get("rope_freqs"), local=local))
              for local in (False, True)}                   # [1, S, D/2] each

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_eps) * weight

    def rope(x, cos, sin):                          # [H, S, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def proj(h, i, which, n):
        y = h @ w[f"l{i}.w{which}"]
        if c.qkv_bias:
            y = y + w[f"l{i}.b{which}"]
        y = y.reshape(s, n, d).transpose(1, 0, 2)
        if c.qk_norm and which in "qk":
            y = rms(y, w[f"l{i}.{which}_norm"])
        return y

    pos = np.arange(s)
    behind = pos[:, None] - pos[None, :]              # query i, key j: i - j
    x = w["embed"][ids] * np.float32(c.embed_scale)
    for i in range(c.num_layers):
        window = c.window(i)
        cos, sin = tables[window > 0]
        h = rms(x, w[f"l{i}.attn_norm"])
        q = rope(proj(h, i, "q", c.num_heads), cos, sin)
        k = np.repeat(rope(proj(h, i, "k", c.num_kv_heads), cos, sin), g, axis=0)
        v = np.repeat(proj(h, i, "v", c.num_kv_heads), g, axis=0)
        visible = (behind >= 0) & ((behind < window) if window else True)
        scores = q @ k.transpose(0, 2, 1) * np.float32(c.query_scale)
        scores = np.where(visible[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        out = attn.transpose(1, 0, 2).reshape(s, -1) @ w[f"l{i}.wo"]
        if c.post_norms:
            out = rms(out, w[f"l{i}.post_attn_norm"])
        x = x + out
        h = rms(x, w[f"l{i}.mlp_norm"])
        gate = h @ w[f"l{i}.w_gate"]
        act = gate / (1.0 + np.exp(-gate)) if c.activation == "silu" else gelu_tanh(gate)
        out = (act * (h @ w[f"l{i}.w_up"])) @ w[f"l{i}.w_down"]
        if c.post_norms:
            out = rms(out, w[f"l{i}.post_mlp_norm"])
        x = x + out
    head = w["embed"].T if c.tie_word_embeddings else w["lm_head"]
    logits = rms(x, w["final_norm"]) @ head
    if c.final_softcap:
        logits = np.tanh(logits / np.float32(c.final_softcap)) * np.float32(c.final_softcap)
    return logits.astype(np.float32)
