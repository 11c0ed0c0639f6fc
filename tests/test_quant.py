"""The int8 page format (pagedkv_np.quant) and int8 caches.

The format's reference is checked against its definition (round-trip bound,
the edges); every backend is compared with it bit for bit in
tests/test_backends.py. Here the cache is driven with an int8 store through
prefix reuse, partial-page copy-on-write, fork and both layouts: what a
sequence gathers must be exactly the round trip of what it would have
written itself, wherever its pages came from.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_np import KVStore, PagedKVCache, get_backend
from pagedkv_np.backends import _numba_quant as nq
from pagedkv_np.errors import DTypeError
from pagedkv_np.layout import resolve_dtype
from pagedkv_np.quant import (GROUP_SIZE, QMAX, SCALE_MAX, SCALE_MIN, dequantize, group_size,
                              quantize, resolve_quant)

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def bits(x):
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def grouped_scales(scales, head_dim):
    """Scales repeated over their group: [..., head_dim]."""
    return np.repeat(scales, group_size(head_dim), axis=-1)


# ------------------------------------------------------------------ format
def test_group_size_rule():
    assert GROUP_SIZE == 32
    assert [group_size(d) for d in (32, 64, 128, 256)] == [32, 32, 32, 32]
    assert [group_size(d) for d in (8, 48, 3, 1)] == [8, 48, 3, 1]


def test_constants_of_the_kernels_equal_the_format():
    assert bits(np.array([nq.SCALE_MAX], F32))[0] == bits(np.array([SCALE_MAX], F32))[0]
    assert nq.SCALE_MIN == SCALE_MIN == F32(2.0 ** -126)
    assert nq.QMAX == QMAX == 127
    assert np.isfinite(F32(127) * SCALE_MAX)
    with np.errstate(over="ignore"):
        assert not np.isfinite(F32(127) * np.nextafter(SCALE_MAX, F32(np.inf)))


def test_resolve_quant():
    assert resolve_quant("int8").code_dtype == np.int8
    assert resolve_quant("INT8") is resolve_quant(np.int8)
    assert resolve_quant("float32") is None and resolve_quant(np.float16) is None
    assert resolve_quant("int4") is None


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_round_trip_within_half_a_step(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((300, 4, head_dim)) * rng.uniform(1e-3, 1e3, (300, 4, 1)))
    x = x.astype(resolve_dtype(dtype))
    codes, scales = quantize(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert scales.shape == (300, 4, head_dim // group_size(head_dim))
    assert codes.min() >= -QMAX and codes.max() <= QMAX
    got = dequantize(codes, scales).astype(np.float64)
    step = grouped_scales(scales, head_dim).astype(np.float64)
    err = np.abs(got - x.astype(np.float64))
    # half a step, plus the roundings of x / scale and of code * scale
    assert (err <= step * (0.5 + 2.0 ** -15)).all()
    # each group's largest magnitude is a code of +-127 (the clipping bound)
    grouped = np.abs(codes.reshape(300, 4, -1, group_size(head_dim)).astype(np.int32))
    assert (grouped.max(axis=-1) == QMAX).all()


def test_round_half_to_even():
    x = np.array([[127, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 0]], F32)  # scale exactly 1
    codes, scales = quantize(x)
    assert scales.tolist() == [[1.0]]
    assert codes.tolist() == [[127, 2, 4, -2, 0, 0, 2, 0]]


def test_edges_zero_nan_inf_subnormal():
    x = np.zeros((6, 8), F32)
    x[1] = [np.nan, 1, -2, 0, 0, 0, 0, 4]        # NaN counts as 0
    x[2] = [np.inf, -np.inf, 1, 0, 0, 0, 0, 127]  # infinities saturate
    x[3] = [1e-40, -1e-41, 0, 0, 0, 0, 0, 127]    # subnormals count as 0
    x[4] = [np.inf, np.nan, 0, 0, 0, 0, 0, 0]     # no finite value: all zero
    x[5] = [FLT_MAX, -FLT_MAX, 1e30, 0, 0, 0, 0, 0]
    codes, scales = quantize(x)
    assert not np.isnan(scales).any() and np.isfinite(scales).all()
    assert scales[0, 0] == 0 and not codes[0].any()
    assert codes[1].tolist() == [0, 32, -64, 0, 0, 0, 0, 127]
    assert scales[2, 0] == 1 and codes[2].tolist() == [127, -127, 1, 0, 0, 0, 0, 127]
    assert scales[3, 0] == 1 and codes[3].tolist() == [0, 0, 0, 0, 0, 0, 0, 127]
    assert scales[4, 0] == 0 and not codes[4].any()
    assert scales[5, 0] == SCALE_MAX and codes[5, :2].tolist() == [127, -127]
    out = dequantize(codes, scales)
    assert np.isfinite(out).all()
    assert bits(out[0]).tolist() == [0] * 8  # +0.0, not -0.0


def test_denormal_scales_become_zero():
    # amax / 127 below the smallest normal float32: stored as zero
    tiny = F32(100) * SCALE_MIN           # normal itself, its scale would be subnormal
    just = F32(127) * SCALE_MIN           # the smallest amax with a normal scale
    x = np.array([[tiny, -tiny / 2, 0, 0], [just, just / 2, 0, 0]], F32)
    codes, scales = quantize(x)
    assert scales[0, 0] == 0 and not codes[0].any()
    assert scales[1, 0] == SCALE_MIN and codes[1, :2].tolist() == [127, 64]
    assert (np.abs(dequantize(codes, scales) - x) <= F32(127) * SCALE_MIN).all()


def test_dequantize_into_16_bit_types_rounds_to_nearest_even():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (1000, 32)).astype(np.int8)
    scales = (F32(2.0) ** rng.uniform(-40, 20, (1000, 1))).astype(F32)
    for dtype in ("float16", "bfloat16"):
        with np.errstate(over="ignore"):
            want = (codes.astype(F32) * scales).astype(resolve_dtype(dtype))
        got = dequantize(codes, scales, dtype)
        assert np.array_equal(bits(got), bits(want))


def test_quantize_refuses_other_dtypes():
    with pytest.raises(DTypeError, match="x"):
        quantize(np.zeros((2, 8), np.float64))
    with pytest.raises(DTypeError, match="dtype"):
        dequantize(np.zeros((2, 8), np.int8), np.zeros((2, 1), F32), "int8")


# ------------------------------------------------------ Numba conversions
def convert(src, how, out_dtype):
    out = np.empty(src.size, out_dtype)
    nq.convert_bits(out, src, how)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numba_16_bit_to_float32_every_pattern(dtype):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    kind = nq.KIND_F16 if dtype == "float16" else nq.KIND_BF16
    got = convert(h, kind + 2, np.uint32)
    # NaN payloads included: NumPy and ml_dtypes widen them unchanged
    assert np.array_equal(got, bits(h.view(resolve_dtype(dtype)).astype(F32)))


def bfloat16_edge_patterns():
    """Every sign, exponent and top 7 significand bits (the high half of the
    bits, which bfloat16 keeps), each with the low halves that decide a
    rounding: zero, one, just below, at and just above half of a bfloat16
    step (bit 15), the quarter points and all ones, plus random ones. NaNs
    with payloads within and below the kept bits, signalling and quiet, are
    among them. (All 2**32 patterns agree with ml_dtypes too; at ml_dtypes'
    conversion speed that check takes minutes.)"""
    rng = np.random.default_rng(5)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFE,
                    0xFFFF], np.uint32)
    low = np.concatenate([low, rng.integers(0, 1 << 16, 5, dtype=np.uint32)])
    return (high[:, None] | low[None, :]).reshape(-1)


def test_numba_float32_to_bfloat16_rounding():
    x = bfloat16_edge_patterns()
    got = np.empty(x.size, np.uint16)
    nq.convert_bits(got, x, nq.KIND_BF16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = bits(x.view(F32).astype(resolve_dtype("bfloat16")))
    assert np.array_equal(got, want)


def float16_edge_patterns():
    """Every sign, exponent and top 7 significand bits (the high half of the
    bits), each with the low halves that decide a rounding: below, at and
    above half of a float16 step for normals (bit 13) and the bits around it,
    plus random ones. NaNs with payloads above and within the kept bits,
    signalling and quiet, are among them. (All 2**32 patterns agree with
    NumPy too; at NumPy's conversion speed that check takes minutes.)"""
    rng = np.random.default_rng(3)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x2FFF, 0x3000,
                    0x3001, 0x5000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xEFFF, 0xF000, 0xFFFF],
                   np.uint32)
    low = np.concatenate([low, rng.integers(0, 1 << 16, 13, dtype=np.uint32)])
    return (high[:, None] | low[None, :]).reshape(-1)


