"""SentencePiece models trained here, and their vocabularies as GGUF metadata.

``train`` trains a small BPE or unigram model with the ``sentencepiece``
package on text drawn by ``sample_text`` (syllable words, capitals, digit
runs, CJK, emoji, punctuation; single, double and leading spaces, tabs and
newlines; sometimes a character no training text has, for byte fallback).
``gguf_fields`` lays a model's vocabulary out as llama.cpp's converter
writes it into a GGUF file (``tokenizer.ggml.*``, as keyword arguments of
``build_tokenizer``); ``proto_from_gguf`` goes the other way, so that
SentencePiece itself can tokenize with a vocabulary read from a GGUF file.
"""

from __future__ import annotations

import functools
import io
import random

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

SYLLABLES = ["ka", "to", "ri", "en", "the", "ing", "qu", "st", "ar", "on", "el", "ph", "ou",
             "mi", "sh", "a", "e", "i", "o", "u", "re", "de", "zz", "x"]
CJK = "東京大阪你好世界的是不了人我在有他这中大来上国个到说们为子和你地出道也时年"
EMOJI = ["😀", "😂", "🤖", "🎉", "👍🏽", "❤️", "🚀"]
PUNCT = ",.;:!?()-'\"/"
# never in training text: each becomes <0xNN> byte tokens, or the unknown token
RARE = ["ẞ", "Ω", "ж", "ü", "🦜", "ä€", "\u00a0", "क"]
# texts that the tests name on purpose, beside the random ones
EDGE_TEXTS = ["", " ", "  ", "   ", " Hello", "Hello", "  leading", "trailing  ", "a  b   c",
              "\n", "x\ny", "\n\nz", "\tt", "a \n b", "12345", "3.14159 2718", "東京大阪",
              "😀😂", "👍🏽", "❤️", "ẞΩ", "ä€", "mixed 東京 123 😀\n", "quote \"it's\" (x)"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
SPACE = "\u2581"


def _word(rng: random.Random) -> str:
    k = rng.random()
    if k < .70:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
    if k < .78:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))).capitalize()
    if k < .86:
        return str(rng.randint(0, 10 ** rng.randint(1, 7)))
    if k < .93:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 4)))
    if k < .96:
        return rng.choice(EMOJI)
    return rng.choice(PUNCT)


def sample_text(rng: random.Random, rare: bool = True) -> str:
    """Up to 14 words and their separators; with ``rare``, sometimes an unseen character."""
    parts = []
    for _ in range(rng.randint(0, 14)):
        parts.append(_word(rng))
        k = rng.random()
        parts.append(" " if k < .8 else "  " if k < .87 else "\n" if k < .93 else
                     "" if k < .97 else "\t")
    text = "".join(parts)
    if rare and rng.random() < .15:
        text += rng.choice(RARE)
    if rng.random() < .1:
        text = " " * rng.randint(1, 3) + text
    return text


def test_texts(num_texts: int = 400, seed: int = 1) -> list[str]:
    """``num_texts`` random texts, then ``EDGE_TEXTS``."""
    rng = random.Random(seed)
    return [sample_text(rng) for _ in range(num_texts)] + EDGE_TEXTS


test_texts.__test__ = False   # type: ignore[attr-defined]  # a helper, not a pytest test


@functools.cache
def train(model_type: str = "bpe", **options) -> bytes:
    """A serialized SentencePiece ModelProto trained on 3000 sample texts.

    The defaults are Llama 2's settings (identity normalization, spaces kept
    as they are, a ``▁`` prefix, digits split, byte fallback) and two
    user-defined symbols, ``<sep>`` and ``(x)``; ``options`` override them.
    """
    rng = random.Random(0)
    lines = [sample_text(rng, rare=False) for _ in range(3000)]
    args = dict(model_type=model_type, vocab_size=800, character_coverage=1.0,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                add_dummy_prefix=True, split_digits=True, byte_fallback=True,
                allow_whitespace_only_pieces=True, user_defined_symbols=["<sep>", "(x)"],
                minloglevel=2, num_threads=1)
    args.update(options)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, **args)
    return out.getvalue()


def processor(proto: bytes) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_proto=proto)


def gguf_fields(proto: bytes) -> dict:
    """``build_tokenizer``'s arguments as llama.cpp's converter writes the model.

    BPE models become ``tokenizer.ggml.model = "llama"``, unigram models
    ``"t5"`` (with the normalizer's charsmap and whitespace setting); the
    spaces of user-defined tokens are written as spaces, not ``▁``.
    """
    m = pb.ModelProto()
    m.ParseFromString(proto)
    unigram = m.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM
    tokens = [p.piece.replace(SPACE, " ") if p.type == USER_DEFINED else p.piece
              for p in m.pieces]
    fields = dict(model="t5" if unigram else "llama", pre="default", tokens=tokens,
                  token_types=[p.type for p in m.pieces], scores=[p.score for p in m.pieces],
                  merges=[], bos_token_id=m.trainer_spec.bos_id, add_bos_token=True,
                  unknown_token_id=m.trainer_spec.unk_id,
                  add_space_prefix=m.normalizer_spec.add_dummy_prefix)
    if unigram:
        fields.update(remove_extra_whitespaces=m.normalizer_spec.remove_extra_whitespaces,
                      precompiled_charsmap=m.normalizer_spec.precompiled_charsmap or None)
    return fields


def proto_from_gguf(tokens, scores, token_types, *, unknown_token_id: int, bos_token_id: int,
                    eos_token_id: int, add_space_prefix: bool) -> bytes:
    """A SentencePiece BPE model (identity normalization, byte fallback) holding a
    GGUF vocabulary: the unknown token typed unknown, user-defined spaces as ``▁``."""
    m = pb.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, token_types)):
        m.pieces.add(piece=piece.replace(" ", SPACE) if kind == USER_DEFINED else piece,
                     score=score, type=UNKNOWN if i == unknown_token_id else kind)
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = unknown_token_id
    m.trainer_spec.bos_id = bos_token_id
    m.trainer_spec.eos_id = eos_token_id
    m.trainer_spec.pad_id = -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = add_space_prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    return m.SerializeToString()
