"""GGUF imports keep the token embedding, and a tied LM head, in the file's
blocks: tiny GGUF files (tests/test_gguf_import.py's writer) with tied and
untied heads and embeddings of 4- and 8-bit types give the NumPy
reference's logits (exactly in float32 where activations stay float32, to a
stated tolerance where an 8-bit head takes int8 activations), and greedy
tokens through OrtDecoder equal a full recompute, batched or alone. Model
folders load without onnxruntime warnings (num_logits_to_keep is a plain
input, not an initializer with a default)."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from helpers import FolderSession, full_recompute_logits
from pagedkv_np import ConfigError
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.models.graph import reference_logits
from pagedkv_np.models.head_file import read_head
from pagedkv_np.onnxruntime import OrtDecoder
from test_gguf_import import _smollm2_path, write_gguf

Q = gguf.GGMLQuantizationType
#: 4-bit codes (Q4_1: offsets), 8-bit codes (Q5_0: zero point 16; Q5_1: offsets; Q8_0)
EMBED_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
EIGHT_BIT = (Q.Q5_0, Q.Q5_1, Q.Q8_0)
#: max |logit - reference| / max |reference| of an 8-bit head on int8 activations;
#: measured 0.3-0.9% on these models (float32 paths: below 1e-6)
INT8_TOLERANCE = 0.03


def _model(folder) -> onnx.ModelProto:
    return onnx.load(str(folder / "model.onnx"))


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _session(folder) -> FolderSession:
    return FolderSession(folder)


def _all_logits(sess, tokens) -> np.ndarray:
    n = len(tokens)
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, n), np.int64),
             "num_logits_to_keep": np.zeros(1, np.int64)}
    for arg in sess.get_inputs():
        if arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
    return sess.run(["logits"], feeds)[0][0]


def _write(tmp_path, embed_type, tied, seed=0):
    types = {"token_embd.weight": embed_type}
    if not tied:
        types["output.weight"] = embed_type
    return write_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1, tied=tied, seed=seed,
                      tensor_types=types)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "head"])
@pytest.mark.parametrize("embed_type", EMBED_TYPES, ids=lambda q: q.name)
def test_embedding_and_head_stay_in_blocks_and_match_the_reference(tmp_path, embed_type, tied):
    spec = _write(tmp_path, embed_type, tied)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache", head_accuracy_level=4)
    model = _model(folder)
    inits = _initializers(model)
    # one copy of the embedding's codes, no float rows; a tied head reads the same codes
    assert "embed.qweight" in inits and "embed" not in inits
    gathers = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gathers) == 1 and gathers[0].input[0] == "embed.qweight"
    heads = [n for n in model.graph.node
             if n.op_type == "MatMulNBits" and n.input[1] in ("embed.qweight", "lm_head.qweight")]
    assert [n.input[1] for n in heads] == ["embed.qweight" if tied else "lm_head.qweight"]
    level = {a.name: a.i for a in heads[0].attribute}["accuracy_level"]
    assert level == (4 if embed_type in EIGHT_BIT else 0)
    assert not any(name.startswith("lm_head") for name in inits) if tied else True

    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _all_logits(_session(folder), tokens)
    err = np.abs(got - want).max() / np.abs(want).max()
    if embed_type in EIGHT_BIT:          # int8 activations in the head only
        assert 0 < err < INT8_TOLERANCE
    else:
        assert err < 1e-5


@pytest.mark.parametrize("embed_type", EMBED_TYPES, ids=lambda q: q.name)
def test_embedding_rows_are_the_blocks_exact_values(tmp_path, embed_type):
    """The first layer sees the gathered rows: with head level 0 every path is
    float32, so the logits equal the reference's to float32 rounding, which a
    wrong row, zero point or offset would not."""
    spec = _write(tmp_path, embed_type, tied=False, seed=3)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache", head_accuracy_level=0)
    tokens = list(range(0, spec.geometry.vocab_size, 9))
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _all_logits(_session(folder), tokens)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    shuffled = dict(spec.reference, embed=np.roll(spec.reference["embed"], 1, axis=0))
    wrong = reference_logits(spec.geometry, shuffled, tokens)
    assert np.abs(wrong - want).max() > 0.05 * np.abs(want).max()


def test_head_level_0_the_default_keeps_an_8_bit_tied_head_in_blocks_for_the_engine(tmp_path):
    """At level 0 an 8-bit tied head leaves the graph: it outputs ``hidden``,
    names ``lm_head.npz`` (the file's blocks, exactly) in its metadata, and the
    embedding is gathered from the same blocks; logits through the engine's
    head match the NumPy forward as closely as a float32 head did."""
    spec = _write(tmp_path, Q.Q8_0, tied=True)
    cache = tmp_path / "cache"
    exact = import_gguf(spec.path, cache_dir=cache)
    assert import_gguf(spec.path, cache_dir=cache, head_accuracy_level=0) == exact
    fast = import_gguf(spec.path, cache_dir=cache, head_accuracy_level=4)
    assert exact != fast and "head4" in fast.name and "head" not in exact.name
    # by default the head follows accuracy_level: level 4 throughout, one name
    level4 = import_gguf(spec.path, cache_dir=cache, accuracy_level=4)
    assert "-acc4-" in level4.name and "head" not in level4.name
    assert import_gguf(spec.path, cache_dir=cache, accuracy_level=4,
                       head_accuracy_level=4) == level4
    heads = [n for n in _model(level4).graph.node
             if n.op_type == "MatMulNBits" and n.input[1] == "embed.qweight"]
    assert [{a.name: a.i for a in h.attribute}["accuracy_level"] for h in heads] == [4]
    model = _model(exact)
    inits = _initializers(model)
    assert "embed" not in inits and "embed.qweight" in inits     # rows gathered from blocks
    assert [o.name for o in model.graph.output][0] == "hidden"
    props = {p.key: p.value for p in model.metadata_props}
    assert props["pagedkv_np.lm_head"] == "lm_head.npz"
    assert set(props) == {"pagedkv_np.lm_head", "pagedkv_np.geometry"}
    assert not any(n.op_type == "MatMulNBits" and n.input[1] == "embed.qweight"
                   for n in model.graph.node)
    parts, softcap = read_head(exact / "lm_head.npz")
    assert softcap == 0 and parts.bits == 8 and parts.block_size == 32
    codes = parts.B.astype(np.float32) - 128     # Q8_0: zero point 128
    values = (codes * parts.scales.reshape(codes.shape[0], -1, 1)).reshape(codes.shape[0], -1)
    np.testing.assert_array_equal(values, spec.reference["embed"])
    tokens = np.random.default_rng(2).integers(0, spec.geometry.vocab_size, 20).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _all_logits(_session(exact), tokens)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("value", [1, 2, 3, -1, "4", True])
def test_bad_head_accuracy_level_is_refused_and_writes_nothing(tmp_path, value):
    spec = _write(tmp_path, Q.Q8_0, tied=True)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="head_accuracy_level"):
        import_gguf(spec.path, cache_dir=cache, head_accuracy_level=value)
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("family", ["gqa", "optimum"])
@pytest.mark.parametrize("embed_type", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_greedy_decoding_equals_full_recompute_batched_or_alone(tmp_path, family, embed_type):
    """With the int8 head a request's tokens are the same decoded in a batch,
    alone from cached pages, with its prompt fed in chunks, or recomputed whole."""
    spec = _write(tmp_path, embed_type, tied=True, seed=2)
    folder = import_gguf(spec.path, family=family, cache_dir=tmp_path / "cache")
    c = spec.geometry
    session = _session(folder)
    prompts = [[5, 60, 70, 80, 90], [7, 8, 9], [5, 60, 70, 80, 90, 100, 3]]
    want = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(full_recompute_logits(session, seq).argmax()))
        want.append(seq[len(prompt):])
    dec = OrtDecoder(folder / "model.onnx", num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     num_pages=64, page_size=4, max_batch_size=3)
    assert dec.generate(prompts, max_new_tokens=12, eos_token_id=[]) == want
    alone = [dec.generate([p], max_new_tokens=12, eos_token_id=[])[0] for p in prompts]
    assert alone == want
    assert dec.stats["prefix_hit_tokens"] > 0          # alone, from cached pages
    chunked = OrtDecoder(folder / "model.onnx", num_kv_heads=c.num_kv_heads,
                         head_dim=c.head_dim, num_pages=64, page_size=4, max_batch_size=3,
                         prefill_chunk=2, enable_prefix_caching=False)
    assert chunked.generate(prompts, max_new_tokens=12, eos_token_id=[]) == want


_LOAD = ("import sys, onnxruntime as ort\n"
         "ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
         "print('loaded')\n")


def _load_stderr(folder) -> str:
    """What onnxruntime writes while a fresh process loads the model at its
    default log level (warnings and above)."""
    out = subprocess.run([sys.executable, "-c", _LOAD, str(folder / "model.onnx")],
                         capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip() == "loaded"
    return out.stderr


def test_a_tiny_import_loads_without_warnings(tmp_path):
    spec = _write(tmp_path, Q.Q8_0, tied=True)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    inputs = {i.name for i in _model(folder).graph.input}
    assert "num_logits_to_keep" in inputs
    assert "num_logits_to_keep" not in _initializers(_model(folder))
    assert _load_stderr(folder) == ""


def test_the_engine_loads_an_import_without_onnxruntime_warnings(tmp_path):
    """OrtDecoder no longer lowers onnxruntime's log level to hide them."""
    spec = _write(tmp_path, Q.Q8_0, tied=True)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    code = ("import sys; from pagedkv_np.onnxruntime import OrtDecoder\n"
            "dec = OrtDecoder(sys.argv[1], num_pages=8, page_size=4)\n"
            "print(dec.generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=[]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(folder / "model.onnx")],
                         capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.startswith("[[") and "onnxruntime" not in out.stderr


def test_smollm2_import_loads_without_warnings():
    folder = import_gguf(_smollm2_path())       # the user cache: imported once
    assert _load_stderr(folder) == ""


def test_the_engine_head_rounds_twice_behind_the_default_int8_step(tmp_path):
    """By default (int8 decode step) the engine-side head rounds its rows to
    int8 twice; int8_activations=True rounds them once, False leaves them
    float32; greedy tokens of the default equal the float32 decoder's here."""
    spec = _write(tmp_path, Q.Q8_0, tied=True)
    folder = str(import_gguf(spec.path, cache_dir=tmp_path / "cache"))
    kw = {"num_pages": 64, "page_size": 4, "threads": 1}
    heads = {}
    decs = {}
    for name, int8 in (("default", None), ("int8", True), ("float", False)):
        decs[name] = OrtDecoder.from_pretrained(folder, int8_activations=int8, **kw)
        heads[name] = decs[name]._batcher.runner.head
    assert heads["default"].int8x2 and not heads["default"].int8
    assert heads["int8"].int8 and not heads["int8"].int8x2
    assert not heads["float"].int8 and not heads["float"].int8x2
    hidden = np.random.default_rng(4).standard_normal((3, heads["float"].hidden_size))
    hidden = hidden.astype(np.float32)
    exact = heads["float"](hidden)
    twice, once = heads["default"](hidden), heads["int8"](hidden)
    assert np.abs(twice - exact).max() < np.abs(once - exact).max() / 20
    prompt = [5, 60, 70, 80, 90]
    assert decs["default"].generate([prompt], max_new_tokens=6) == \
        decs["float"].generate([prompt], max_new_tokens=6)
