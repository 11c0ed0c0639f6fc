"""``token_bound``: the length check that refuses a prompt before tokenizing
it must never refuse one that fits, so its bound must never exceed the real
token count, for any text, under every tokenizer shape it accepts; shapes it
cannot bound get no bound at all."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette", reason="the serve extra is not installed")

from tokenizers import (Regex, Tokenizer, decoders, models, normalizers,  # noqa: E402
                        pre_tokenizers, trainers)

from pagedkv_np.serve.prompts import token_bound  # noqa: E402

CORPUS = ["The capital of France is Paris. Hello world!   indented\n\tcode();",
          "Emoji: 😀 🎉 and café, naïve, Straße. 東京は日本の首都です。 각 한국어",
          "digits 1234567890 and ======== rules ######## and spaces          ."] * 5
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level(alphabet=None, normalizer=None, pre=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=alphabet if alphabet is not None else pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_fallback() -> Tokenizer:
    """SentencePiece's shape: Metaspace-like normalizer, byte fallback."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "b", "c", "ab", "▁ab", "abc", "▁abc"]:
        vocab[piece] = len(vocab)
    merges = [("a", "b"), ("▁", "ab"), ("ab", "c"), ("▁ab", "c")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.add_special_tokens(SPECIAL)
    return tok


def without_control_bytes() -> Tokenizer:
    """A byte-level vocabulary that lacks a few control bytes, as SmolLM2's
    does: the tokenizer drops those characters."""
    gone = {pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            .pre_tokenize_str(chr(b))[0][0] for b in (0x04, 0x06, 0x13)}
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in gone]
    return byte_level(alphabet=alphabet)


BOUNDED = {
    "byte-level": lambda: byte_level(),
    "byte-level, dropped bytes": without_control_bytes,
    "NFC": lambda: byte_level(normalizer=normalizers.NFC()),
    "NFKC + lowercase": lambda: byte_level(normalizer=normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase()])),
    "digits + byte-level": lambda: byte_level(pre=pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)])),
    "byte fallback": byte_fallback,
}
UNBOUNDED = {
    "collapsing whitespace": lambda: byte_level(normalizer=normalizers.Replace(
        Regex(" {2,}"), " ")),
    "deleting a character": lambda: byte_level(normalizer=normalizers.Replace(" ", "")),
    "strip": lambda: byte_level(normalizer=normalizers.Strip()),
    "whitespace split": lambda: byte_level(pre=pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
}

texts = st.lists(st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=30),
    st.sampled_from(SPECIAL + ["\x04\x06\x13" * 7, " " * 40, "=" * 33, "각", "\u1100\u1161\u11a8",
                               "e\u0301\u0323", "\ufdfa", "\u1faf", "ﬃ", "İ", "\t\n" * 5,
                               "12345678901234567890", "abcabc"])), max_size=12).map("".join)


@pytest.fixture(scope="module", params=sorted(BOUNDED))
def bounded(request):
    tok = BOUNDED[request.param]()
    bound = token_bound(tok)
    assert bound is not None, request.param
    return tok, bound


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_the_bound_never_exceeds_the_real_count(bounded, text):
    tok, bound = bounded
    assert bound.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False).ids)


def test_the_longest_token_repeated_meets_the_bound(bounded):
    tok, bound = bounded
    vocab = tok.get_vocab(with_added_tokens=True)
    longest = max((t for t in vocab if t in SPECIAL), key=len)
    text = longest * 50
    assert len(tok.encode(text, add_special_tokens=False).ids) == 50
    assert bound.min_tokens(text) <= 50


@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_tokenizers_that_may_delete_characters_get_no_bound(name):
    assert token_bound(UNBOUNDED[name]()) is None


def test_dropped_bytes_are_counted_out():
    tok = without_control_bytes()
    bound = token_bound(tok)
    assert set(bound.dropped) == {"\x04", "\x06", "\x13"}
    text = "\x04" * 1000 + "Paris"
    assert tok.encode(text).ids == tok.encode("Paris").ids   # the tokenizer drops them
    assert bound.min_tokens(text) == 1


def test_no_bound_for_something_else():
    assert token_bound(None) is None
    assert token_bound(object()) is None
