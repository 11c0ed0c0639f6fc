"""The engine's own decode step (pagedkv_np.onnxruntime.native) against the
NumPy forward pass of the same weights, alone and in batches, and through
OrtDecoder against full recompute and the graph's own decode steps."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import onnx
import pytest

from pagedkv_np.errors import ConfigError, DTypeError, UnsupportedModelError
from pagedkv_np.models.geometry import (GEOMETRY_KEY, geometry_from_json, geometry_json,
                                        weight_names, weight_shapes)
from pagedkv_np.models.graph import BlockQuantized, DecoderGeometry, build_decoder
from pagedkv_np.models.reference import reference_logits
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.onnxruntime.native import NativeDecode

_QTYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
           "q8_0": gguf.GGMLQuantizationType.Q8_0}

LLAMA = DecoderGeometry(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, intermediate_size=96, max_positions=128)
# every option of the block: bias, per-head norms, post-norms, GeGLU, scaled
# embedding, query scale, sliding layers with tables of their own, soft-cap
GEOMETRIES = {
    "llama": LLAMA,
    "qwen2": dataclasses.replace(LLAMA, qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dataclasses.replace(LLAMA, qk_norm=True, head_dim=32),
    "gemma3": dataclasses.replace(LLAMA, num_layers=3, qk_norm=True, post_norms=True,
                                  activation="gelu_tanh", embed_scale=8.0, attn_scale=0.2,
                                  sliding_window=5, global_layers=(2,),
                                  rope_local_theta=10.0, rope_scale=2.0, final_softcap=7.0,
                                  tie_word_embeddings=True),
}


def _weights(c: DecoderGeometry, kind: str | None, seed: int = 0) -> dict:
    """Random weights; matrices (the embedding too) as ``kind`` blocks."""
    rng = np.random.default_rng(seed)
    shapes = weight_shapes(c)
    out: dict = {}
    for name in weight_names(c):
        shape = shapes[name]
        if len(shape) == 1:
            value = (1.0 if "norm" in name else 0.0) + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (1.5 / np.sqrt(shape[0]))
            if name in ("embed", "lm_head"):
                value = value * 4
        value = value.astype(np.float32)
        if kind is not None and len(shape) == 2:
            # the embedding's blocks are rows of tokens; the others' rows of outputs
            rows = value if name == "embed" else np.ascontiguousarray(value.T)
            out[name] = BlockQuantized(kind, gguf.quants.quantize(rows, _QTYPES[kind]))
        else:
            out[name] = value
    return out


def _reference(c: DecoderGeometry, weights: dict, tokens: list[int]) -> np.ndarray:
    """The NumPy forward pass (an embedding in blocks given as its float rows)."""
    embed = weights["embed"]
    if isinstance(embed, BlockQuantized):
        weights = {**weights, "embed": np.ascontiguousarray(embed.dequantize().T)}
    return reference_logits(c, weights, tokens)


def _decode_all(native: NativeDecode, c: DecoderGeometry, tokens: list[int]) -> np.ndarray:
    """Logits of every position, one decode step per token from an empty past."""
    shape = (1, c.num_kv_heads, len(tokens), c.head_dim)
    kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
          for _ in range(c.num_layers)]
    return np.concatenate([native(np.array([t]), np.array([p]), kv)
                           for p, t in enumerate(tokens)])


@pytest.mark.parametrize("kind", [None, "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("arch", sorted(GEOMETRIES))
def test_decode_steps_match_the_numpy_forward(arch, kind):
    c = GEOMETRIES[arch]
    weights = _weights(c, kind)
    tokens = np.random.default_rng(1).integers(0, c.vocab_size, 14).tolist()
    native = NativeDecode(build_decoder(c, weights, family="gqa"), c)
    got = _decode_all(native, c, tokens)
    want = _reference(c, weights, tokens)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_rows_logits_do_not_depend_on_its_batch(arch):
    c = GEOMETRIES[arch]
    native = NativeDecode(build_decoder(c, _weights(c, "q4_1"), family="gqa"), c)
    rng = np.random.default_rng(2)
    cap = 12
    # three sequences of different lengths, their pasts filled by decode steps
    lens = np.array([3, 9, 6])
    kv = [(np.zeros((3, c.num_kv_heads, cap, c.head_dim), np.float32),
           np.zeros((3, c.num_kv_heads, cap, c.head_dim), np.float32))
          for _ in range(c.num_layers)]
    for p in range(int(lens.max())):
        rows = np.flatnonzero(lens > p)
        sub = [(k[rows], v[rows]) for k, v in kv]
        native(rng.integers(0, c.vocab_size, rows.size), np.full(rows.size, p), sub)
        for (k, v), (sk, sv) in zip(kv, sub):
            k[rows], v[rows] = sk, sv
    tokens = rng.integers(0, c.vocab_size, 3)
    alone = []
    for b in range(3):
        sub = [(k[b:b + 1].copy(), v[b:b + 1].copy()) for k, v in kv]
        alone.append(native(tokens[b:b + 1], lens[b:b + 1], sub)[0])
    batch = native(tokens, lens, [(k.copy(), v.copy()) for k, v in kv])
    np.testing.assert_array_equal(batch, np.stack(alone))


def _greedy(decoder: OrtDecoder, prompts: list[list[int]], n: int) -> list[list[int]]:
    return decoder.generate(prompts, max_new_tokens=n)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_greedy_matches_full_recompute(arch):
    c = GEOMETRIES[arch]
    weights = _weights(c, "q4_1", seed=3)
    model = build_decoder(c, weights, family="gqa")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (3, 11, 7)]
    native = OrtDecoder(model, eos_token_id=[], native_decode=True, page_size=4)
    graph = OrtDecoder(model, eos_token_id=[], native_decode=False, page_size=4)
    got = _greedy(native, prompts, 16)
    assert got == _greedy(graph, prompts, 16)
    for prompt, out in zip(prompts, got):      # each token the argmax of a full recompute
        want = _reference(c, weights, prompt + out)[len(prompt) - 1:-1].argmax(-1)
        assert out == want.tolist()
    # alone, and again from the prefix cache: the same tokens
    assert [_greedy(native, [p], 16)[0] for p in prompts] == got
    assert native.stats["prefix_hit_tokens"] > 0


def test_native_decode_is_default_where_it_runs_int8_activations():
    c = GEOMETRIES["llama"]
    model = build_decoder(c, _weights(c, "q4_1"), family="gqa")
    assert OrtDecoder(model).native is None                    # float32: the graph's
    decoder = OrtDecoder(model, int8_activations=True)
    assert isinstance(decoder.native, NativeDecode) and decoder.native.int8
    assert decoder._batcher.runner.step is decoder.native      # the runner's decode steps
    forced = OrtDecoder(model, native_decode=True)
    assert isinstance(forced.native, NativeDecode) and not forced.native.int8
    assert OrtDecoder(model, native_decode=False).native is None


def test_native_decode_refuses_what_it_cannot_run():
    c = GEOMETRIES["llama"]
    weights = _weights(c, None)
    optimum = build_decoder(c, weights, family="optimum")
    with pytest.raises(ConfigError, match="gqa"):
        OrtDecoder(optimum, native_decode=True)
    assert OrtDecoder(optimum).io.family == "optimum"        # auto: the graph's decode
    bare = build_decoder(c, weights, family="gqa")
    del bare.metadata_props[:]
    with pytest.raises(ConfigError, match="geometry"):
        OrtDecoder(bare, native_decode=True)
    assert OrtDecoder(bare).native is None
    with pytest.raises(DTypeError):
        OrtDecoder(build_decoder(c, weights, family="gqa"), native_decode="yes")


def test_a_step_past_the_buffers_is_refused_and_writes_nothing():
    c = GEOMETRIES["llama"]
    native = NativeDecode(build_decoder(c, _weights(c, None), family="gqa"), c)
    kv = [(np.zeros((1, c.num_kv_heads, 4, c.head_dim), np.float32),
           np.zeros((1, c.num_kv_heads, 4, c.head_dim), np.float32))
          for _ in range(c.num_layers)]
    for positions, tokens in (([4], [1]), ([-1], [1]), ([0], [c.vocab_size]), ([0], [-2])):
        with pytest.raises(ConfigError):
            native(np.array(tokens), np.array(positions), kv)
    assert all(not k.any() and not v.any() for k, v in kv)


def test_geometry_travels_in_the_metadata():
    c = GEOMETRIES["gemma3"]
    model = build_decoder(c, _weights(c, None), family="gqa")
    props = {p.key: p.value for p in model.metadata_props}
    assert geometry_from_json(props[GEOMETRY_KEY]) == c
    assert geometry_from_json(geometry_json(LLAMA)) == LLAMA
    for bad in ("{", "[]", '{"vocab_size": 0}', '{"colour": 1}', '{"num_heads": "x"}'):
        with pytest.raises(ConfigError):
            geometry_from_json(bad)
    # a wrong geometry in the metadata is refused when the engine loads it
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    for p in wrong.metadata_props:
        if p.key == GEOMETRY_KEY:
            p.value = geometry_json(dataclasses.replace(c, num_layers=4))
    with pytest.raises(UnsupportedModelError, match="GroupQueryAttention"):
        OrtDecoder(wrong, native_decode=True)


def _stepped(decoder: OrtDecoder, prompt: list[int], n: int) -> list[int]:
    """One request's tokens as a stream: each step's new tokens, as they come."""
    rid = decoder.add_request(prompt, max_new_tokens=n)
    out: list[int] = []
    for _ in range(4 * n + 8):
        if decoder.is_finished(rid):
            break
        out += decoder.step().get(rid, [])
    assert decoder.pop_output(rid) == out
    return out


def test_int8_activations_are_deterministic():
    c = GEOMETRIES["gemma3"]
    weights = _weights(c, "q4_1", seed=5)
    model = build_decoder(c, weights, family="gqa")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (5, 12, 9, 3)]
    fresh = OrtDecoder(model, eos_token_id=[], int8_activations=True, page_size=4,
                       enable_prefix_caching=False)
    assert all(lin.int8 for layer in fresh.native.layers
               for lin in layer.qkv + layer.gate_up + [layer.wo, layer.down])
    alone = [fresh.generate([p], max_new_tokens=14)[0] for p in prompts]
    assert fresh.generate(prompts, max_new_tokens=14) == alone          # in a batch
    cached = OrtDecoder(model, eos_token_id=[], int8_activations=True, page_size=4)
    cached.generate(prompts, max_new_tokens=14)
    assert [cached.generate([p], max_new_tokens=14)[0] for p in prompts] == alone
    assert cached.stats["prefix_hit_tokens"] > 0
    assert [_stepped(cached, p, 14) for p in prompts] == alone          # streamed
    # close to the exact numbers: most tokens are the full recompute's argmax
    agree = total = 0
    for prompt, out in zip(prompts, alone):
        want = _reference(c, weights, prompt + out)[len(prompt) - 1:-1].argmax(-1)
        agree += int((want == np.array(out)).sum())
        total += len(out)
    assert agree >= 0.8 * total


def test_int8_activations_need_the_native_decode():
    c = GEOMETRIES["llama"]
    weights = _weights(c, "q4_0")
    with pytest.raises(ConfigError, match="int8"):
        OrtDecoder(build_decoder(c, weights, family="gqa"), native_decode=False,
                   int8_activations=True)
    with pytest.raises(ConfigError, match="int8"):
        OrtDecoder(build_decoder(c, weights, family="optimum"), int8_activations=True)
    with pytest.raises(DTypeError):
        OrtDecoder(build_decoder(c, weights, family="gqa"), int8_activations=1)


def test_int8_activations_follow_the_graphs_accuracy_level():
    c = GEOMETRIES["llama"]
    weights = _weights(c, "q4_0")
    level4 = build_decoder(c, weights, family="gqa", accuracy_level=4)
    assert OrtDecoder(level4).native.int8
    assert OrtDecoder(level4, int8_activations=False).native is None
    assert not OrtDecoder(level4, int8_activations=False, native_decode=True).native.int8
    assert OrtDecoder(build_decoder(c, weights, family="gqa")).native is None
    assert OrtDecoder(level4, native_decode=False).native is None


def test_a_tied_engine_head_shares_its_blocks_with_the_embedding():
    from pagedkv_np.backends.block_gemv import BlockWeight

    c = GEOMETRIES["qwen2"]                  # tied
    weights = _weights(c, "q8_0")
    native = NativeDecode(build_decoder(c, weights, family="gqa"), c, with_head=False)
    own = native.embed
    other = BlockWeight(own.bits, own.block_size, own.in_features, own.out_features,
                        own.codes.copy(), own.zeros.copy(), own.scales.copy(), None)
    other.scales[3, 0] += 1                  # not the same values: kept apart
    assert not native.share_embedding(other) and native.embed is own
    same = BlockWeight(own.bits, own.block_size, own.in_features, own.out_features,
                       own.codes.copy(), own.zeros.copy(), own.scales.copy(),
                       None if own.offsets is None else own.offsets.copy())
    tokens = [5, 9, 1]
    before = _decode_all(native, c, tokens)
    assert native.share_embedding(same) and native.embed is same
    np.testing.assert_array_equal(_decode_all(native, c, tokens), before)


@pytest.mark.parametrize("shape", [(3, 6, 2), (1, 4, 1), (2, 6, 1)], ids=str)
@pytest.mark.parametrize("window", [0, 7, 300])
def test_attention_parallel_and_serial_agree_with_numpy(window, shape):
    """(batch, query heads, K/V heads): one K/V head alone (Gemma 3 at batch
    1) runs serially, two or more in parallel."""
    from pagedkv_np.backends import decode_ops as ops

    rng = np.random.default_rng(7)
    (b, heads, kv_heads), d, cap = shape, 32, 700
    k = rng.standard_normal((b, kv_heads, cap, d)).astype(np.float32)
    v = rng.standard_normal((b, kv_heads, cap, d)).astype(np.float32)
    q = (3 * rng.standard_normal((b, heads * d))).astype(np.float32)
    positions = np.array([650, 0, 299])[:b]
    got = np.empty_like(q)
    ops.attend(q, heads, kv_heads, d, k, v, positions, window, np.float32(0.2), got)
    serial = np.empty_like(q)
    ops.attend_serial(q, heads, kv_heads, d, k, v, positions, window, np.float32(0.2), serial)
    np.testing.assert_array_equal(got, serial)
    for row, last in enumerate(positions):
        first = max(0, last - window + 1) if window else 0
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = k[row, g, first:last + 1].astype(np.float64) @ q[row, h * d:(h + 1) * d] * 0.2
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ v[row, g, first:last + 1]
            np.testing.assert_allclose(got[row, h * d:(h + 1) * d], want, rtol=0, atol=2e-6)


def test_float_steps_leave_large_batches_to_the_graph_int8_ones_take_them():
    from pagedkv_np.onnxruntime.native import FLOAT_MAX_ROWS

    c = GEOMETRIES["llama"]
    weights = _weights(c, "q4_1", seed=8)
    model = build_decoder(c, weights, family="gqa")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, c.vocab_size, 4 + n).tolist() for n in range(FLOAT_MAX_ROWS + 2)]
    for int8 in (False, True):
        decoder = OrtDecoder(model, eos_token_id=[], int8_activations=int8, page_size=4,
                             max_batch_size=len(prompts), native_decode=True)
        batch = decoder.generate(prompts, max_new_tokens=6)
        assert (decoder.native.steps > 0) == int8      # a batch of 6: the graph's, in float32
        alone = [decoder.generate([p], max_new_tokens=6)[0] for p in prompts]
        assert decoder.native.steps > 0                 # one at a time: the engine's own
        if int8:
            assert batch == alone
        else:                                           # both exact: the recompute's argmax
            for prompt, out in zip(prompts, batch):
                want = _reference(c, weights, prompt + out)[len(prompt) - 1:-1].argmax(-1)
                assert out == want.tolist()


@pytest.mark.parametrize("int8", [False, True])
def test_a_linear_matches_the_checked_product_and_refuses_wrong_buffers(int8):
    import numba

    from pagedkv_np.backends.block_gemv import block_matmul
    from pagedkv_np.backends.block_q8_tiles import q8_tiled_matmul
    from pagedkv_np.errors import ShapeError
    from pagedkv_np.onnxruntime.native import NativeLinear

    c = GEOMETRIES["llama"]
    native = NativeDecode(build_decoder(c, _weights(c, "q4_1"), family="gqa"), c)
    weight = native.layers[0].down.weight
    linear = NativeLinear(weight, int8)
    x = np.random.default_rng(3).standard_normal((3, linear.in_features)).astype(np.float32)
    want = (q8_tiled_matmul if int8 else block_matmul)(x, weight)   # 4 bits, block 32: tiles
    for threads in range(1, numba.get_num_threads() + 1):   # same bits for any count
        out = np.full((3, linear.out_features), np.nan, np.float32)
        np.testing.assert_array_equal(linear(x, out, threads), want)
    out = np.zeros((3, linear.out_features), np.float32)
    for bad_x, bad_out, error in [(x[:, :-1], out, ShapeError), (x, out[:, :-1], ShapeError),
                                  (x.astype(np.float64), out, DTypeError),
                                  (np.asfortranarray(x), out, ShapeError),
                                  (x, out[:2], ShapeError)]:
        with pytest.raises(error):
            linear(bad_x, bad_out, 1)
        assert not out.any()                  # nothing written


_ATTEND_SCRIPT = """
import sys
import numpy as np
from pagedkv_np.backends import decode_ops as ops
rng = np.random.default_rng(7)
b, heads, kv_heads, d, cap = 3, 6, 2, 32, 700
k = rng.standard_normal((b, kv_heads, cap, d)).astype(np.float32)
v = rng.standard_normal((b, kv_heads, cap, d)).astype(np.float32)
q = (3 * rng.standard_normal((b, heads * d))).astype(np.float32)
positions = np.array([0, 650, 299])
out = np.empty_like(q)
for step in sys.argv[2].split(","):
    if step == "parts":      # the callees alone, into the disk cache
        ops._exp_shifted(q[0].copy(), 5, np.float32(9.0), np.empty(5, np.int32))
        ops._attend_part(1, 0, 1, q, heads, kv_heads, d, k, v, positions, 0, np.float32(0.2),
                         np.empty(3, np.float32), np.empty(3, np.float32),
                         np.empty((3, d), np.float32))
    else:
        kernel = ops.attend if step == "parallel" else ops.attend_serial
        kernel(q, heads, kv_heads, d, k, v, positions, 0, np.float32(0.2), out)
        np.save(sys.argv[1] + step + ".npy", out)
