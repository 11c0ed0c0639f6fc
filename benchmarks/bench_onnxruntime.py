"""OrtDecoder against a plain onnxruntime loop, on a generated Llama-style decoder.

* :class:`DecodeStep`: the per-step cost of ``OrtDecoder.step()`` in steady
  state (the batch unchanged) and of the same model driven by onnxruntime
  with its own contiguous past/present loop, at batch 1 and 8;
  ``track_overhead`` is the engine's extra time per step in percent of the
  plain loop's, their steps interleaved in one process.
* :class:`TimeToFirstToken`: a 1024-token prompt whose first 90% is cached
  against the same prompt uncached; ``track_speedup`` is their ratio.

Sibling: ``scripts/bench_ort.py`` prints the same two figures in more
detail (the CPU-time split, other sizes and thread counts) on the workload
built here (:func:`model_bytes`, :class:`PlainLoop`, :func:`steady_engine`),
timed by ``pagedkv_np.bench.timing``; this suite keeps its own timing
(:func:`interleaved_step_times`). ``scripts/bench_peers.py`` compares with
onnxruntime-genai on a real model. Skipped when onnxruntime or onnx is not
installed.

Both families' models are built once per asv run, by the module's
:func:`setup_cache` (seconds each), and handed to every benchmark process:
asv times each benchmark and parameter combination in a fresh process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any
from collections.abc import Callable

import numpy as np

from . import memo, quick

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 4, 8, 2, 1024
CONTEXT, PROMPT, PAGE = 512, 1024, 16
FAMILIES = ["optimum", "gqa"]


def _onnx():
    try:
        import onnxruntime as ort
        from pagedkv_np.onnxruntime import OrtDecoder
        from pagedkv_np.models.testmodel import DecoderConfig, build_model
    except ImportError as exc:
        raise NotImplementedError(f"needs onnxruntime and onnx: {exc}") from None
    return ort, OrtDecoder, DecoderConfig, build_model


def model_bytes(family: str, hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS,
                kv_heads: int = KV_HEADS, vocab: int = VOCAB):
    """(serialized model, its DecoderConfig)."""
    _, _, DecoderConfig, build_model = _onnx()
    config = DecoderConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                           num_heads=heads, num_kv_heads=kv_heads)
    return build_model(config, family=family).SerializeToString(), config


def setup_cache():
    """``{family: (serialized model, DecoderConfig)}`` for every benchmark of
    this module (asv passes it as the first argument), or ``{"skip":
    reason}`` when onnxruntime or onnx is missing: a failing setup_cache
    would count as failed benchmarks, not skipped ones."""
    try:
        return {family: model_bytes(family) for family in FAMILIES}
    except NotImplementedError as exc:
        return {"skip": str(exc)}


def cached_model(models: dict, family: str):
    """``models[family]``; ``NotImplementedError`` (asv: skipped) when
    :func:`setup_cache` found no onnxruntime or onnx."""
    if "skip" in models:
        raise NotImplementedError(models["skip"])
    return models[family]


def session_options(threads: int = 1):
    """One intra-op thread by default: a shared machine's load distorts less."""
    ort = _onnx()[0]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return options


