"""OrtDecoder against a plain onnxruntime loop, on a generated Llama-style decoder.

Two figures, for each model family:

1. Per-step decode cost at batch 1 and 8: ``OrtDecoder.step()`` in steady
   state (the batch unchanged, so only the new tokens' K/V go into the
   pages) against the same model driven by onnxruntime with its own
   contiguous past/present loop (optimum: ``present`` fed back as ``past``;
   GroupQueryAttention: one shared past/present buffer through IOBinding, as
   onnxruntime-genai does). Both pick the argmax token each step. Beside the
   two step times, the extra CPU time the engine spends outside onnxruntime
   (bookkeeping, page writes) beyond what the plain loop spends there, each
   measured within its own run: it does not depend on how fast the shared
   machine happened to run the model. Goal: overhead <= 10%.
2. Time to first token of a 1024-token prompt whose first 90% is cached
   (full pages) against the same prompt uncached, on a model where compute
   dominates (hidden 512, 4 layers). Goal: >= 5x faster.

Run: ``.venv/bin/python scripts/bench_ort.py`` (``--quick`` for a smoke run).
Timings are medians of repeated runs, wall clock and process CPU time; one
intra-op thread by default, so that a shared machine's load distorts less.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.onnxruntime.testmodel import DecoderConfig, build_model


def _model(family: str, args) -> tuple[bytes, DecoderConfig]:
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=args.kv_heads)
    return build_model(config, family=family).SerializeToString(), config


_THREADS = 1


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = _THREADS
    return options


def _session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, sess_options=_options(),
                                providers=["CPUExecutionProvider"])


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - t0[0], cpu - t0[1]


class _ModelClock:
    """Wraps a session's run methods to add up the CPU time spent inside them."""

    def __init__(self, sess: ort.InferenceSession) -> None:
        self.seconds = 0.0
        for name in ("run", "run_with_iobinding"):
            setattr(sess, name, self._timed(getattr(sess, name)))

    def _timed(self, real):
        def timed(*a, **k):
            t0 = time.process_time()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.process_time() - t0
        return timed


# ------------------------------------------------------- plain onnxruntime


def plain_loop(model: bytes, family: str, config: DecoderConfig, prompts: np.ndarray,
               num_steps: int):
    """Decode ``num_steps`` tokens for a batch of equal-length prompts with a
    contiguous past/present loop. A generator: set up, then yield once before
    each step and once at the end; ``send`` nothing. Returns each step's
    (wall, CPU) seconds and the CPU seconds per step spent outside onnxruntime."""
    sess = _session(model)
    b, n = prompts.shape
    h, d, layers = config.num_kv_heads, config.head_dim, config.num_layers
    pk = [f"past_key_values.{i}.key" for i in range(layers)]
    pv = [f"past_key_values.{i}.value" for i in range(layers)]
    outk = [f"present.{i}.key" for i in range(layers)]
    outv = [f"present.{i}.value" for i in range(layers)]
    feeds = {"input_ids": prompts, "attention_mask": np.ones((b, n), np.int64)}
    if family == "optimum":
        feeds["position_ids"] = np.broadcast_to(np.arange(n), (b, n)).copy()
    empty = np.zeros((b, h, 0, d), np.float32)
    feeds.update({name: empty for name in pk + pv})
    outs = sess.run(["logits"] + outk + outv, feeds)
    tokens = outs[0][:, -1].argmax(-1)
    times = []
    clock = _ModelClock(sess)
    if family == "optimum":
        past = outs[1:]
        mask = np.ones((b, n), np.int64)
        for step in range(num_steps):
            yield
            t0 = _clock()
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
            feeds = {"input_ids": tokens.reshape(b, 1).astype(np.int64), "attention_mask": mask,
                     "position_ids": np.full((b, 1), n + step, np.int64)}
            feeds.update(zip(pk + pv, past))
            outs = sess.run(["logits"] + outk + outv, feeds)
            past = outs[1:]
            tokens = outs[0][:, -1].argmax(-1)
            times.append(_since(t0))
        yield
        return times, (sum(t[1] for t in times) - clock.seconds) / num_steps
    capacity = n + num_steps + 1
    binding = sess.io_binding()
    bufs = []
    for i, (k, v) in enumerate(zip(outs[1:1 + layers], outs[1 + layers:])):
        for src, dst, arr in ((pk[i], outk[i], k), (pv[i], outv[i], v)):
            buf = np.zeros((b, h, capacity, d), np.float32)
            buf[:, :, :n] = arr
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(src, value)
            binding.bind_ortvalue_output(dst, value)
            bufs.append(buf)
    logits = np.empty((b, 1, config.vocab_size), np.float32)
    binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    for step in range(num_steps):
        yield
        t0 = _clock()
        ids = tokens.reshape(b, 1).astype(np.int64)
        mask = np.ones((b, n + step + 1), np.int64)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        sess.run_with_iobinding(binding)
        tokens = logits[:, -1].argmax(-1)
        times.append(_since(t0))
    yield
    return times, (sum(t[1] for t in times) - clock.seconds) / num_steps


# ----------------------------------------------------------------- engine


def engine_loop(model: bytes, prompts: np.ndarray, num_steps: int, page_size: int):
    """Steady-state ``OrtDecoder.step()``: a generator like :func:`plain_loop`."""
    b, n = prompts.shape
    num_pages = b * (-(-(n + num_steps + 2) // page_size)) + 8
    dec = OrtDecoder(model, num_pages=num_pages, page_size=page_size, max_batch_size=b,
                     session_options=_options())
    dec.generate([prompts[0, :page_size + 1]], max_new_tokens=3)   # compile kernels
    dec.generate([prompts[0, :2]] * 2, max_new_tokens=3)
    for p in prompts:
        dec.add_request(p, max_new_tokens=num_steps + 2)
    dec.step()                        # prefills
    dec.step()                        # the batch forms: one gather
    regathers = dec.stats["num_regathers"]
    clock = _ModelClock(dec.session)
    times = []
    for _ in range(num_steps):
        yield
        t0 = _clock()
        dec.step()
        times.append(_since(t0))
    assert dec.stats["num_regathers"] == regathers   # steady state: no gather while timing
    yield
    return times, (sum(t[1] for t in times) - clock.seconds) / num_steps


def _interleaved(*loops):
    """Run generator loops a step each in turn; returns their results. Both
    sides then run under the same load, whatever the machine does meanwhile."""
    for loop in loops:
        next(loop)                    # set up
    results = [None] * len(loops)
    while any(r is None for r in results):
        for i, loop in enumerate(loops):
            if results[i] is None:
                try:
                    next(loop)
                except StopIteration as stop:
                    results[i] = stop.value
    return results


def bench_steps(family: str, args) -> None:
    model, config = _model(family, args)
    rng = np.random.default_rng(0)
    print(f"\n[{family}] decode step, context {args.context} tokens, {args.steps} steps x "
          f"{args.repeats}, steps of both sides interleaved (median ms)")
    print(f"{'batch':>6}{'plain ORT':>11}{'OrtDecoder':>11}{'overhead':>10}"
          f"{'CPU plain':>11}{'CPU engine':>11}{'overhead':>10}{'extra CPU':>11}")
    for b in (1, 8):
        prompts = rng.integers(0, config.vocab_size, (b, args.context))
        plain, eng, extra = [], [], []
        for _ in range(args.repeats):
            (ptimes, plain_outside), (etimes, engine_outside) = _interleaved(
                plain_loop(model, family, config, prompts, args.steps),
                engine_loop(model, prompts, args.steps, args.page_size))
            plain += ptimes
            eng += etimes
            extra.append(engine_outside - plain_outside)
        pw, ew = (statistics.median(t[0] for t in x) for x in (plain, eng))
        pc, ec = (statistics.median(t[1] for t in x) for x in (plain, eng))
        ex = statistics.median(extra)
        print(f"{b:>6}{1e3 * pw:>11.3f}{1e3 * ew:>11.3f}{(ew / pw - 1):>10.1%}"
              f"{1e3 * pc:>11.3f}{1e3 * ec:>11.3f}{(ec / pc - 1):>10.1%}"
              f"{1e3 * ex:>7.3f} {ex / pc:>3.0%}")
    print("  extra CPU: CPU ms per step that OrtDecoder spends outside onnxruntime beyond "
          "what the plain loop spends there, and its share of the plain step")


def bench_ttft(family: str, args) -> None:
    model, config = _model(family, args)
    rng = np.random.default_rng(1)
    page, n = args.page_size, args.prompt
    cached = -(-int(0.9 * n) // page) * page   # full pages, at least 90%
    shared = rng.integers(0, config.vocab_size, cached).tolist()
    num_pages = 8 * (-(-(n + 8) // page))
    warm = OrtDecoder(model, num_pages=num_pages, page_size=page, max_batch_size=1,
                      session_options=_options())
    cold = OrtDecoder(model, num_pages=num_pages, page_size=page, max_batch_size=1,
                      enable_prefix_caching=False, session_options=_options())
    for dec in (warm, cold):
        dec.generate([rng.integers(0, config.vocab_size, 40).tolist()], max_new_tokens=2)
    warm.generate([shared + [1]], max_new_tokens=1)   # the shared part is now cached

    def ttft(dec: OrtDecoder, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        rid = dec.add_request(prompt, max_new_tokens=1)
        while not dec.get_output(rid):
            dec.step()
        elapsed = time.perf_counter() - t0
        dec.pop_output(rid)
        return elapsed

    hot, plain = [], []
    for _ in range(args.repeats * 3):
        prompt = shared + rng.integers(0, config.vocab_size, n - cached).tolist()
        hits = warm.stats["prefix_hit_tokens"]
        hot.append(ttft(warm, prompt))
        assert warm.stats["prefix_hit_tokens"] - hits == cached
        plain.append(ttft(cold, prompt))
    h, p = statistics.median(hot), statistics.median(plain)
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
    global _THREADS
    _THREADS = args.threads
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
