"""How fast a GGUF file with a large vocabulary is refused, and its header read.

Writes a GGUF file with Gemma 3's vocabulary size (262,144 tokens, with
scores and token types) and a small embedding, in three variants: an
unsupported architecture, an unsupported tensor type (IQ4_XS), and a
``block_count`` that its tensors contradict; then times, in this process:

- :func:`pagedkv_np.models.gguf.header.read_header` (metadata and tensor
  table; the vocabulary is left in the file);
- :func:`~pagedkv_np.models.gguf.importer.import_gguf` refusing each variant
  (the file's digest included: the first call hashes it);
- with ``--gguf-reader``, ``gguf.GGUFReader`` on the same file, which is what
  the importer used to parse headers with.

Also, given ``--file PATH`` (e.g. Gemma 3 270M's Q4_K_M GGUF), the header
read of that file and the decoding of its vocabulary.

Run: ``.venv/bin/python scripts/bench_gguf_header.py [--gguf-reader] [--file PATH]``.

Measured on this 2-core machine (2026-12-01, other jobs running; see the
report of the change that added this script for the figures).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

from pagedkv_np.errors import UnsupportedModelError  # noqa: E402
from pagedkv_np.models.gguf.header import read_header  # noqa: E402
from pagedkv_np.models.gguf.importer import import_gguf  # noqa: E402

VOCAB = 262_144


def write(path: Path, arch: str, embed_type=gguf.GGMLQuantizationType.F16,
          block_count: int = 1) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(block_count)
    w.add_context_length(32768)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    if embed_type == gguf.GGMLQuantizationType.F16:
        w.add_tensor("token_embd.weight", np.zeros((VOCAB, 256), np.float16))
    else:
        block, size = gguf.GGML_QUANT_SIZES[embed_type]
        w.add_tensor("token_embd.weight", np.zeros((VOCAB, 256 // block * size), np.uint8),
                     raw_dtype=embed_type)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def timed(fn) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        fn()
        outcome = "ok"
    except UnsupportedModelError as exc:
        outcome = f"{type(exc).__name__}: {str(exc).split(': ', 1)[-1][:70]}"
    return time.perf_counter() - start, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-reader", action="store_true",
                        help="also time gguf.GGUFReader (tens of seconds)")
    parser.add_argument("--file", default=None, help="also read this GGUF file's header")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        variants = {
            "architecture falcon": (root / "arch.gguf", dict(arch="falcon")),
            "IQ4_XS embedding": (root / "iq.gguf",
                                 dict(arch="llama",
                                      embed_type=gguf.GGMLQuantizationType.IQ4_XS)),
            "block_count 10**7": (root / "blocks.gguf", dict(arch="llama",
                                                             block_count=10**7)),
        }
        for name, (path, kw) in variants.items():
            write(path, **kw)
            size = path.stat().st_size / 1e6
            header_s, _ = timed(lambda: read_header(path))
            refuse_s, outcome = timed(lambda: import_gguf(path, cache_dir=root / "cache"))
            again_s, _ = timed(lambda: import_gguf(path, cache_dir=root / "cache"))
            print(f"{name:20s} {size:6.1f} MB  read_header {header_s * 1e3:7.1f} ms  "
                  f"import refused in {refuse_s * 1e3:7.1f} ms (again {again_s * 1e3:6.1f} ms)"
                  f"  {outcome}")
        if args.gguf_reader:
            path = variants["architecture falcon"][0]
            reader_s, _ = timed(lambda: gguf.GGUFReader(str(path)))
            print(f"gguf.GGUFReader on the same file: {reader_s:.1f} s")
    if args.file:
        header_s, _ = timed(lambda: read_header(args.file))
        header = read_header(args.file)
        vocab_s, _ = timed(lambda: header.metadata["tokenizer.ggml.tokens"])
        print(f"{args.file}: read_header {header_s * 1e3:.1f} ms, its vocabulary "
              f"({header.metadata.length('tokenizer.ggml.tokens'):,} tokens) "
              f"{vocab_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
