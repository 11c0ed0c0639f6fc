"""A Hugging Face ``tokenizers`` tokenizer rebuilt from a GGUF file's metadata.

Only gpt2-style byte-level BPE (``tokenizer.ggml.model = "gpt2"``) is
rebuilt: its tokens are already byte-level strings and its merges are
``"left right"`` pairs, so the vocabulary and merges carry over as they are.
How text is split before BPE depends on ``tokenizer.ggml.pre``:

``smollm``     digits one by one, then the byte-level split of GPT-2
``llama-bpe``  Llama 3's split (numbers in runs of up to three digits);
               words already in the vocabulary are not merged further
``qwen2``      Qwen2's split (single digits), after NFC normalization
``gpt-2``      GPT-2's byte-level split

Tokens of type control or user-defined become special added tokens, so
that ``<|im_start|>`` in a prompt is one token. A SentencePiece vocabulary
(``tokenizer.ggml.model = "llama"``) is refused: its scores-based merges and
byte fallback would need another model.
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

__all__ = ["PRE_TOKENIZERS", "build_tokenizer"]

# ggml token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZERS = ("smollm", "llama-bpe", "qwen2", "gpt-2")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(*, model: str, pre: str, tokens: Sequence[str],
                    token_types: Sequence[int] | None, merges: Sequence[str],
                    bos_token_id: int | None, add_bos_token: bool) -> tokenizers.Tokenizer:
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
        ``tokenizer.ggml.merges``, highest priority first.
    bos_token_id : int, optional
    add_bos_token : bool
        Whether encoding with special tokens starts with the bos token.

    Raises
    ------
    UnsupportedModelError
        A tokenizer model or pre-tokenizer other than those above, or
        metadata that does not fit together (the message says which).
    """
    if model == "llama":
        raise UnsupportedModelError(
            "the GGUF tokenizer is a SentencePiece vocabulary (tokenizer.ggml.model = "
            "'llama'); only gpt2-style byte-level BPE tokenizers can be rebuilt")
    if model != "gpt2":
        raise UnsupportedModelError(f"the GGUF tokenizer model {model!r} is not supported "
                                    "(only gpt2-style byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"the GGUF pre-tokenizer {pre!r} is not supported; "
                                    f"supported: {', '.join(PRE_TOKENIZERS)}")
    if not all(isinstance(t, str) for t in tokens) or not all(isinstance(m, str)
                                                              for m in merges):
        raise UnsupportedModelError("the GGUF tokenizer's tokens and merges must be strings")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedModelError("the GGUF tokenizer lists a token twice")
    if token_types is not None and len(token_types) != len(tokens):
        raise UnsupportedModelError(f"the GGUF tokenizer has {len(tokens)} tokens but "
                                    f"{len(token_types)} token types")
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise UnsupportedModelError(f"the GGUF tokenizer has a merge {merge!r} that is not "
                                        "two tokens of its vocabulary")
        pairs.append((parts[0], parts[1]))
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
    special = [tokens[i] for i, t in enumerate(token_types or ())
               if t in (_CONTROL, _USER_DEFINED)]
    # special and not normalized: matched verbatim before any splitting
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)
                            for s in special])
    if add_bos_token and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok
