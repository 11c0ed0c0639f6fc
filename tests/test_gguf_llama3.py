"""Llama 3 and Mistral GGUF files, vocabulary and model together.

Tiny ``llama`` files written here with gguf.GGUFWriter, as llama.cpp's
converter lays them out:

- Llama 3: RoPE frequency factors (``rope_freqs.weight``) and a byte-level
  BPE vocabulary with ``tokenizer.ggml.pre = "llama-bpe"`` (Llama 3's split:
  digits in runs of up to three; a word that is a token whole is not merged);
- Mistral: a SentencePiece vocabulary (trained here with the
  ``sentencepiece`` package, tests/spm_models.py) and a sliding window.

The folder's tokenizer is checked against ids written out by hand (Llama 3;
llama.cpp's own test vocabulary agrees 46/46 by
scripts/llamacpp_vocab_agreement.py) or against SentencePiece (Mistral); the
logits of an encoded prompt against the independent NumPy forward pass of
the file (tests/numpy_decoder.py); greedy tokens of text prompts through the
engine against that forward pass recomputing the whole sequence.
"""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest

from numpy_decoder import GGUFDecoder
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.text.codec import TextCodec
from spm_models import gguf_fields, processor, test_texts, train

WINDOW = 8
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shifted = [], 0
    for b in range(256):
        out.append(chr(b) if b in printable else chr(0x100 + shifted))
        shifted += b not in printable
    return out


#: Llama 3-like merges over the byte alphabet ("Ġ" is the space); "3 4" before
#: "12 3": "12345" unsplit would be 12 34 5, split in threes it is 123 45
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "1 2", "3 4", "12 3", "4 5",
          "e l", "el l", "H ell", "Hell o", "o r", "Ġ w", "Ġw or"]
#: in the vocabulary whole, but no merge makes them: Llama 3's split keeps them
WHOLE = ["Ġworld", "Ġinformation"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def _llama3_vocabulary() -> dict:
    tokens = _byte_tokens() + ["".join(m.split(" ")) for m in MERGES] + WHOLE + SPECIALS
    begin = tokens.index("<|begin_of_text|>")
    return dict(model="gpt2", pre="llama-bpe", tokens=tokens,
                token_types=[1] * (len(tokens) - 3) + [3] * 3, merges=MERGES,
                bos_token_id=begin, eos_token_id=begin + 1, add_bos_token=True)


def write_llama(path, vocabulary: dict, *, window=0, rope_freqs=False, seed=0) -> str:
    """A two-layer ``llama`` file with random weights and ``vocabulary``
    (``build_tokenizer``'s keyword arguments) as its tokenizer metadata."""
    rng = np.random.default_rng(seed)
    num_tokens = len(vocabulary["tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-5)
    if window:
        w.add_sliding_window(window)
    w.add_tokenizer_model(vocabulary["model"])
    if vocabulary.get("pre"):
        w.add_tokenizer_pre(vocabulary["pre"])
    w.add_token_list(vocabulary["tokens"])
    w.add_token_types(vocabulary["token_types"])
    if vocabulary.get("scores") is not None:
        w.add_token_scores(vocabulary["scores"])
    if vocabulary.get("merges"):
        w.add_token_merges(vocabulary["merges"])
    w.add_bos_token_id(vocabulary["bos_token_id"])
    w.add_eos_token_id(vocabulary["eos_token_id"])
    w.add_add_bos_token(vocabulary["add_bos_token"])
    if vocabulary.get("unknown_token_id") is not None:
        w.add_unk_token_id(vocabulary["unknown_token_id"])
    if vocabulary.get("add_space_prefix") is not None:
        w.add_add_space_prefix(vocabulary["add_space_prefix"])

    def matrix(rows, cols, std=1.0):
        return (rng.standard_normal((rows, cols)) * std / np.sqrt(cols)).astype(np.float32)

    def vector(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32),
               "output_norm.weight": vector(HIDDEN),
               "output.weight": matrix(num_tokens, HIDDEN, 6.0)}
    if rope_freqs:       # Llama 3.1's factors: 1 for high frequencies, up to 8 for low
        tensors["rope_freqs.weight"] = np.geomspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32)
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": vector(HIDDEN), p + "ffn_norm.weight": vector(HIDDEN),
            p + "attn_q.weight": matrix(HEADS * HEAD_DIM, HIDDEN, 3.0),
            p + "attn_k.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_output.weight": matrix(HIDDEN, HEADS * HEAD_DIM, 4.0),
            p + "ffn_gate.weight": matrix(FFN, HIDDEN), p + "ffn_up.weight": matrix(FFN, HIDDEN),
            p + "ffn_down.weight": matrix(HIDDEN, FFN, 4.0)})
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def mistral_spm():
    """A SentencePiece BPE model with Llama 2 / Mistral settings, and its vocabulary
    as GGUF metadata (eos after bos, as in SentencePiece)."""
    proto = train("bpe")
    fields = gguf_fields(proto)
    return processor(proto), dict(fields, eos_token_id=fields["bos_token_id"] + 1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, mistral_spm):
    """name -> (the GGUF file, its float32 model folder)."""
    root = tmp_path_factory.mktemp("llama3")
    files = {"llama3": write_llama(root / "llama3.gguf", _llama3_vocabulary(), rope_freqs=True),
             "mistral": write_llama(root / "mistral.gguf", mistral_spm[1], window=WINDOW)}
    return {name: (path, import_gguf(path, weights="float32", cache_dir=root / "cache"))
            for name, path in files.items()}


