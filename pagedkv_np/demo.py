"""``python -m pagedkv_np demo``: chats sharing a system prompt, with and without prefix reuse.

Builds a small Llama-style ONNX decoder with random weights, then serves the
same requests twice through :class:`~pagedkv_np.onnxruntime.OrtDecoder`:
once recomputing every prompt in full, once reusing the cached pages of the
shared system prompt. Requests arrive while others are decoding and leave at
different lengths (continuous batching). Prints throughput, time to first
token, pages used and the prefix hit rate of both runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

__all__ = ["main"]


def _serve(model, prompts, budgets, args, prefix_caching: bool, label: str) -> dict:
    from tqdm import tqdm

    from .onnxruntime import OrtDecoder

    dec = OrtDecoder(model, num_pages=args.pages, page_size=args.page_size,
                     max_batch_size=args.batch, enable_prefix_caching=prefix_caching)
    dec.generate([[1, 2, 3]], max_new_tokens=2)   # the session's first run is slow
    before = dec.stats
    first: dict[int, float]   # request id -> time its first token arrived
    submitted, first, outputs = {}, {}, {}
    peak_pages, step, next_idx = 0, 0, 0
    start = time.perf_counter()
    with tqdm(total=int(sum(budgets)), desc=label, unit="tok", leave=True) as bar:
        while next_idx < len(prompts) or dec.has_unfinished_requests():
            # a new chat joins every other step while the batch decodes
            if next_idx < len(prompts) and step % 2 == 0:
                rid = dec.add_request(prompts[next_idx], max_new_tokens=int(budgets[next_idx]))
                submitted[rid], outputs[rid] = time.perf_counter(), next_idx
                next_idx += 1
            events = dec.step()
            now = time.perf_counter()
            for rid, tokens in events.items():
                first.setdefault(rid, now)
                bar.update(len(tokens))
            peak_pages = max(peak_pages, dec.stats["pages_used"])
            step += 1
    elapsed = time.perf_counter() - start
    stats = dec.stats
    hits = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    queries = stats["prefix_query_tokens"] - before["prefix_query_tokens"]
    return {
        "tokens_per_s": sum(budgets) / elapsed,
        "ttft_ms": 1e3 * float(np.mean([first[r] - submitted[r] for r in submitted])),
        "prefill_tokens": queries - hits,
        "peak_pages": peak_pages,
        "hit_rate": hits / queries if queries else 0.0,
        "preemptions": stats["num_preemptions"] - before["num_preemptions"],
        "outputs": [dec.pop_output(r) for r in sorted(outputs, key=outputs.__getitem__)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv demo", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gqa", "optimum"], default="gqa")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from .onnxruntime.testmodel import DecoderConfig, build_model

    config = DecoderConfig(vocab_size=2048, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=8, num_kv_heads=2, seed=args.seed)
    model = build_model(config, family=args.family).SerializeToString()
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, config.vocab_size, args.system_tokens).tolist()
    prompts = [system + rng.integers(0, config.vocab_size, int(n)).tolist()
               for n in rng.integers(8, 48, args.requests)]
    budgets = rng.integers(args.new_tokens // 2, args.new_tokens + 1, args.requests)
    print(f"pagedkv_np demo: {args.family} decoder (hidden {args.hidden}, {args.layers} layers, "
          f"8 heads / 2 KV heads, vocab {config.vocab_size}, random weights); "
          f"{args.requests} chats share a {args.system_tokens}-token system prompt; "
          f"batch {args.batch}, {args.pages} pages of {args.page_size} tokens")
    from .onnxruntime import OrtDecoder

    # compile the cache's kernels (serial and parallel) before timing anything
    OrtDecoder(model, num_pages=args.pages, page_size=args.page_size,
               max_batch_size=args.batch).generate(prompts, max_new_tokens=2)
    off = _serve(model, prompts, budgets, args, False, "prefix reuse off")
    on = _serve(model, prompts, budgets, args, True, "prefix reuse on ")
    rows = [("tokens/s", "{:.0f}", "tokens_per_s"),
            ("time to first token, mean (ms)", "{:.1f}", "ttft_ms"),
            ("prompt tokens computed", "{:d}", "prefill_tokens"),
            ("pages used (peak)", "{:d}", "peak_pages"),
            ("prefix hit rate", "{:.0%}", "hit_rate"),
            ("preemptions", "{:d}", "preemptions")]
    print(f"\n{'':32}{'reuse off':>12}{'reuse on':>12}")
    for name, fmt, key in rows:
        print(f"{name:32}{fmt.format(off[key]):>12}{fmt.format(on[key]):>12}")
    print(f"time to first token: {off['ttft_ms'] / on['ttft_ms']:.1f}x faster with prefix reuse")
    same = off["outputs"] == on["outputs"]
    print(f"generated tokens identical in both runs: {'yes' if same else 'NO'}")
    return 0 if same else 1
