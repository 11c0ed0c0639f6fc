"""OrtDecoder against a plain onnxruntime loop, on a generated Llama-style decoder.

Two figures, for each model family. Sibling: the asv suite tracks the same
two per commit at the default sizes (``benchmarks/bench_onnxruntime.py``,
whose model, loops and engine set-up this script drives); this script adds
the CPU-time split, other sizes and thread counts, and prints them at once.

1. Per-step decode cost at batch 1 and 8: ``OrtDecoder.step()`` in steady
   state (the batch unchanged) against the same model driven by onnxruntime
   with its own contiguous past/present loop (optimum: ``present`` fed back
   as ``past``; GroupQueryAttention: one shared past/present buffer through
   IOBinding, as onnxruntime-genai does). Both pick the argmax token each
   step, and their steps take turns, so both see the same machine load.
   Beside the two step times, the extra CPU time the engine spends outside
   onnxruntime (bookkeeping, page writes) beyond what the plain loop spends
   there: it does not depend on how fast the model happened to run.
   Goal: overhead <= 10%.
2. Time to first token of a 1024-token prompt whose first 90% is cached
   (full pages) against the same prompt uncached, on a model where compute
   dominates (hidden 512, 4 layers). Goal: >= 5x faster.

Run: ``.venv/bin/python scripts/bench_ort.py`` (``--quick`` for a smoke run).
Timings are medians over the steps of several runs, wall clock and process
CPU time; one intra-op thread by default, so that a shared machine's load
distorts less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the benchmarks package

from benchmarks.bench_onnxruntime import (ModelClock, PlainLoop, first_token_seconds,  # noqa: E402
                                          model_bytes, session_options, steady_engine)
from pagedkv_np.bench.timing import interleave, timed_cpu  # noqa: E402
from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402


def bench_steps(family: str, args) -> None:
    model, config = model_bytes(family, args.hidden, args.layers, args.heads, args.kv_heads,
                                args.vocab)
    rng = np.random.default_rng(0)
    print(f"\n[{family}] decode step, context {args.context} tokens, {args.steps} steps x "
          f"{args.repeats} runs, the two loops' steps interleaved (median ms)")
    print(f"{'batch':>6}{'plain ORT':>11}{'OrtDecoder':>11}{'overhead':>10}"
          f"{'CPU plain':>11}{'CPU engine':>11}{'overhead':>10}{'extra CPU':>11}")
    for b in (1, 8):
        prompts = rng.integers(0, config.vocab_size, (b, args.context))
        plain, eng, extra = [], [], []
        for _ in range(args.repeats):
            loop = PlainLoop(model, family, config, prompts, args.context + args.steps + 1,
                             args.threads)
            dec = steady_engine(model, prompts, args.steps, args.page_size, args.threads)
            regathers = dec.stats["num_regathers"]
            clocks = ModelClock(loop.session), ModelClock(dec.session)
            steps = interleave({"plain": timed_cpu(loop.step), "engine": timed_cpu(dec.step)},
                               args.steps)
            ptimes, etimes = steps["plain"], steps["engine"]
            assert dec.stats["num_regathers"] == regathers   # no gather while timing
            plain += ptimes
            eng += etimes
            outside = [(sum(c for _, c in t) - clock.seconds) / args.steps
                       for t, clock in zip((ptimes, etimes), clocks)]
            extra.append(outside[1] - outside[0])
        pw, ew = (statistics.median(t[0] for t in x) for x in (plain, eng))
        pc, ec = (statistics.median(t[1] for t in x) for x in (plain, eng))
        ex = statistics.median(extra)
        print(f"{b:>6}{1e3 * pw:>11.3f}{1e3 * ew:>11.3f}{(ew / pw - 1):>10.1%}"
              f"{1e3 * pc:>11.3f}{1e3 * ec:>11.3f}{(ec / pc - 1):>10.1%}"
              f"{1e3 * ex:>7.3f} {ex / pc:>3.0%}")
    print("  extra CPU: CPU ms per step that OrtDecoder spends outside onnxruntime beyond "
          "what the plain loop spends there, and its share of the plain step")


def bench_ttft(family: str, args) -> None:
    model, config = model_bytes(family, args.hidden, args.layers, args.heads, args.kv_heads,
                                args.vocab)
    rng = np.random.default_rng(1)
    page, n = args.page_size, args.prompt
    cached = -(-int(0.9 * n) // page) * page   # full pages, at least 90%
    shared = rng.integers(0, config.vocab_size, cached).tolist()
    num_pages = 8 * (-(-(n + 8) // page))
    warm, cold = (OrtDecoder(model, num_pages=num_pages, page_size=page, max_batch_size=1,
                             enable_prefix_caching=caching,
                             session_options=session_options(args.threads))
                  for caching in (True, False))
    for dec in (warm, cold):
        dec.generate([rng.integers(0, config.vocab_size, 40).tolist()], max_new_tokens=2)
    warm.generate([shared + [1]], max_new_tokens=1)   # the shared part is now cached

    def one_round() -> tuple[float, float]:
        """(cached, uncached) seconds to the first token of one new prompt."""
        prompt = shared + rng.integers(0, config.vocab_size, n - cached).tolist()
        hits = warm.stats["prefix_hit_tokens"]
        hot = first_token_seconds(warm, prompt)
        assert warm.stats["prefix_hit_tokens"] - hits == cached
        return hot, first_token_seconds(cold, prompt)

    pairs = [one_round() for _ in range(args.repeats * 3)]
    h, p = (statistics.median(x) for x in zip(*pairs))
    print(f"\n[{family}] time to first token, {n}-token prompt, {cached} tokens "
          f"({cached / n:.0%}) cached (median ms)")
    print(f"  uncached {1e3 * p:9.1f}   cached {1e3 * h:9.1f}   speedup {p / h:5.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["optimum", "gqa", "both"], default="both")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--context", type=int, default=512, help="decode bench prompt length")
    parser.add_argument("--prompt", type=int, default=1024, help="TTFT bench prompt length")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="onnxruntime intra-op threads, both sides (0: its default)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.context, args.prompt, args.steps, args.repeats = 128, 64, 256, 8, 1
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads, vocab {args.vocab}, float32; onnxruntime "
          f"{ort.__version__}, page size {args.page_size}, {args.threads or 'default'} "
          f"intra-op thread(s)")
    for family in (["optimum", "gqa"] if args.family == "both" else [args.family]):
        bench_steps(family, args)
        bench_ttft(family, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
