"""GGUF weight types: every ggml block type decodes as gguf.quants.dequantize does,
runs through MatMulNBits (plus its block-sum term) with those values, and a tiny
GGUF of each type imports into a model whose logits and greedy tokens match a
NumPy forward pass over the dequantized weights. K types are written as random
blocks of the right layout (gguf.quants cannot quantize them); types this
importer does not read are refused by name from the header."""

from __future__ import annotations

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.models.gguf.reader import SUPPORTED_TYPES, kept_blocks
from pagedkv_np.models.graph import build_linear, reference_logits
from pagedkv_np.models.head_file import read_head
from pagedkv_np.onnxruntime import OrtDecoder, UnsupportedModelError

from test_gguf_import import _initializers, _logits, _session, random_blocks, write_gguf

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = [Q[kind.upper()] for kind in BLOCK_KINDS]
# rows of 256 inputs everywhere, as the K types need
K_SIZES = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
               intermediate_size=512)


def _raw(kind, rows=6, cols=512, seed=0):
    return random_blocks(np.random.default_rng(seed), (rows, cols), kind, 1.0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_blocks_decode_as_gguf_does(qtype):
    raw = _raw(qtype)
    w = BlockQuantized(qtype.name.lower(), raw)
    assert w.shape == (512, 6)
    np.testing.assert_array_equal(w.dequantize(), gguf.quants.dequantize(raw, qtype).T)
    u, scale, offset = w.decode()
    spec = w.spec
    assert u.shape == (6, 512 // spec.sub, spec.sub) and u.max() < 2 ** spec.code_bits
    assert u.max() >= 2 ** spec.code_bits - 2       # random codes reach the top bits
    assert (offset is not None) == spec.offset


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_matmulnbits_runs_the_blocks_values(qtype, accuracy_level):
    """One-hot rows read back every weight exactly at accuracy_level 0 (codes,
    scales, zero points and the block-sum term); products stay within 1e-5 of
    a float64 matmul of the dequantized weights (4 with int8 activations: 3%)."""
    raw = _raw(qtype, rows=40, cols=512, seed=1)
    w = BlockQuantized(qtype.name.lower(), raw)
    want = gguf.quants.dequantize(raw, qtype).T       # the independent reference
    model = build_linear(w, accuracy_level=accuracy_level)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    bits = {a.name: a.i for a in nodes[0].attribute}
    assert (bits["bits"], bits["block_size"]) == (w.spec.bits, w.spec.sub)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((2, 5, 512)).astype(np.float32)
    y = sess.run(["y"], {"x": x})[0]
    exact = x.astype(np.float64) @ want.astype(np.float64)
    if accuracy_level == 0:
        got = sess.run(["y"], {"x": np.eye(512, dtype=np.float32)[None]})[0][0]
        np.testing.assert_array_equal(got, want)
        assert np.abs(y - exact).max() < 1e-5 * np.abs(exact).max()
    else:
        assert np.abs(y - exact).max() < 0.03 * np.abs(exact).max()


def test_kept_blocks_by_mode():
    four = {Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q2_K}
    assert set(kept_blocks("q4", 0)) == four
    assert set(kept_blocks("q4", 4)) == set(BLOCK_TYPES)
    assert kept_blocks("float32", 4) == {} and kept_blocks("float16", 0) == {}


def _k_file(tmp_path, qtype, tied=True, seed=0, **kw):
    return write_gguf(tmp_path / "m.gguf", "llama", qtype, tied=tied, seed=seed,
                      sizes=K_SIZES, **kw)


def _greedy(spec, folder, prompts, steps):
    c = spec.geometry
    dec = OrtDecoder(folder / "model.onnx", num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     num_pages=64, page_size=4, max_batch_size=len(prompts))
    outs = dec.generate(prompts, max_new_tokens=steps)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(steps):
            seq.append(int(reference_logits(c, spec.reference, seq)[-1].argmax()))
        assert out == seq[len(prompt):]


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [Q.BF16], ids=lambda q: q.name)
def test_each_type_imports_exactly(tmp_path, qtype):
    """Logits within 1e-4 (relative to the largest) of the NumPy forward pass over
    gguf's dequantized weights, and the same greedy tokens; the 4-bit types stay
    MatMulNBits blocks, the others become float32."""
    spec = _k_file(tmp_path, qtype, tied=qtype != Q.Q6_K, seed=5)
    # an 8-bit head at level 0: float32, exact (level 4: tests/test_quantized_head.py)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache", head_accuracy_level=0)
    inits = _initializers(folder)
    kept = qtype in kept_blocks("q4", 0)
    assert ("l0.wq.qweight" in inits) == kept
    assert ("l1.w_down.mins" in inits) == (kept and BLOCK_KINDS[qtype.name.lower()].offset)
    if not kept:
        assert inits["l0.wq"].dtype == np.float32
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _logits(_session(folder), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    _greedy(spec, folder, [[5, 60, 70, 80, 90], [7, 8, 9]], 8)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q4_K], ids=lambda q: q.name)
def test_int8_activations_keep_every_type_as_blocks(tmp_path, qtype):
    spec = _k_file(tmp_path, qtype, seed=6)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache", accuracy_level=4)
    inits = _initializers(folder)
    spec_kind = BLOCK_KINDS[qtype.name.lower()]
    assert inits["l0.w_up.qweight"].shape[1:] == (256 // spec_kind.sub,
                                                  spec_kind.sub * spec_kind.bits // 8)
    assert "embed.qweight" in inits       # the tied head reads the embedding's blocks
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _logits(_session(folder), tokens)
    assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_q4_k_m_mix_imports_exactly(tmp_path):
    """The mix llama.cpp's Q4_K_M writes: Q4_K, Q6_K for V and the FFN's down
    projection, Q5_0 where rows are short, a Q8_0 embedding, an untied Q6_K head."""
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K}
    for i in range(2):
        types.update({f"blk.{i}.attn_v.weight": Q.Q6_K, f"blk.{i}.ffn_down.weight": Q.Q6_K,
                      f"blk.{i}.attn_k.weight": Q.Q5_0})
    spec = _k_file(tmp_path, Q.Q4_K, tied=False, seed=7, tensor_types=types)
    # the Q6_K head at level 0: its blocks, run by the engine (level 4: in the graph,
    # tests/test_quantized_head.py)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache", head_accuracy_level=0)
    inits = _initializers(folder)
    assert "l0.wq.mins" in inits and inits["l0.wv"].dtype == np.float32
    assert "embed.qweight" in inits and "lm_head" not in inits     # Q8_0 rows
    parts, _ = read_head(folder / "lm_head.npz")
    assert (parts.bits, parts.block_size) == (8, 16)                  # Q6_K's sub-blocks
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    assert np.abs(_logits(_session(folder), tokens) - want).max() < 1e-4 * np.abs(want).max()
    _greedy(spec, folder, [[5, 60, 70, 80, 90, 100, 3]], 10)


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS], ids=lambda q: q.name)
def test_unsupported_types_are_named_from_the_header(tmp_path, qtype):
    assert qtype not in SUPPORTED_TYPES
    spec = _k_file(tmp_path, Q.Q4_K, tensor_types={"blk.1.attn_output.weight": qtype})
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(UnsupportedModelError,
                       match=f"blk.1.attn_output.weight.*{qtype.name}"):
        import_gguf(spec.path, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_model_holds_no_matmulnbits_with_slow_bits(tmp_path):
    """No 2-bit MatMulNBits (slow in onnxruntime 1.32) and no 8-bit one at
    accuracy_level 0, whatever the file's types."""
    types = {"blk.0.attn_q.weight": Q.Q2_K, "blk.0.attn_k.weight": Q.Q3_K,
             "blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_q.weight": Q.Q5_K,
             "blk.1.attn_v.weight": Q.Q8_0}
    spec = _k_file(tmp_path, Q.Q4_K, seed=8, tensor_types=types)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    bits = {a.i for n in model.graph.node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "bits"}
    assert bits == {4}
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 20).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    assert np.abs(_logits(_session(folder), tokens) - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_a_gguf_decodes_int8_by_default_with_every_type_in_blocks(tmp_path, qtype):
    """The default of a GGUF import: the engine's own int8 step, every product
    reading blocks: the graph's, or for the 5-8-bit types that it holds in
    float32 at accuracy_level 0, the step file's."""
    spec = _k_file(tmp_path, qtype, seed=7)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    assert (folder / "step_blocks.npz").is_file() == (qtype not in kept_blocks("q4", 0))
    dec = OrtDecoder.from_pretrained(str(folder), num_pages=64, page_size=4, threads=1)
    assert dec.native is not None and dec.native.int8 and dec.native.float_linears() == 0
    prompt = [5, 60, 70, 80, 90]
    assert len(dec.generate([prompt], max_new_tokens=4)[0]) == 4
