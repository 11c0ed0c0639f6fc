"""The decoder graph's architecture options (Q/K norm, post-norms, GeGLU, a scaled
embedding, sliding-window layers with RoPE tables of their own, a custom query
scale, logit soft-capping): both I/O families compute what the NumPy forward
does, and the engine's paged past with sliding windows (batched, ragged, reused
prefixes longer than the window) gives the tokens of a full recompute."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from pagedkv_np import ConfigError
from pagedkv_np.models.geometry import DecoderGeometry, rope_tables, weight_names
from pagedkv_np.models.testmodel import build_model, make_weights, reference_logits
from pagedkv_np.onnxruntime import OrtDecoder

WINDOW = 8
# every option at once: Gemma 3's shape (a global layer among sliding ones, local
# RoPE base, Q/K norm, post-norms, GeGLU, sqrt(hidden) embedding scale) plus the
# options Gemma 3 270M does not use (bias, soft-capping, a query scale)
GEMMA_LIKE = DecoderGeometry(num_layers=3, num_kv_heads=1, sliding_window=WINDOW,
                             global_layers=(2,), rope_local_theta=100.0, qk_norm=True,
                             post_norms=True, activation="gelu_tanh", embed_scale=8.0)
GEOMETRIES = {
    "window": DecoderGeometry(sliding_window=WINDOW),                     # Mistral, Phi-3
    "gemma": GEMMA_LIKE,
    "all": dataclasses.replace(GEMMA_LIKE, qkv_bias=True, final_softcap=30.0,
                               attn_scale=0.2, rope_scale=4.0),
}
FAMILIES = ("optimum", "gqa")


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _logits(sess, tokens):
    n = len(tokens)
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, n), np.int64)}
    for arg in sess.get_inputs():
        if arg.name == "position_ids":
            feeds[arg.name] = np.arange(n)[None]
        elif arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
        elif arg.name == "num_logits_to_keep":   # 0: every position
            feeds[arg.name] = np.zeros(1, np.int64)
    return sess.run(["logits"], feeds)[0][0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_graph_matches_the_numpy_forward(name, family):
    c = GEOMETRIES[name]
    tokens = np.random.default_rng(3).integers(0, c.vocab_size, 40).tolist()
    got, want = _logits(_session(build_model(c, family=family)), tokens), \
        reference_logits(c, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_every_option_changes_the_logits():
    """Each option reaches the reference (and so, by the test above, the graph):
    turning any one off changes the output."""
    c = GEOMETRIES["all"]
    tokens = np.random.default_rng(4).integers(0, c.vocab_size, 30).tolist()
    weights = make_weights(c)
    base = reference_logits(c, tokens, weights)
    off = dict(qkv_bias=False, qk_norm=False, post_norms=False, activation="silu",
               embed_scale=1.0, attn_scale=0.0, sliding_window=0, global_layers=(),
               rope_local_theta=0.0, rope_scale=1.0, final_softcap=0.0)
    for field, value in off.items():
        other = reference_logits(dataclasses.replace(c, **{field: value}), tokens, weights)
        assert np.abs(other - base).max() > 1e-3, field


def test_sliding_window_is_banded_and_local_rope_has_its_base():
    """A sliding layer's query sees exactly its last WINDOW positions: changing
    the token WINDOW places back leaves a one-layer model's last logits alone,
    changing the one WINDOW - 1 back does not; the local table has its own base."""
    c = DecoderGeometry(num_layers=1, sliding_window=WINDOW)
    tokens = np.random.default_rng(5).integers(0, c.vocab_size, 20).tolist()
    sess = _session(build_model(c, family="gqa"))
    last = _logits(sess, tokens)[-1]
    far, near = list(tokens), list(tokens)
    far[-1 - WINDOW] = (far[-1 - WINDOW] + 1) % c.vocab_size
    near[-WINDOW] = (near[-WINDOW] + 1) % c.vocab_size
    assert np.abs(_logits(sess, far)[-1] - last).max() < 1e-5
    assert np.abs(_logits(sess, near)[-1] - last).max() > 1e-2
    cos, _ = rope_tables(GEMMA_LIKE, local=True)
    half = GEMMA_LIKE.head_dim // 2
    np.testing.assert_allclose(cos[1], np.cos(100.0 ** -(np.arange(half) / half)), rtol=1e-6)


def _greedy(c, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(c, seq)[-1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_engine_with_sliding_windows_matches_full_recompute(family, page_size):
    """Prompts shorter and longer than the window, batched with ragged lengths,
    then again from the prefix cache: the engine keeps every K/V page and the
    windowed attention masks the paged past, so reused prefixes past the window
    give the very tokens of a full recompute."""
    c = GEMMA_LIKE
    rng = np.random.default_rng(6)
    system = rng.integers(0, c.vocab_size, 3 * WINDOW - 3).tolist()
    prompts = [system + [5, 6], system + [7], rng.integers(0, c.vocab_size, 5).tolist(),
               system[:3]]
    want = [_greedy(c, p, 12) for p in prompts]
    dec = OrtDecoder(build_model(c, family=family), num_pages=64, page_size=page_size,
                     max_batch_size=4)
    assert dec.generate(prompts, max_new_tokens=12) == want
    hits = dec.stats["prefix_hit_tokens"]
    assert dec.generate(prompts[::-1], max_new_tokens=12) == want[::-1]
    assert dec.stats["prefix_hit_tokens"] - hits > 2 * WINDOW      # reused past the window
    # the window matters: the same weights without it answer otherwise
    full = dataclasses.replace(c, sliding_window=0, global_layers=())
    assert [_greedy(full, p, 12) for p in prompts[:2]] != want[:2]


@pytest.mark.parametrize("kw", [dict(activation="relu"), dict(sliding_window=-4),
                                dict(global_layers=(2,)), dict(global_layers=3),
                                dict(global_layers=("0",)), dict(embed_scale=0.0),
                                dict(attn_scale=-1.0), dict(final_softcap=-3.0),
                                dict(rope_scale=0.0), dict(rope_local_theta=-1.0)])
def test_bad_architecture_options(kw):
    with pytest.raises(ConfigError):
        DecoderGeometry(**kw)


def test_weight_names_follow_the_options():
    names = set(weight_names(GEOMETRIES["all"]))
    assert {"l0.q_norm", "l0.k_norm", "l0.post_attn_norm", "l0.post_mlp_norm",
            "l0.bq"} <= names
    assert not {"l0.q_norm", "l0.post_attn_norm"} & set(weight_names(DecoderGeometry()))
