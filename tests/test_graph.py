"""The decoder graph builder: ggml blocks run exactly as MatMulNBits, and every
geometry and weight form computes what the NumPy forward pass does."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import onnxruntime as ort
import pytest

from pagedkv_np import ConfigError, DTypeError, ShapeError
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.models.graph import (BlockQuantized, DecoderGeometry, build_decoder,
                                          build_linear, reference_logits, save_decoder,
                                          weight_names)

QTYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}
# head_dim 32 is not hidden / heads (64 / 4 = 16); tied head; Q/K/V bias
GEOMETRY = DecoderGeometry(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=96,
                           rope_theta=10000.0, rms_eps=1e-5, max_positions=256,
                           qkv_bias=True, tie_word_embeddings=True)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _blocks(w_in_out, kind):
    """ggml blocks of a float [in, out] weight, as a GGUF file holds them."""
    return BlockQuantized(kind, gguf.quants.quantize(np.ascontiguousarray(w_in_out.T),
                                                     QTYPES[kind]))


def make_weights(c, kind=None, dtype=np.float32, seed=0):
    """Random weights; matrices other than the embedding as ``kind`` blocks."""
    rng = np.random.default_rng(seed)
    shapes = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,),
              "lm_head": (c.hidden_size, c.vocab_size)}
    nq, nkv, h, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size
    for i in range(c.num_layers):
        shapes.update({f"l{i}.attn_norm": (h,), f"l{i}.mlp_norm": (h,), f"l{i}.wq": (h, nq),
                       f"l{i}.wk": (h, nkv), f"l{i}.wv": (h, nkv), f"l{i}.bq": (nq,),
                       f"l{i}.bk": (nkv,), f"l{i}.bv": (nkv,), f"l{i}.wo": (nq, h),
                       f"l{i}.w_gate": (h, f), f"l{i}.w_up": (h, f), f"l{i}.w_down": (f, h)})
    weights = {}
    for name in weight_names(c):
        shape = shapes[name]
        if len(shape) == 1:
            value = (1.0 if "norm" in name else 0.0) + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (1.5 / np.sqrt(shape[0]))
        if name in ("embed", "lm_head"):
            value = value * 4
        value = value.astype(dtype)
        if kind is not None and len(shape) == 2 and name != "embed":
            weights[name] = _blocks(value.astype(np.float32), kind)
        else:
            weights[name] = value
    return weights


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


@pytest.mark.parametrize("kind", sorted(QTYPES))
def test_blocks_dequantize_as_ggml_does(kind):
    w = np.random.default_rng(1).standard_normal((96, 40)).astype(np.float32)
    blocks = _blocks(w, kind)
    want = gguf.quants.dequantize(blocks.blocks, QTYPES[kind]).T
    assert blocks.shape == (96, 40)
    np.testing.assert_array_equal(blocks.dequantize(), want)


@pytest.mark.parametrize("kind", sorted(QTYPES))
@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_matmulnbits_runs_the_blocks_values(kind, accuracy_level):
    """One-hot rows read back each weight: nibble order and the q4_1 offset are exact;
    accuracy_level 4 (int8 activations) stays close."""
    k, n = 64, 40
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32) + 0.5
    blocks = _blocks(w, kind)
    want = blocks.dequantize()
    sess = _session(build_linear(blocks, accuracy_level=accuracy_level))
    eye = np.eye(k, dtype=np.float32)[None]
    got = sess.run(["y"], {"x": eye})[0][0]
    x = np.random.default_rng(3).standard_normal((2, 5, k)).astype(np.float32)
    y = sess.run(["y"], {"x": x})[0]
    if accuracy_level == 0:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(y, x @ want, rtol=1e-5, atol=1e-5)
    else:
        assert np.abs(y - x @ want).max() < 0.05 * np.abs(x @ want).max()


def test_q4_1_offsets_matter():
    """A Q4_1 weight whose blocks differ only in m gives different products."""
    w = np.random.default_rng(4).standard_normal((64, 8)).astype(np.float32)
    blocks = _blocks(w, "q4_1")
    raw = blocks.blocks.copy().reshape(8, 2, 20)
    raw[:, :, 2:4] = np.array([3.0], np.float16).view(np.uint8)[None, None, :]   # m = 3 everywhere
    shifted = BlockQuantized("q4_1", raw.reshape(8, 40))
    x = np.ones((1, 1, 64), np.float32)
    y = _session(build_linear(shifted)).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(y[0, 0], shifted.dequantize().sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(shifted.dequantize() - blocks.dequantize(),
                               3.0 - _mins(blocks), rtol=0, atol=1e-5)


def _mins(blocks):
    m = blocks.blocks.reshape(8, 2, 20)[:, :, 2:4].copy().view(np.float16)[..., 0]
    return np.repeat(m.T.astype(np.float32), 32, axis=0)


@pytest.mark.parametrize("family, position_ids", [("gqa", True), ("optimum", True),
                                                  ("optimum", False)])
@pytest.mark.parametrize("kind", [None] + sorted(QTYPES))
def test_graph_matches_the_numpy_forward(family, position_ids, kind):
    weights = make_weights(GEOMETRY, kind)
    sess = _session(build_decoder(GEOMETRY, weights, family=family, position_ids=position_ids))
    tokens = np.random.default_rng(5).integers(0, GEOMETRY.vocab_size, 37).tolist()
    got, want = _logits(sess, tokens), reference_logits(GEOMETRY, weights, tokens)
    assert got.shape == (37, GEOMETRY.vocab_size)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("tied, bias", [(False, False), (True, False), (False, True)])
def test_float16_weights_and_head_forms(tied, bias):
    c = dataclasses.replace(GEOMETRY, tie_word_embeddings=tied, qkv_bias=bias)
    weights = make_weights(c, dtype=np.float16)
    assert all(w.dtype == np.float16 for w in weights.values())
    sess = _session(build_decoder(c, weights, family="gqa"))
    tokens = np.random.default_rng(6).integers(0, c.vocab_size, 20).tolist()
    got, want = _logits(sess, tokens), reference_logits(c, weights, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_rope_freqs_scale_the_rotary_frequencies():
    weights = make_weights(GEOMETRY)
    tokens = np.random.default_rng(7).integers(0, GEOMETRY.vocab_size, 30).tolist()
    plain = reference_logits(GEOMETRY, weights, tokens)
    weights["rope_freqs"] = np.linspace(1.0, 8.0, GEOMETRY.head_dim // 2).astype(np.float32)
    want = reference_logits(GEOMETRY, weights, tokens)
    assert np.abs(want - plain).max() > 1e-2 * np.abs(plain).max()
    for family in ("gqa", "optimum"):
        got = _logits(_session(build_decoder(GEOMETRY, weights, family=family)), tokens)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("family", ["gqa", "optimum"])
def test_ort_decoder_greedy_equals_full_recompute(tmp_path, family):
    weights = make_weights(GEOMETRY, "q4_1")
    save_decoder(build_decoder(GEOMETRY, weights, family=family), tmp_path)
    assert (tmp_path / "model.onnx.data").stat().st_size > 10_000
    dec = OrtDecoder(tmp_path / "model.onnx", num_pages=64, page_size=4, max_batch_size=3)
    prompts = [[3, 14, 15, 92], [6, 5, 35, 8, 9, 7, 9], [3, 14, 15, 92, 65]]
    outs = dec.generate(prompts, max_new_tokens=9)
    sess = ort.InferenceSession(str(tmp_path / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(9):
            seq.append(int(_logits(sess, seq)[-1].argmax()))
        assert out == seq[len(prompt):]


def test_bad_geometry_and_weights():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        dataclasses.replace(GEOMETRY, num_kv_heads=3)
    with pytest.raises(ConfigError, match="head_dim"):
        dataclasses.replace(GEOMETRY, head_dim=25)
    weights = make_weights(GEOMETRY)
    with pytest.raises(ConfigError, match="family"):
        build_decoder(GEOMETRY, weights, family="torch")
    with pytest.raises(ConfigError, match="'l1.w_up'"):
        build_decoder(GEOMETRY, {k: v for k, v in weights.items() if k != "l1.w_up"})
    with pytest.raises(ShapeError, match="l0.wk"):
        build_decoder(GEOMETRY, {**weights, "l0.wk": weights["l0.wq"]})
    with pytest.raises(ShapeError, match="embed"):     # blocks of an embedding: a row a token
        build_decoder(GEOMETRY, {**weights, "embed": _blocks(weights["embed"], "q8_0")})
    with pytest.raises(DTypeError, match="final_norm"):
        build_decoder(GEOMETRY, {**weights, "final_norm": _blocks(weights["embed"].T, "q8_0")})
    with pytest.raises(DTypeError, match="l0.wo"):
        build_decoder(GEOMETRY, {**weights, "l0.wo": weights["l0.wo"].astype(np.float64)})
    with pytest.raises(ShapeError, match="blocks"):
        BlockQuantized("q4_1", np.zeros((4, 30), np.uint8))
    with pytest.raises(ConfigError, match="kind"):
        BlockQuantized("iq4_nl", np.zeros((4, 18), np.uint8))


def test_optimum_takes_any_even_head_dim():
    c = dataclasses.replace(GEOMETRY, head_dim=24)
    weights = make_weights(c, "q4_0")
    tokens = np.random.default_rng(8).integers(0, c.vocab_size, 25).tolist()
    got = _logits(_session(build_decoder(c, weights, family="optimum")), tokens)
    want = reference_logits(c, weights, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_weights_stream_into_external_data(tmp_path):
    weights = make_weights(GEOMETRY, "q4_1")
    tokens = np.random.default_rng(9).integers(0, GEOMETRY.vocab_size, 12).tolist()
    in_memory = build_decoder(GEOMETRY, weights)
    streamed = build_decoder(GEOMETRY, weights, external_data=tmp_path / "model.onnx.data")
    data_bytes = (tmp_path / "model.onnx.data").stat().st_size
    assert streamed.ByteSize() < 100_000 < data_bytes
    assert data_bytes > 0.9 * (in_memory.ByteSize() - streamed.ByteSize())
    save_decoder(streamed, tmp_path)
    assert (tmp_path / "model.onnx.data").stat().st_size == data_bytes   # not rewritten
    sess = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(_logits(sess, tokens), _logits(_session(in_memory), tokens))
