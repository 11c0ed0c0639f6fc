"""A Hugging Face ``tokenizers`` tokenizer rebuilt from a GGUF file's metadata.

Three of llama.cpp's tokenizer models (``tokenizer.ggml.model``) are rebuilt.

``gpt2``  byte-level BPE. Its tokens are already byte-level strings and its
merges are ``"left right"`` pairs, so both carry over as they are. How
text is split before BPE depends on ``tokenizer.ggml.pre``:

    ``smollm``     digits one by one, then the byte-level split of GPT-2
    ``llama-bpe``  Llama 3's split (numbers in runs of up to three digits);
                   words already in the vocabulary are not merged further
    ``qwen2``      Qwen2's split (single digits), after NFC normalization
    ``gpt-2``      GPT-2's byte-level split

``llama``  a SentencePiece BPE vocabulary (Llama 2, TinyLlama, Mistral,
Gemma). SentencePiece merges, again and again, the adjacent pair whose join
is the highest-scoring token (the leftmost pair on a tie). That is a
``tokenizers`` BPE whose merges are every split of a token into two tokens,
ranked by the joined token's score (``tokenizer.ggml.scores``; derived in
:mod:`pagedkv_np.models.gguf.merges`). Merges in the file are ignored, as
llama.cpp ignores them. Characters outside the
vocabulary become ``<0xNN>`` byte tokens when the vocabulary has them
(byte fallback), else the unknown token. ``tokenizer.ggml.pre`` is ignored,
as llama.cpp ignores it: SentencePiece splits nothing before BPE.

``t5``  a SentencePiece unigram vocabulary (llama.cpp's UGM): the
segmentation whose token scores (log probabilities) sum highest, which is
what ``tokenizers``' Unigram model computes, with the same penalty (the
lowest score less 10) for an unknown character. A
``tokenizer.ggml.precompiled_charsmap`` normalizes text as SentencePiece's
does.

Both SentencePiece models see text as SentencePiece does: spaces become
``▁`` and, with ``add_space_prefix``, the text starts with one. That is a
normalizer, not a Metaspace pre-tokenizer: the latter adds no ``▁`` to a
text that already starts with a space, so ``" Hello"`` lost one of its
two (32 of llama.cpp's 47 Llama-SPM test cases right against 47 of 47; 383
of the 424 texts of tests/test_gguf_tokenizer.py against all 424).

``tokenizer.ggml.add_bos_token`` and ``add_eos_token`` put the bos token
before and the eos token after an encoded text (with special tokens), as
llama.cpp does.

Tokens of type control become special added tokens, matched whole in the
raw text, so that ``<start_of_turn>`` in a prompt is one token; as in
llama.cpp the text after one starts afresh (with ``add_space_prefix``, its
own ``▁``). SentencePiece itself never reads control tokens in text.
Tokens of type user-defined become added tokens matched whole in the
normalized text, where SentencePiece matches them (llama.cpp's converter
writes their ``▁`` as spaces, which the normalizer turns back), and the
text after one goes on without a new ``▁``, as in SentencePiece (llama.cpp
gives it one). One difference is left: a text that is exactly one
user-defined token gets no ``▁`` before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import UnsupportedModelError
from .merges import merge_ids, merges_from_scores, merges_json

try:
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading a GGUF tokenizer needs tokenizers: "
                      "pip install 'pagedkv-np[models]'") from exc

__all__ = ["PRE_TOKENIZERS", "TOKENIZER_MODELS", "build_tokenizer", "tokenizer_json"]

# ggml token types (llama.cpp's llama_token_type; SentencePiece's numbering)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"           # SentencePiece's "▁"
_UNKNOWN_SURFACE = " \u2047 "   # how SentencePiece decodes the unknown token

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZERS = ("smollm", "llama-bpe", "qwen2", "gpt-2")
TOKENIZER_MODELS = ("gpt2", "llama", "t5")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(**metadata: Any) -> tokenizers.Tokenizer:
    """The tokenizer that the metadata describes (the arguments and errors of
    :func:`tokenizer_json`)."""
    tok, _ = _assemble(with_merges=True, **metadata)
    return tok


def tokenizer_json(**metadata: Any) -> str:
    """The ``tokenizer.json`` text of :func:`build_tokenizer`'s tokenizer.

    The BPE merges go into the text as JSON (:func:`~pagedkv_np.models.gguf.merges.merges_json`),
    not through a ``tokenizers`` object: handing Gemma 3's 513,511 derived
    merges to ``tokenizers.models.BPE`` and saving it took 3.6 s (2.6 + 1.0)
    at load 0.4. Merges are checked (each a pair of tokens whose join is a
    token) before they are written, as ``tokenizers`` would on loading.
    """
    tok, merges = _assemble(with_merges=False, **metadata)
    text = tok.to_str()
    if merges == "[]":
        return text
    # the model is last in the text and its merge list last in the model
    head, empty, tail = text.rpartition('"merges":[]')
    if not empty or tail != "}}":
        raise UnsupportedModelError("tokenizers wrote a tokenizer.json of a shape this "
                                    "version of pagedkv_np does not know")
    return f'{head}"merges":{merges}{tail}'


def _assemble(*, with_merges: bool, model: str, pre: str, tokens: Sequence[str],
              token_types: Sequence[int] | None, merges: Sequence[str],
              bos_token_id: int | None, add_bos_token: bool,
              eos_token_id: int | None = None, add_eos_token: bool = False,
              scores: Sequence[float] | None = None, unknown_token_id: int | None = None,
              add_space_prefix: bool | None = None,
              remove_extra_whitespaces: bool = False,
              precompiled_charsmap: bytes | None = None
              ) -> tuple[tokenizers.Tokenizer, str]:
    """The tokenizer that the metadata describes and, unless ``with_merges``
    (then they are in it), the JSON text of the BPE merges it lacks (``"[]"``
    when it lacks none).

    Parameters
    ----------
    model, pre : str
        ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre``.
    tokens : sequence of str
        ``tokenizer.ggml.tokens``: token ``i`` has id ``i``.
    token_types : sequence of int, optional
        ``tokenizer.ggml.token_type``, one per token.
    merges : sequence of str
        ``tokenizer.ggml.merges``, highest priority first (``gpt2`` only).
    bos_token_id : int, optional
    add_bos_token : bool
        ``tokenizer.ggml.add_bos_token``: whether encoding with special
        tokens starts with the bos token.
    eos_token_id : int, optional
    add_eos_token : bool
        ``tokenizer.ggml.add_eos_token``: whether encoding with special
        tokens ends with the eos token.
    scores : sequence of float, optional
        ``tokenizer.ggml.scores``, one per token: needed by ``llama`` and
        ``t5``.
    unknown_token_id : int, optional
        ``tokenizer.ggml.unknown_token_id``; by default the first token of
        type unknown. SentencePiece models only.
    add_space_prefix : bool, optional
        ``tokenizer.ggml.add_space_prefix``: whether SentencePiece text
        starts with ``▁`` (llama.cpp's default, True, when None).
    remove_extra_whitespaces : bool
        ``tokenizer.ggml.remove_extra_whitespaces`` (``t5`` only): spaces at
        either end dropped, runs of spaces made one.
    precompiled_charsmap : bytes, optional
        ``tokenizer.ggml.precompiled_charsmap`` (``t5`` only).

    Raises
    ------
    UnsupportedModelError
        A tokenizer model or pre-tokenizer other than those above, or
        metadata that does not fit together (the message says which).
    """
    if model not in TOKENIZER_MODELS:
        raise UnsupportedModelError(f"the GGUF tokenizer model {model!r} is not supported; "
                                    f"supported: {', '.join(TOKENIZER_MODELS)}")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"the GGUF pre-tokenizer {pre!r} is not supported; "
                                    f"supported: {', '.join(PRE_TOKENIZERS)}")
    if not set(map(type, tokens)) <= {str} or not set(map(type, merges)) <= {str}:
        raise UnsupportedModelError("the GGUF tokenizer's tokens and merges must be strings")
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        raise UnsupportedModelError("the GGUF tokenizer lists a token twice")
    types = [_NORMAL] * len(tokens) if token_types is None else list(token_types)
    if len(types) != len(tokens):
        raise UnsupportedModelError(f"the GGUF tokenizer has {len(tokens)} tokens but "
                                    f"{len(types)} token types")
    for what, tid in (("bos", bos_token_id), ("eos", eos_token_id),
                      ("unknown", unknown_token_id)):
        if tid is not None and not 0 <= tid < len(tokens):
            raise UnsupportedModelError(f"the GGUF tokenizer's {what} token id {tid} is "
                                        f"outside its {len(tokens)} tokens")
    if model == "gpt2":
        pairs = _merge_pairs(merges, vocab)
        tok = _byte_level_bpe(pre, vocab, pairs if with_merges else [])
        merges_text = "[]" if with_merges else json.dumps(pairs, ensure_ascii=False)
        added: tuple[int, ...] = (_CONTROL, _USER_DEFINED)
    else:
        tok, merges_text = _sentencepiece(model, tokens, types, vocab, scores, unknown_token_id,
                                    True if add_space_prefix is None else add_space_prefix,
                                    remove_extra_whitespaces, precompiled_charsmap,
                                    with_merges)
        added = (_CONTROL,)
    # special and not normalized: matched verbatim before any splitting
    tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in added])
    first = [bos_token_id] if add_bos_token and bos_token_id is not None else []
    last = [eos_token_id] if add_eos_token and eos_token_id is not None else []
    if first or last:
        # as llama.cpp: bos before and eos after the text; a pair has both around each part
        def around(part: str, type_id: int) -> str:
            return " ".join([f"{tokens[tid]}:{type_id}" for tid in first] + [f"${part}:{type_id}"]
                            + [f"{tokens[tid]}:{type_id}" for tid in last])

        tok.post_processor = processors.TemplateProcessing(
            single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}",
            special_tokens=[(tokens[tid], tid) for tid in dict.fromkeys(first + last)])
    return tok, merges_text


def _merge_pairs(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab \
                or parts[0] + parts[1] not in vocab:
            raise UnsupportedModelError(f"the GGUF tokenizer has a merge {merge!r} that is not "
                                        "two tokens of its vocabulary whose join is one")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level_bpe(pre: str, vocab: dict[str, int],
                    pairs: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                          byte_fallback=False,
                                          ignore_merges=pre == "llama-bpe"))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre == "llama-bpe":
        tok.pre_tokenizer = _split_then_bytes(_LLAMA3_SPLIT)
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _split_then_bytes(_QWEN2_SPLIT)
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(model: str, tokens: Sequence[str], types: list[int], vocab: dict[str, int],
                   scores: Sequence[float] | None, unknown_token_id: int | None,
                   add_space_prefix: bool,
                   remove_extra_whitespaces: bool, precompiled_charsmap: bytes | None,
                   with_merges: bool) -> tuple[tokenizers.Tokenizer, str]:
    """A SentencePiece BPE (``llama``) or unigram (``t5``) vocabulary, and the
    BPE's merges (also in the tokenizer when ``with_merges``)."""
    if scores is None:
        raise UnsupportedModelError(
            f"the GGUF tokenizer is a SentencePiece vocabulary (tokenizer.ggml.model = "
            f"{model!r}) without tokenizer.ggml.scores, which decide how it splits text")
    # the types, not the 262,144 values, checked one by one
    if len(scores) != len(tokens) or not all(issubclass(t, (int, float))
                                             for t in set(map(type, scores))):
        raise UnsupportedModelError(f"the GGUF tokenizer has {len(tokens)} tokens but "
                                    f"{len(scores)} scores, or a score that is not a number")
    if unknown_token_id is None:
        unknown_token_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    # as llama.cpp: a character outside the vocabulary becomes <0xNN> tokens if there are any
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    score_list = list(map(float, scores))
    merges_text = "[]"
    if model == "t5":
        if unknown_token_id is None:
            raise UnsupportedModelError("the GGUF tokenizer is a SentencePiece unigram "
                                        "vocabulary without an unknown token")
        tok = tokenizers.Tokenizer(models.Unigram(
            list(zip(tokens, score_list)), unk_id=unknown_token_id,
            byte_fallback=byte_fallback))
    else:
        if with_merges:
            pairs = merges_from_scores(tokens, types, score_list)
        else:
            pairs, merges_text = [], merges_json(tokens, *merge_ids(tokens, types, score_list))
        tok = tokenizers.Tokenizer(models.BPE(
            vocab=dict(vocab), merges=pairs,
            fuse_unk=True, byte_fallback=byte_fallback,
            unk_token=None if unknown_token_id is None else tokens[unknown_token_id]))
    steps: list[normalizers.Normalizer] = []
    if model == "t5" and precompiled_charsmap:
        steps.append(normalizers.Precompiled(precompiled_charsmap))
    if model == "t5" and remove_extra_whitespaces:
        # SentencePiece trims and squeezes the space character only, not tabs or newlines
        steps += [normalizers.Replace(tokenizers.Regex("^ +| +$"), ""),
                  normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]
    user_defined = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    if add_space_prefix and user_defined:
        steps.append(_prefix_unless(user_defined))
    elif add_space_prefix:
        steps.append(normalizers.Prepend(_SPACE))
    steps.append(normalizers.Replace(" ", _SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    unknown = [] if unknown_token_id is None else [
        decoders.Replace(tokens[unknown_token_id], _UNKNOWN_SURFACE)]
    tok.decoder = decoders.Sequence(
        unknown + [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    # matched in the normalized text (their spaces as "▁"), as SentencePiece matches them
    tok.add_tokens([tokenizers.AddedToken(token, special=False, normalized=True)
                    for token in user_defined])
    return tok, merges_text


def _prefix_unless(user_defined: list[str]) -> normalizers.Normalizer:
    """Prepend ``▁`` to a text unless it is empty or one of ``user_defined``.

    ``tokenizers`` normalizes an added token's own text too before looking
    for it in the normalized text, so a plain prefix would have it look for
    ``▁<tok>`` and find ``<tok>`` nowhere else.
    """
    def escape(token: str) -> str:
        return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in token)

    alternatives = "|".join(escape(token) for token in user_defined)
    return normalizers.Replace(tokenizers.Regex(rf"\A(?!(?:{alternatives})?\z)"), _SPACE)

