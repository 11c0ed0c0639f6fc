"""Fill-in-the-middle prompts for completions' ``suffix``.

A model trained for infilling has three special tokens: the prompt is laid
out prefix-suffix-middle (PSM), ``FIM_PREFIX prefix FIM_SUFFIX suffix
FIM_MIDDLE``, and the model writes the middle. The tokens are found by name
in the vocabulary, in the spellings models use: ``<fim_prefix>``,
``<fim_suffix>``, ``<fim_middle>`` (StarCoder, SmolLM) and
``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>`` (Qwen2.5-Coder,
CodeGemma); a GGUF file's own ``tokenizer.ggml.fim_pre_token_id``,
``fim_suf_token_id`` and ``fim_mid_token_id`` (or the older
``prefix``/``suffix``/``middle_token_id``) come first, as llama.cpp reads
them (:func:`gguf_fim_token_ids`). A model with neither set has no insertion mode: a ``suffix`` is
then a 400 naming it, rather than a prompt the model was never trained on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FIM_NAMES", "fim_token_ids", "gguf_fim_token_ids", "infill_ids"]

#: (prefix, suffix, middle) token spellings, in the order they are looked for
FIM_NAMES = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_token_ids(codec: Any) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of ``codec``'s vocabulary, or
    None when it lacks a whole set."""
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is None:
        return None
    for names in FIM_NAMES:
        ids = [tokenizer.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


#: the GGUF metadata keys of the (prefix, suffix, middle) ids, newest first
GGUF_FIM_KEYS = (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
                  "tokenizer.ggml.fim_mid_token_id"),
                 ("tokenizer.ggml.prefix_token_id", "tokenizer.ggml.suffix_token_id",
                  "tokenizer.ggml.middle_token_id"))


def gguf_fim_token_ids(path: str) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids a GGUF file's metadata names,
    or None when it names no whole set.

    Raises
    ------
    PagedKVError
        The file's header cannot be read, or a key holds no integer.
    """
    from ..models.gguf.reader import GGUFFile

    meta = GGUFFile(path)
    for keys in GGUF_FIM_KEYS:
        ids = [meta.get(key) for key in keys]
        if all(i is not None for i in ids):
            return int(ids[0]), int(ids[1]), int(ids[2])
    return None


def infill_ids(codec: Any, fim: tuple[int, int, int], prefix_ids: Any,
               suffix: str) -> np.ndarray:
    """The PSM prompt: ``[BOS] FIM_PREFIX prefix FIM_SUFFIX suffix FIM_MIDDLE``.

    Parameters
    ----------
    codec : TextCodec
        BOS goes first when it adds one to a text (``add_bos_token``).
    fim : (int, int, int)
        :func:`fim_token_ids`.
    prefix_ids : array_like, shape [num_prefix_tokens], int
        The prompt's tokens, without BOS.
    suffix : str

    Returns
    -------
    ndarray, shape [num_prefix_tokens + num_suffix_tokens + 3 (+1 with BOS)], dtype int64
    """
    pre, suf, mid = fim
    bos = ([codec.bos_token_id] if getattr(codec, "add_bos_token", False)
           and codec.bos_token_id is not None else [])
    suffix_ids = [int(t) for t in codec.encode(suffix, add_special_tokens=False)]
    ids = bos + [pre] + [int(t) for t in prefix_ids] + [suf] + suffix_ids + [mid]
    return np.asarray(ids, dtype=np.int64)
