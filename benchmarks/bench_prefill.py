"""A long prompt's prefill: its time and its peak memory, beside a plain
onnxruntime loop.

The generated decoder of :mod:`.bench_native` (SmolLM2-135M's shape, Q4_0
blocks, vocabulary 8192). One prompt of ``tokens`` tokens (2,048 and 4,096;
128 in a smoke run, :func:`~benchmarks.quick`) that the cache has not seen
(each call's first token is new, so the prefix index misses), two ways:

* ``engine``: ``OrtDecoder.generate([prompt], max_new_tokens=1)`` on 2
  threads: the prompt in the engine's chunks, its K/V written into the
  pages, its first token;
* ``plain``: one ``session.run`` of the whole prompt from an empty past,
  only the last position's logits (``num_logits_to_keep`` 1), its
  ``present`` K/V returned, as a plain onnxruntime loop prefills.

``time_*`` time one call; ``track_speedup`` is the plain call's time over
the engine's, medians of calls taken in turn in one process. The
``track_*_peak_mib`` figures are what one call adds to the process's peak
resident memory: the high-water mark is reset (``/proc/self/clear_refs``)
right before the call and read right after it, less the resident memory
before it. The engine's is measured on its first long prompt, so its pages
are touched for the first time as a server's are. Skipped where the kernel
cannot reset the mark, or without gguf, onnx and onnxruntime.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import numpy as np

from . import quick
from .bench_native import PAGE, THREADS, VOCAB
from .bench_native import setup_cache as native_setup_cache

TOKENS = [128] if quick() else [2048, 4096]
_STATUS = Path("/proc/self/status")


def setup_cache():
    """The serialized decoder (:func:`benchmarks.bench_native.setup_cache`)."""
    return native_setup_cache()


def _skip_without(model) -> None:
    if isinstance(model, dict):
        raise NotImplementedError(model["skip"])


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    if match is None:
        raise NotImplementedError(f"no {field} in {_STATUS}")
    return int(match.group(1))


def peak_growth_mib(fn) -> float:
    """MiB by which ``fn()`` raises the process's peak resident memory above
    its resident memory before the call."""
    try:
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    except OSError as exc:
        raise NotImplementedError(f"cannot reset the peak resident memory: {exc}") from None
    before = _kib("VmRSS")
    fn()
    return (_kib("VmHWM") - before) / 1024


class _Prefill:
    """An engine and a plain session of the same model, and fresh prompts."""

    params = [TOKENS]
    param_names = ["tokens"]
    timeout = 600
    number = 1
    repeat = (1, 5, 60.0)

    def setup(self, model, tokens):
        _skip_without(model)
        import onnxruntime as ort

        from pagedkv_np.onnxruntime import OrtDecoder

        self.rng = np.random.default_rng(tokens)
        self.engine = OrtDecoder(model, eos_token_id=[], threads=THREADS, page_size=PAGE,
                                 num_pages=2 * (tokens // PAGE) + 64)
        options = ort.SessionOptions()
        options.intra_op_num_threads = THREADS
        self.session = ort.InferenceSession(model, options,
                                            providers=["CPUExecutionProvider"])
        inputs = {arg.name: arg for arg in self.session.get_inputs()}
        self.past = [name for name in inputs if name.startswith("past_key_values.")]
        shape = inputs[self.past[0]].shape
        self.empty = np.zeros((1, shape[1], 0, shape[3]), np.float32)
        # kernels compiled (or loaded), the page store's first pages touched
        self.engine.generate([self.prompt(2 * PAGE)], max_new_tokens=2)
        self.plain(self.prompt(2 * PAGE))

    def prompt(self, n: int) -> list[int]:
        """``n`` tokens no earlier prompt starts with."""
        return self.rng.integers(0, VOCAB, n).tolist()

    def engine_prefill(self, prompt: list[int]) -> None:
        out = self.engine.generate([prompt], max_new_tokens=1)
        if len(out[0]) != 1:
            raise RuntimeError(f"expected one new token, got {out[0]!r}")

    def plain(self, prompt: list[int]) -> None:
        n = len(prompt)
        feeds = {"input_ids": np.array([prompt], np.int64),
                 "attention_mask": np.ones((1, n), np.int64),
                 "num_logits_to_keep": np.ones(1, np.int64)}
        feeds.update({name: self.empty for name in self.past})
        logits = self.session.run(["logits"], feeds)[0]
        if logits.shape[1] != 1:
            raise RuntimeError(f"expected the last position's logits, got {logits.shape}")


class Prefill(_Prefill):
    def time_engine_prefill(self, model, tokens):
        self.engine_prefill(self.prompt(tokens))

    def time_plain_prefill(self, model, tokens):
        self.plain(self.prompt(tokens))


class Speedup(_Prefill):
    rounds = 1 if quick() else 3

    def track_speedup(self, model, tokens):
        engine, plain = [], []
        for _ in range(self.rounds):
            for fn, times in ((self.engine_prefill, engine), (self.plain, plain)):
                prompt = self.prompt(tokens)
                start = time.perf_counter()
                fn(prompt)
                times.append(time.perf_counter() - start)
        return statistics.median(plain) / statistics.median(engine)

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class PeakMemory(_Prefill):
    def track_engine_peak_mib(self, model, tokens):
        prompt = self.prompt(tokens)
        return peak_growth_mib(lambda: self.engine_prefill(prompt))

    track_engine_peak_mib.unit = "MiB"  # type: ignore[attr-defined]

    def track_plain_peak_mib(self, model, tokens):
        prompt = self.prompt(tokens)
        return peak_growth_mib(lambda: self.plain(prompt))

    track_plain_peak_mib.unit = "MiB"  # type: ignore[attr-defined]
