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
ranked by the joined token's score (``tokenizer.ggml.scores``). Merges in
the file are ignored, as llama.cpp ignores them. Characters outside the
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

from collections.abc import Sequence

from ...errors import UnsupportedModelError

try:
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading a GGUF tokenizer needs tokenizers: "
                      "pip install 'pagedkv-np[models]'") from exc

__all__ = ["PRE_TOKENIZERS", "TOKENIZER_MODELS", "build_tokenizer"]

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


def build_tokenizer(*, model: str, pre: str, tokens: Sequence[str],
                    token_types: Sequence[int] | None, merges: Sequence[str],
                    bos_token_id: int | None, add_bos_token: bool,
                    scores: Sequence[float] | None = None, unknown_token_id: int | None = None,
                    add_space_prefix: bool | None = None,
                    remove_extra_whitespaces: bool = False,
                    precompiled_charsmap: bytes | None = None) -> tokenizers.Tokenizer:
    """The tokenizer that the metadata describes.

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
        Whether encoding with special tokens starts with the bos token.
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
    if not all(isinstance(t, str) for t in tokens) or not all(isinstance(m, str)
                                                              for m in merges):
        raise UnsupportedModelError("the GGUF tokenizer's tokens and merges must be strings")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedModelError("the GGUF tokenizer lists a token twice")
    types = [_NORMAL] * len(tokens) if token_types is None else list(token_types)
    if len(types) != len(tokens):
        raise UnsupportedModelError(f"the GGUF tokenizer has {len(tokens)} tokens but "
                                    f"{len(types)} token types")
    for what, tid in (("bos", bos_token_id), ("unknown", unknown_token_id)):
        if tid is not None and not 0 <= tid < len(tokens):
            raise UnsupportedModelError(f"the GGUF tokenizer's {what} token id {tid} is "
                                        f"outside its {len(tokens)} tokens")
    if model == "gpt2":
        tok = _byte_level_bpe(pre, vocab, _merge_pairs(merges, vocab))
        added: tuple[int, ...] = (_CONTROL, _USER_DEFINED)
    else:
        tok = _sentencepiece(model, tokens, types, vocab, scores, unknown_token_id,
                             True if add_space_prefix is None else add_space_prefix,
                             remove_extra_whitespaces, precompiled_charsmap)
        added = (_CONTROL,)
    # special and not normalized: matched verbatim before any splitting
    tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in added])
    if add_bos_token and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)])
    return tok


def _merge_pairs(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise UnsupportedModelError(f"the GGUF tokenizer has a merge {merge!r} that is not "
                                        "two tokens of its vocabulary")
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


def _merges_from_scores(tokens: Sequence[str], types: list[int],
                        scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every way to join two normal tokens into a normal token, highest join first.

    SentencePiece joins the adjacent pair whose join scores highest, the
    leftmost on a tie; a BPE merge list in this order does the same (a
    token's splits share its rank in all but their order, which matters
    only where two of them overlap in one text).
    """
    normal = {token: tid for tid, token in enumerate(tokens) if types[tid] == _NORMAL}
    ranked = []
    for token, tid in normal.items():
        for cut in range(1, len(token)):
            if token[:cut] in normal and token[cut:] in normal:
                ranked.append((-scores[tid], tid, cut))
    ranked.sort()
    return [(tokens[tid][:cut], tokens[tid][cut:]) for _, tid, cut in ranked]


def _sentencepiece(model: str, tokens: Sequence[str], types: list[int], vocab: dict[str, int],
                   scores: Sequence[float] | None, unknown_token_id: int | None,
                   add_space_prefix: bool,
                   remove_extra_whitespaces: bool,
                   precompiled_charsmap: bytes | None) -> tokenizers.Tokenizer:
    """A SentencePiece BPE (``llama``) or unigram (``t5``) vocabulary."""
    if scores is None:
        raise UnsupportedModelError(
            f"the GGUF tokenizer is a SentencePiece vocabulary (tokenizer.ggml.model = "
            f"{model!r}) without tokenizer.ggml.scores, which decide how it splits text")
    if (len(scores) != len(tokens)
                               or not all(isinstance(s, (int, float)) for s in scores)):
        raise UnsupportedModelError(f"the GGUF tokenizer has {len(tokens)} tokens but "
                                    f"{len(scores)} scores, or a score that is not a number")
    if unknown_token_id is None:
        unknown_token_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    # as llama.cpp: a character outside the vocabulary becomes <0xNN> tokens if there are any
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    score_list = [float(s) for s in scores]
    if model == "t5":
        if unknown_token_id is None:
            raise UnsupportedModelError("the GGUF tokenizer is a SentencePiece unigram "
                                        "vocabulary without an unknown token")
        tok = tokenizers.Tokenizer(models.Unigram(
            list(zip(tokens, score_list)), unk_id=unknown_token_id,
            byte_fallback=byte_fallback))
    else:
        tok = tokenizers.Tokenizer(models.BPE(
            vocab=dict(vocab), merges=_merges_from_scores(tokens, types, score_list),
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
    return tok


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