def test_numba_float32_to_float16_rounding():
    patterns = float16_edge_patterns()
    with np.errstate(over="ignore", invalid="ignore"):
        want = bits(patterns.view(F32).astype(np.float16))
    assert np.array_equal(convert(patterns, nq.KIND_F16, np.uint16), want)
    # the classes are all there: subnormal and normal results, infinities, NaN
    kinds = {(w & 0x7C00 == 0, w & 0x7C00 == 0x7C00 and w & 0x3FF == 0,
              w & 0x7C00 == 0x7C00 and w & 0x3FF != 0) for w in want[::97].tolist()}
    assert len(kinds) == 4


def test_numba_conversions_refuse_lengths_that_differ():
    with pytest.raises(ValueError):
        nq.convert_bits(np.empty(3, np.uint16), np.zeros(4, np.uint32), nq.KIND_F16)


# ------------------------------------------------------------- the store
def test_store_holds_codes_and_scales_in_page_geometry():
    backend = get_backend("numpy")
    for layout, scale_shape in (("NHD", (2, 5, 16, 8, 4)), ("HND", (2, 5, 8, 16, 4))):
        store = KVStore(2, 16, 8, 128, num_pages=5, dtype="int8", layout=layout,
                        backend=backend)
        assert store.k.dtype == np.int8 and store.dtype == np.int8
        assert store.k_scale.shape == store.v_scale.shape == scale_shape
        assert store.k_scale.dtype == np.float32
        assert store.nbytes == 2 * (store.k.nbytes + store.k_scale.nbytes)
        per_page = KVStore.bytes_per_page(2, 16, 8, 128, "int8")
        assert per_page == 2 * 2 * 16 * 8 * (128 + 4 * 4)
        assert store.nbytes == 5 * per_page