LLAMA3_TEXTS = {
    "Hello world": ["Hello", "Ġworld"],
    "the information": ["t", "he", "Ġinformation"],            # a whole word, no merges
    " the and 12345": ["Ġthe", "Ġand", "Ġ", "123", "45"],         # digits by three
    "and\n\n  world": ["a", "n", "d", "Ċ", "Ċ", "Ġ", "Ġworld"],
    "Hello<|eot_id|>the": ["Hello", "<|eot_id|>", "t", "he"],
}


@pytest.mark.parametrize("text", sorted(LLAMA3_TEXTS))
def test_llama3_vocabulary_splits_as_llama3(folders, text):
    codec = TextCodec.from_folder(folders["llama3"][1])
    tokens = _llama3_vocabulary()["tokens"]
    ids = codec.encode(text).tolist()
    assert ids[0] == tokens.index("<|begin_of_text|>")
    assert [tokens[i] for i in ids[1:]] == LLAMA3_TEXTS[text]
    assert codec.decode(ids[1:]) == text.replace("<|eot_id|>", "")   # specials skipped


def test_mistral_vocabulary_is_sentencepiece(folders, mistral_spm):
    sp, _ = mistral_spm
    codec = TextCodec.from_folder(folders["mistral"][1])
    for text in test_texts(100):
        assert codec.encode(text).tolist() == [sp.bos_id()] + sp.encode(text)


def _prompts(codec) -> list[list[int]]:
    texts = ["the and Hello world 123 the information and world, the 12345 or the and",
             "Hello the", "world world world and 12"]
    return [codec.encode(t).tolist() for t in texts]


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_logits_match_an_independent_forward_pass(folders, name):
    """Every position of an encoded prompt: |ONNX - NumPy| < 1e-4 of the largest logit."""
    path, folder = folders[name]
    tokens = _prompts(TextCodec.from_folder(folder))[0]
    assert len(tokens) > 2 * WINDOW
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, len(tokens)), np.int64)}
    for arg in sess.get_inputs():
        if arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
        elif arg.name in ("num_logits_to_keep", "logits_to_keep"):   # 0: every position
            feeds[arg.name] = np.zeros(1 if arg.shape else (), np.int64)
    got = sess.run(["logits"], feeds)[0][0]
    want = GGUFDecoder(path).logits(tokens)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_greedy_matches_full_recompute(folders, name):
    """Text prompts, batched, then again with their prefixes cached: the tokens
    of the NumPy forward pass recomputing the whole sequence at every step. The
    file's feature matters: without the RoPE factors (Llama 3) or the window
    (Mistral) the reference answers otherwise."""
    path, folder = folders[name]
    prompts = _prompts(TextCodec.from_folder(folder))
    ref = GGUFDecoder(path)
    want = [ref.greedy(p, 8) for p in prompts]
    assert min(len(set(w)) for w in want) > 2              # no echo of one token
    if name == "mistral":
        ref.swa = [False] * ref.n_layer
    else:
        del ref.t["rope_freqs.weight"]
    assert [ref.greedy(p, 8) for p in prompts] != want
    dec = OrtDecoder(str(folder / "model.onnx"), num_pages=64, page_size=4, max_batch_size=3)
    assert dec.generate(prompts, max_new_tokens=8) == want
    assert dec.generate(prompts[::-1], max_new_tokens=8) == want[::-1]
    assert dec.stats["prefix_hit_tokens"] > 0