class ModelClock:
    """Adds up the CPU seconds spent inside a session's run methods."""

    def __init__(self, session: Any) -> None:
        self.seconds = 0.0
        for name in ("run", "run_with_iobinding"):
            setattr(session, name, self._timed(getattr(session, name)))

    def _timed(self, real: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.process_time()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.process_time() - t0
        return timed


class PlainLoop:
    """The model driven by onnxruntime alone: prefill a batch of equal-length
    prompts, then :meth:`step` decodes one token for each, greedy.

    optimum family: ``present`` fed back as ``past``. GroupQueryAttention:
    one shared past/present buffer per layer through IOBinding, as
    onnxruntime-genai does.
    """

    def __init__(self, model: bytes, family: str, config: Any, prompts: np.ndarray,
                 capacity: int, threads: int = 1) -> None:
        ort = _onnx()[0]
        self.session = sess = ort.InferenceSession(model, sess_options=session_options(threads),
                                                   providers=["CPUExecutionProvider"])
        b, n = prompts.shape
        h, d, layers = config.num_kv_heads, config.head_dim, config.num_layers
        self.family, self.b, self.n, self.step_index = family, b, n, 0
        self.pk = [f"past_key_values.{i}.key" for i in range(layers)]
        self.pv = [f"past_key_values.{i}.value" for i in range(layers)]
        self.outk = [f"present.{i}.key" for i in range(layers)]
        self.outv = [f"present.{i}.value" for i in range(layers)]
        self.outputs = ["logits"] + self.outk + self.outv
        feeds = {"input_ids": prompts, "attention_mask": np.ones((b, n), np.int64)}
        if family == "optimum":
            feeds["position_ids"] = np.broadcast_to(np.arange(n), (b, n)).copy()
        empty = np.zeros((b, h, 0, d), np.float32)
        feeds.update({name: empty for name in self.pk + self.pv})
        self.keep = {arg.name: np.zeros(1, np.int64) for arg in sess.get_inputs()
                     if arg.name == "num_logits_to_keep"}   # 0: every position
        feeds.update(self.keep)
        outs = sess.run(self.outputs, feeds)
        self.tokens = outs[0][:, -1].argmax(-1)
        if family == "optimum":
            self.past = outs[1:]
            self.mask = np.ones((b, n), np.int64)
            return
        self.binding = binding = sess.io_binding()
        self.bufs = []
        for i, (k, v) in enumerate(zip(outs[1:1 + layers], outs[1 + layers:])):
            for src, dst, arr in ((self.pk[i], self.outk[i], k), (self.pv[i], self.outv[i], v)):
                buf = np.zeros((b, h, capacity, d), np.float32)
                buf[:, :, :n] = arr
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                binding.bind_ortvalue_input(src, value)
                binding.bind_ortvalue_output(dst, value)
                self.bufs.append(buf)
        self.logits = np.empty((b, 1, config.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, self.logits.shape,
                            self.logits.ctypes.data)
        for name, value in self.keep.items():
            binding.bind_cpu_input(name, value)

    def step(self) -> None:
        b, n, step = self.b, self.n, self.step_index
        self.step_index += 1
        if self.family == "optimum":
            self.mask = np.concatenate([self.mask, np.ones((b, 1), np.int64)], axis=1)
            feeds = {"input_ids": self.tokens.reshape(b, 1).astype(np.int64),
                     "attention_mask": self.mask,
                     "position_ids": np.full((b, 1), n + step, np.int64)}
            feeds.update(zip(self.pk + self.pv, self.past))
            feeds.update(self.keep)
            outs = self.session.run(self.outputs, feeds)
            self.past = outs[1:]
            self.tokens = outs[0][:, -1].argmax(-1)
            return
        ids = self.tokens.reshape(b, 1).astype(np.int64)
        mask = np.ones((b, n + step + 1), np.int64)
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("attention_mask", mask)
        self.session.run_with_iobinding(self.binding)
        self.tokens = self.logits[:, -1].argmax(-1)


def steady_engine(model: bytes, prompts: np.ndarray, max_steps: int, page_size: int = PAGE,
                  threads: int = 1):
    """An OrtDecoder running ``prompts`` as one batch, past its prefills and
    its one gather: every later ``step()`` is a plain decode step, for up to
    ``max_steps`` steps."""
    OrtDecoder = _onnx()[1]
    b, n = prompts.shape
    num_pages = b * (-(-(n + max_steps + 2) // page_size)) + 8
    dec = OrtDecoder(model, num_pages=num_pages, page_size=page_size, max_batch_size=b,
                     session_options=session_options(threads))
    # compile (or load) the kernels the timed steps use: a batch's page writes
    dec.generate([prompts[0, :page_size + 1]] * 2, max_new_tokens=3)
    for p in prompts:
        dec.add_request(p, max_new_tokens=max_steps + 2)
    dec.step()                        # prefills
    dec.step()                        # the batch forms: one gather
    return dec


def interleaved_step_times(fns: list[Callable[[], None]], num_steps: int):
    """Wall and CPU seconds of each of ``num_steps`` calls of every function,
    the functions taking turns step by step so that all see the same load."""
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(num_steps):
        for i, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[i].append((time.perf_counter() - w0, time.process_time() - c0))
    return times


class DecodeStep:
    """A decode step of a batch with 512 tokens of context each."""

    params = [FAMILIES, [1, 8]]
    param_names = ["family", "batch"]
    timeout = 300
    _STEPS = 400   # the most steps one process times; each adds a token

    def setup(self, models, family, batch):
        def build():
            model, config = cached_model(models, family)
            prompts = np.random.default_rng(0).integers(0, VOCAB, (batch, CONTEXT))
            plain = PlainLoop(model, family, config, prompts, CONTEXT + self._STEPS + 1)
            return plain, steady_engine(model, prompts, self._STEPS)

        self.plain, self.engine = memo(("ort", family, batch), build)
        # asv times a benchmark in a process of its own, a few dozen steps
        assert self.plain.step_index < self._STEPS - 40, "more steps than the buffers hold"

    def time_plain_step(self, models, family, batch):
        self.plain.step()

    def time_engine_step(self, models, family, batch):
        self.engine.step()

    def track_overhead(self, models, family, batch):
        """Extra wall time of an engine step over a plain step, percent
        (medians of 24 steps each, interleaved; 2 in a smoke run)."""
        num_steps = 2 if quick() else 24
        plain, engine = interleaved_step_times([self.plain.step, self.engine.step], num_steps)
        p, e = (statistics.median(w for w, _ in t) for t in (plain, engine))
        return 100.0 * (e / p - 1.0)

    track_overhead.unit = "percent"


for _name in ("time_plain_step", "time_engine_step"):
    getattr(DecodeStep, _name).number = 1
    getattr(DecodeStep, _name).repeat = 5, 20, 10.0


def first_token_seconds(dec: Any, prompt: list[int]) -> float:
    """Seconds from adding a one-token request to its first token."""
    t0 = time.perf_counter()
    rid = dec.add_request(prompt, max_new_tokens=1)
    while not dec.get_output(rid):
        dec.step()
    elapsed = time.perf_counter() - t0
    dec.pop_output(rid)
    return elapsed


class TimeToFirstToken:
    """A 1024-token prompt, its first 90% (whole pages) cached or not."""

    params = [FAMILIES]
    param_names = ["family"]
    timeout = 300

    def setup(self, models, family):
        OrtDecoder = _onnx()[1]
        model, config = cached_model(models, family)
        rng = np.random.default_rng(1)
        self.cached = -(-int(0.9 * PROMPT) // PAGE) * PAGE
        self.shared = rng.integers(0, VOCAB, self.cached).tolist()
        num_pages = 8 * (-(-(PROMPT + 8) // PAGE))
        self.warm, self.cold = (
            OrtDecoder(model, num_pages=num_pages, page_size=PAGE, max_batch_size=1,
                       enable_prefix_caching=caching, session_options=session_options())
            for caching in (True, False))
        for dec in (self.warm, self.cold):
            dec.generate([rng.integers(0, VOCAB, 40).tolist()], max_new_tokens=2)
        self.warm.generate([self.shared + [1]], max_new_tokens=1)   # now cached
        self.rng = rng

    def _prompt(self) -> list[int]:
        return self.shared + self.rng.integers(0, VOCAB, PROMPT - self.cached).tolist()

    def track_speedup(self, models, family):
        """Uncached over cached time to first token (medians of 3; one in a
        smoke run)."""
        hot, cold = [], []
        for _ in range(1 if quick() else 3):
            prompt = self._prompt()
            hits = self.warm.stats["prefix_hit_tokens"]
            hot.append(first_token_seconds(self.warm, prompt))
            assert self.warm.stats["prefix_hit_tokens"] - hits == self.cached
            cold.append(first_token_seconds(self.cold, prompt))
        return statistics.median(cold) / statistics.median(hot)

    track_speedup.unit = "x"