def test_memory_budget_counts_the_scales():
    backend = get_backend("numpy")
    per_page = KVStore.bytes_per_page(3, 16, 3, 64, "int8")
    assert per_page == 2 * 3 * 16 * 3 * (64 + 2 * 4)
    store = KVStore(3, 16, 3, 64, memory_bytes=10 * per_page + per_page - 1, dtype="int8",
                    backend=backend)
    assert store.num_pages == 10 and store.nbytes == 10 * per_page
    # tokens per byte: 1.125 bytes a value against 4 and 2
    f32 = KVStore.bytes_per_page(3, 16, 3, 64, "float32")
    f16 = KVStore.bytes_per_page(3, 16, 3, 64, "float16")
    assert f32 / per_page == pytest.approx(4 / 1.125)
    assert f16 / per_page == pytest.approx(2 / 1.125)


# ------------------------------------------------------------- the cache
BACKENDS = ["numpy", "numba"]
PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 2, 64, 2


def model_kv(tokens, layer, dtype="float32"):
    """K/V a model would write: a function of the tokens up to each position."""
    out = []
    for which in (0, 1):
        rows = []
        h = 1469598103934665603 + 31 * layer + which
        for tok in tokens:
            h = (h * 1099511628211 + int(tok) + 7) % (1 << 61)
            rng = np.random.default_rng(h)
            rows.append(rng.standard_normal((NUM_KV_HEADS, HEAD_DIM)) * (1 + h % 5))
        out.append(np.array(rows, np.float32).reshape(len(tokens), NUM_KV_HEADS, HEAD_DIM)
                   .astype(resolve_dtype(dtype)))
    return out[0], out[1]


def make_cache(backend, layout="NHD", **kw):
    return PagedKVCache(NUM_LAYERS, 24, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype="int8",
                        layout=layout, backend=backend, hash_secret=b"quant", **kw)


def prefill(cache, prompt, in_dtype="float32"):
    seq = cache.add_sequence(prompt)
    cache.extend(seq, prompt[seq.num_cached_tokens:])
    plan = cache.plan([seq])
    lo = seq.num_cached_tokens
    for layer in range(NUM_LAYERS):
        k, v = model_kv(prompt, layer, in_dtype)
        cache.write(layer, plan, k[lo:], v[lo:])
    return seq


