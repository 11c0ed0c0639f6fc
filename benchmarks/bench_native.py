"""The engine's own decode step (``OrtDecoder.native``) against the graph's.

A generated decoder of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads
of 64, 3 KV heads, intermediate 1536, tied embeddings; vocab 8192, not
49152, so that the weights quantize in seconds), its matrices in Q4_0
blocks, random. One steady-state ``OrtDecoder.step()`` of a batch
decoding, ``depth`` tokens of context already cached before the timed
steps, in three engines built alike but for their decode step:

* ``native_decode=False``: onnxruntime runs the graph (``time_graph_step``);
* ``native_decode=True``: the engine's own Numba step, float32 activations
  (``time_native_step``);
* ``int8_activations=True``: the same, activations rounded to int8 per
  block (``time_native_int8_step``).

``track_speedup`` and ``track_speedup_int8`` are the graph's step time over
the native one's, medians of steps taken in turn in one process.

The model is quantized and serialized once per asv run by
:func:`setup_cache` (10-20 s); each benchmark process builds only the
engines its class needs and prefills the shared context once (its
requests find it in the prefix cache), tens of seconds at depth 2048 on a
2-core machine. In a smoke run (:func:`~benchmarks.quick`) the depths are
0 and 128. Skipped when gguf, onnxruntime or onnx is not installed.
"""

from __future__ import annotations

import statistics

import numpy as np

from . import memo, quick
from .bench_onnxruntime import interleaved_step_times

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 8192, 576, 30, 9, 3, 64, 1536
PAGE, THREADS = 16, 2
BATCHES = [1, 8]
DEPTHS = [0, 128] if quick() else [0, 2048]
_STEPS = 400   # the most steps one process takes; each adds a token

# engine keyword arguments by name
ENGINES = {
    "graph": {"native_decode": False},
    "native": {"native_decode": True},
    "native_int8": {"int8_activations": True},
}


def model_bytes() -> bytes:
    """The serialized decoder; ``NotImplementedError`` without gguf or onnx."""
    try:
        import gguf
        from pagedkv_np.models.geometry import weight_names, weight_shapes
        from pagedkv_np.models.graph import BlockQuantized, DecoderGeometry, build_decoder
    except ImportError as exc:
        raise NotImplementedError(f"needs gguf and onnx: {exc}") from None
    geometry = DecoderGeometry(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                               num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               intermediate_size=INTERMEDIATE, rope_theta=100000.0,
                               max_positions=8192, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    shapes = weight_shapes(geometry)
    weights = {}
    for name in weight_names(geometry):
        shape = shapes[name]
        if len(shape) == 1:
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        value = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.5 / np.sqrt(shape[0]))
        # the embedding's blocks are rows of tokens; the others' rows of outputs
        rows = value if name == "embed" else np.ascontiguousarray(value.T)
        weights[name] = BlockQuantized(
            "q4_0", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_0))
    return build_decoder(geometry, weights, family="gqa").SerializeToString()


def setup_cache():
    """The serialized model for every benchmark of this module (asv passes
    it as the first argument), or ``{"skip": reason}``: a failing
    setup_cache would count as failed benchmarks, not skipped ones."""
    try:
        import onnxruntime  # noqa: F401
        return model_bytes()
    except (ImportError, NotImplementedError) as exc:
        return {"skip": f"needs onnxruntime, onnx and gguf: {exc}"}


def steady_engine(model: bytes, kind: str, batch: int, depth: int):
    """An OrtDecoder decoding ``batch`` requests as one batch, each a shared
    ``depth``-token context (in the prefix cache before they arrive) plus two
    tokens of its own: every later ``step()`` is a plain decode step, for up
    to ``_STEPS`` steps."""
    from pagedkv_np.onnxruntime import OrtDecoder

    pages_per_request = -(-(_STEPS + 2 * PAGE) // PAGE)
    dec = OrtDecoder(model, eos_token_id=[], threads=THREADS, max_batch_size=batch,
                     page_size=PAGE, num_pages=depth // PAGE + batch * pages_per_request + 8,
                     **ENGINES[kind])
    if (dec.native is None) != (kind == "graph"):
        raise RuntimeError(f"{kind}: the engine's decode step is {dec.native!r}")
    shared = np.random.default_rng(1).integers(0, VOCAB, depth).tolist()
    if depth:
        dec.generate([shared + [batch]], max_new_tokens=1)       # the context, cached
    hits = dec.stats["prefix_hit_tokens"]
    # two tokens of its own: int8 steps leave two prompt tokens to compute
    ids = [dec.add_request(shared + [i, i], max_new_tokens=_STEPS) for i in range(batch)]
    while not all(dec.get_output(rid) for rid in ids):           # the prefills
        dec.step()
    if dec.stats["prefix_hit_tokens"] - hits < batch * (depth // PAGE * PAGE):
        raise RuntimeError("the shared context was not found in the prefix cache")
    # the engine's first two decode steps try both of its Numba thread counts
    # (compiling any kernel of either not yet in Numba's cache): steady from here
    dec.step()
    dec.step()
    return dec


class _Steps:
    """Engines of ``kinds`` (keys of :data:`ENGINES`), built once per process."""

    params = [BATCHES, DEPTHS]
    param_names = ["batch", "depth"]
    timeout = 600
    kinds: tuple[str, ...] = ()

    def setup(self, model, batch, depth):
        if isinstance(model, dict):
            raise NotImplementedError(model["skip"])
        self.engines = memo(
            (type(self).__name__, batch, depth),
            lambda: {kind: steady_engine(model, kind, batch, depth) for kind in self.kinds})
        # asv times a benchmark in a process of its own, a few dozen steps
        for dec in self.engines.values():
            if dec.stats["num_decode_steps"] > _STEPS - 60:
                raise RuntimeError("more steps than the requests hold")

    def speedup(self, kind: str) -> float:
        """Graph over ``kind`` step wall time, medians of 24 steps each, taken
        in turn (one each in a smoke run)."""
        graph, other = interleaved_step_times(
            [self.engines["graph"].step, self.engines[kind].step], 1 if quick() else 24)
        return statistics.median(w for w, _ in graph) / statistics.median(w for w, _ in other)


class GraphStep(_Steps):
    kinds = ("graph",)

    def time_graph_step(self, model, batch, depth):
        self.engines["graph"].step()


class NativeStep(_Steps):
    kinds = ("native",)

    def time_native_step(self, model, batch, depth):
        self.engines["native"].step()


class NativeInt8Step(_Steps):
    kinds = ("native_int8",)

    def time_native_int8_step(self, model, batch, depth):
        self.engines["native_int8"].step()


class Speedup(_Steps):
    kinds = ("graph", "native")

    def track_speedup(self, model, batch, depth):
        return self.speedup("native")

    track_speedup.unit = "x"


class SpeedupInt8(_Steps):
    kinds = ("graph", "native_int8")

    def track_speedup_int8(self, model, batch, depth):
        return self.speedup("native_int8")

    track_speedup_int8.unit = "x"


for _cls, _name in ((GraphStep, "time_graph_step"), (NativeStep, "time_native_step"),
                    (NativeInt8Step, "time_native_int8_step")):
    getattr(_cls, _name).number = 1
    getattr(_cls, _name).repeat = 5, 20, 10.0
