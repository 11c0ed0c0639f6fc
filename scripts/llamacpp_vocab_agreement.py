"""How often GGUF tokenizers agree with llama.cpp's own tokenizer tests.

llama.cpp ships vocabulary-only GGUF files (``models/ggml-vocab-*.gguf``)
with texts (``.inp``, separated by ``__ggml_vocab_test__`` lines) and the ids
its tokenizer gives them without special tokens (``.out``, one line per
text). This reads each vocabulary through ``tokenizer_json``, as the
importer does, and counts the texts whose ids are llama.cpp's. The files
are not in this repository: point ``--models`` at a llama.cpp checkout's
``models`` folder (``scripts/bench_llamacpp.py`` unpacks one from the
llama-cpp-python 0.3.36 sdist into the user cache)::

    python scripts/llamacpp_vocab_agreement.py [--models DIR] [NAME ...]

NAME is the part after ``ggml-vocab-`` (default: llama-bpe, llama-spm,
gpt-2, qwen2, phi-3); the mismatches are printed with ``-v``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tokenizers

from pagedkv_np.errors import UnsupportedModelError
from pagedkv_np.models.gguf.reader import GGUFFile
from pagedkv_np.models.gguf.tokenizer import tokenizer_json

_SEPARATOR = "\n__ggml_vocab_test__\n"
_DEFAULT_MODELS = (Path.home() / ".cache/pagedkv_np/llama.cpp/0.3.36/llama_cpp_python-0.3.36"
                   "/vendor/llama.cpp/models")


def cases(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) of ``ggml-vocab-NAME.gguf.inp`` / ``.out``."""
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = texts.split(_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def tokenizer(path: Path) -> tokenizers.Tokenizer:
    """The tokenizer the importer writes for a vocabulary-only GGUF file."""
    f = GGUFFile(str(path))
    get = f.meta.get
    text = tokenizer_json(
        model=get("tokenizer.ggml.model", ""), pre=get("tokenizer.ggml.pre", "gpt-2"),
        tokens=get("tokenizer.ggml.tokens"), token_types=get("tokenizer.ggml.token_type"),
        merges=get("tokenizer.ggml.merges") or [],
        bos_token_id=get("tokenizer.ggml.bos_token_id"), add_bos_token=False,
        scores=get("tokenizer.ggml.scores"),
        unknown_token_id=get("tokenizer.ggml.unknown_token_id"),
        add_space_prefix=get("tokenizer.ggml.add_space_prefix"))
    return tokenizers.Tokenizer.from_str(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*",
                        default=["llama-bpe", "llama-spm", "gpt-2", "qwen2", "phi-3"])
    parser.add_argument("--models", type=Path, default=_DEFAULT_MODELS)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    for name in args.names:
        try:
            tok = tokenizer(args.models / f"ggml-vocab-{name}.gguf")
        except (OSError, UnsupportedModelError) as exc:
            print(f"{name}: not read ({exc})")
            continue
        pairs = cases(args.models, name)
        wrong = [(text, want, tok.encode(text, add_special_tokens=False).ids)
                 for text, want in pairs
                 if tok.encode(text, add_special_tokens=False).ids != want]
        print(f"{name}: {len(pairs) - len(wrong)}/{len(pairs)} texts give llama.cpp's ids")
        if args.verbose:
            for text, want, got in wrong:
                print(f"    {text!r}\n      llama.cpp {want}\n      here      {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