def assert_holds(cache, seqs, tokens_of, layout="BTHD", dtype="float32", in_dtype="float32"):
    """Every sequence gathers the round trip of its own K/V, zero past its end."""
    plan = cache.plan(seqs)
    for layer in range(NUM_LAYERS):
        k, v = cache.gather(layer, plan, layout=layout, dtype=dtype)
        assert k.dtype == resolve_dtype(dtype)
        if layout == "BHTD":
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        for b in range(len(seqs)):
            toks = tokens_of[b]
            n = len(toks)
            for got, want in zip((k[b], v[b]), model_kv(toks, layer, in_dtype)):
                want = dequantize(*quantize(want), dtype)
                assert np.array_equal(bits(np.ascontiguousarray(got[:n])), bits(want))
                assert not bits(np.ascontiguousarray(got[n:])).any()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_cache_prefix_reuse_partial_pages_and_fork(backend, layout):
    cache = make_cache(backend, layout)
    base = list(range(1, 11))                       # 2 full pages and 2 tokens
    a = prefill(cache, base)
    assert_holds(cache, [a], [base], "BHTD")
    cache.release(a)
    # a whole-page hit, then a partial-page copy of the third page
    b_prompt = base[:9] + [50, 51, 52]
    b = prefill(cache, b_prompt)
    assert b.num_cached_tokens == 9
    assert_holds(cache, [b], [b_prompt], "BTHD")
    # fork shares the partly filled last page; extending each copies it
    child = cache.fork(b)
    for seq, tok, toks in ((b, 60, b_prompt + [60]), (child, 61, b_prompt + [61])):
        cache.extend(seq, [tok])
        plan = cache.plan([seq])
        for layer in range(NUM_LAYERS):
            k, v = model_kv(toks, layer)
            cache.write(layer, plan, k[-1:], v[-1:])
    assert set(b.page_ids[:3]) == set(child.page_ids[:3])
    assert b.page_ids[-1] != child.page_ids[-1]
    assert_holds(cache, [b, child], [b_prompt + [60], b_prompt + [61]], "BHTD")
    cache.check_invariants()


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_cache_takes_and_gives_every_float_dtype(backend, in_dtype, out_dtype):
    cache = make_cache(backend, "HND")
    prompt = list(range(20, 33))
    a = prefill(cache, prompt, in_dtype)
    assert_holds(cache, [a], [prompt], "BHTD", out_dtype, in_dtype)
    # out= buffers decide the dtype
    plan = cache.plan([a])
    shape = (1, NUM_KV_HEADS, 16, HEAD_DIM)
    out = tuple(np.full(shape, 7, resolve_dtype(out_dtype)) for _ in range(2))
    k, v = cache.gather(0, plan, "BHTD", out=out)
    assert k is out[0] and v is out[1]
    want = dequantize(*quantize(model_kv(prompt, 0, in_dtype)[0]), out_dtype)
    assert np.array_equal(bits(np.ascontiguousarray(k[0, :, :13].transpose(1, 0, 2))),
                          bits(want))
    assert not bits(k[0, :, 13:]).any()


def test_int8_cache_geometry_and_budget():
    per_page = KVStore.bytes_per_page(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, "int8")
    cache = PagedKVCache(NUM_LAYERS, None, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype="int8",
                         memory_bytes=7 * per_page, backend="numpy")
    assert cache.num_pages == 7 and cache.nbytes == 7 * per_page
    assert cache.dtype == np.int8 and cache.k_cache.dtype == np.int8
    assert "int8" in repr(cache)


def test_int8_cache_copy_on_write_moves_scales(expected_kv=None):
    """A copied page carries its scales: gathering the copy gives the same bits."""
    cache = make_cache("numpy")
    a = prefill(cache, list(range(1, 7)))           # 1 full page, 2 tokens
    child = cache.fork(a)
    cache.extend(child, [9])
    src, dst = a.page_ids[-1], child.page_ids[-1]
    assert src != dst
    store = cache.store
    assert np.array_equal(store.k_scale[:, dst, :2], store.k_scale[:, src, :2])
    assert np.array_equal(store.v[:, dst, :2], store.v[:, src, :2])
    assert store.k_scale[:, dst, :2].any()