"""


def test_attention_bits_do_not_depend_on_which_process_compiled_what(tmp_path):
    """Parallel and serial attention give the same bits whether their callees
    were compiled in the same process or loaded from a disk cache that
    another process wrote (two test workers share one cache)."""
    import os
    import subprocess
    import sys

    def run(cache, prefix, steps):
        env = dict(os.environ, PAGEDKV_NUMBA_CACHE_DIR=str(tmp_path / cache))
        proc = subprocess.run([sys.executable, "-c", _ATTEND_SCRIPT, str(tmp_path / prefix),
                               steps], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr

    run("fresh", "fresh_", "parallel,serial")
    run("shared", "x", "parts")
    run("shared", "shared_", "serial")
    run("shared", "shared_", "parallel")
    want = np.load(tmp_path / "fresh_parallel.npy")
    for name in ("fresh_serial", "shared_serial", "shared_parallel"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), want, err_msg=name)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_warmup_compiles_what_a_batch_of_two_decodes_with(name):
    """A batch's packed products leave strided parts (other kernel types than
    one row's), and a tied head's embedding rows other arrays than the step's
    own copy: warm-up compiles those, so no step of a server waits for Numba
    (its first batch of several had stalled every stream for 5 s)."""
    from pagedkv_np.backends import decode_ops as ops

    c = GEOMETRIES[name]
    model = build_decoder(c, _weights(c, "q4_1", seed=4), family="gqa")
    decoder = OrtDecoder(model, eos_token_id=[], int8_activations=True, page_size=4,
                         max_batch_size=2, native_decode=True)
    kernels = {k: v for k, v in vars(ops).items() if hasattr(v, "signatures")}
    before = {k: list(v.signatures) for k, v in kernels.items()}
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, c.vocab_size, 7 + n).tolist() for n in range(2)]
    batch = decoder.generate(prompts, max_new_tokens=5)
    assert decoder.native.steps > 0
    assert {k: list(v.signatures) for k, v in kernels.items()} == before
    assert batch == [decoder.generate([p], max_new_tokens=5)[0] for p in prompts]