# ------------------------------------------------------------- OrtDecoder
def test_ort_decoder_with_int8_pages_holds_the_round_trip_of_the_prompt():
    """OrtDecoder(kv_dtype="int8"): the prompt's K/V, computed in one model
    call, lands in the pages as the round trip of what a float32 decoder's
    pages hold for the same prompt; decoding then runs on the int8 pages."""
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.models.testmodel import build_model

    model = build_model().SerializeToString()
    prompt = list(range(3, 40))
    decoders = {d: OrtDecoder(model, num_pages=16, page_size=PAGE_SIZE, backend="numpy",
                              kv_dtype=d, write_interval=1)
                for d in ("float32", "int8")}
    assert decoders["int8"].cache.dtype == np.int8
    gathered = {}
    for d, dec in decoders.items():
        rid = dec.add_request(prompt, 1)
        while not dec.step().finished:
            pass
        assert len(dec.get_output(rid)) == 1
        dec.settle()              # its K/V into the pages now, not at the next step
        cache = dec.cache
        seq = cache.add_sequence(prompt + [0])   # the prompt's pages, from the index
        assert seq.num_cached_tokens == len(prompt)   # whole pages and a partial copy
        plan = cache.plan([seq])
        gathered[d] = [cache.gather(layer, plan, "BTHD") for layer in range(cache.num_layers)]
        cache.release(seq)
    for (k32, v32), (k8, v8) in zip(gathered["float32"], gathered["int8"]):
        for got, ref in ((k8, k32), (v8, v32)):
            assert np.array_equal(bits(got), bits(dequantize(*quantize(ref))))
    out = decoders["int8"].generate([prompt], 8)
    assert len(out[0]) == 8


def test_ort_decoder_kv_dtype_is_the_models_or_int8():
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.models.testmodel import build_model

    model = build_model().SerializeToString()
    for bad in ("float16", "float64", "int4"):
        with pytest.raises(DTypeError, match="kv_dtype"):
            OrtDecoder(model, num_pages=8, page_size=PAGE_SIZE, backend="numpy", kv_dtype=bad)
    dec = OrtDecoder(model, num_pages=8, page_size=PAGE_SIZE, backend="numpy",
                     kv_dtype="float32")
    assert dec.cache.dtype == np.float32


# Gathers and writes of every 16-bit type on a CPU without F16C or AVX512-BF16:
# the kernels' integer rounding, against the NumPy backend, and no conversion
# instruction in the code.
GENERIC_CPU_PROBE = """
import numpy as np
from pagedkv_np import KVStore, get_backend
from pagedkv_np.backends import _numba_quant as nq
from pagedkv_np.layout import resolve_dtype

rng = np.random.default_rng(5)
numba_be, ref = get_backend("numba"), get_backend("numpy")
stores = [KVStore(1, 4, 2, 64, num_pages=6, dtype="int8", backend=be) for be in (numba_be, ref)]
slots = rng.permutation(24)[:20].astype(np.int32)
table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
seq_lens = np.array([11, 12], np.int32)
for dtype in ("float16", "bfloat16"):
    x = (rng.standard_normal((20, 2, 64)) * 10.0 ** rng.uniform(-8, 5, (20, 2, 1)))
    with np.errstate(over="ignore"):  # infinities among them
        x = x.astype(np.float32).astype(resolve_dtype(dtype))
    for st, be in zip(stores, (numba_be, ref)):
        be.write_quantized(st.k, st.v, st.k_scale, st.v_scale, 0, slots, x, x[::-1].copy())
    for a, b in zip((stores[0].k, stores[0].k_scale), (stores[1].k, stores[1].k_scale)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), dtype
    stores[0].k_scale[0, 0, 0, 0, 0] = 2.0 ** 100  # float16 overflow
    stores[1].k_scale[0, 0, 0, 0, 0] = 2.0 ** 100
    got = numba_be.gather_quantized(stores[0].k, stores[0].v, stores[0].k_scale,
                                    stores[0].v_scale, 0, table, seq_lens, dtype=dtype)
    want = ref.gather_quantized(stores[1].k, stores[1].v, stores[1].k_scale, stores[1].v_scale,
                                0, table, seq_lens, dtype=dtype)
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint16), w.view(np.uint16)), dtype
asm = "".join(nq.gather_q_serial.inspect_asm(s) for s in nq.gather_q_serial.signatures)
assert "vcvtps2ph" not in asm and "vcvtneps2bf16" not in asm
print("ok")
"""


def test_numba_int8_kernels_on_a_cpu_without_16_bit_conversions(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CPU_NAME="x86-64", NUMBA_CPU_FEATURES="",
               NUMBA_CACHE_DIR=str(tmp_path), PAGEDKV_NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", GENERIC_CPU_PROBE], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
