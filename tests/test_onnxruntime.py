"""OrtDecoder against a no-cache full recompute through the same ONNX model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from pagedkv_np import ConfigError, DTypeError, PagedKVError, ShapeError
from pagedkv_np.onnxruntime import (OrtDecoder, RequestNotFound, SamplingParams,
                                    UnsupportedModelError)
from pagedkv_np.onnxruntime.sampling import sample
from pagedkv_np.models.testmodel import DecoderConfig, build_model

from helpers import full_recompute_logits

CONFIG = DecoderConfig()              # hidden 64, 2 layers, 4 heads, 2 K/V heads, vocab 256
PAGE = 8
NEW = 40                              # tokens generated per request
VARIANTS = {
    "optimum": dict(family="optimum"),
    "optimum-no-position-ids": dict(family="optimum", position_ids=False),
    "gqa": dict(family="gqa"),
}

_rng = np.random.default_rng(2024)
SYSTEM = _rng.integers(0, CONFIG.vocab_size, 37).tolist()    # not page aligned
# lengths 37..77: one prompt is the system prompt alone, one ends on a page
# boundary (40), one is a single token, one is exactly two pages (16)
PROMPTS = ([SYSTEM + _rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 1, 12, 27, 0)]
           + [_rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (1, 16, 50)])
WAVE2 = [SYSTEM + _rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 19)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


_MODELS: dict[str, bytes] = {}
_REFS: dict[tuple, list[int]] = {}


def model_bytes(variant: str) -> bytes:
    if variant not in _MODELS:
        _MODELS[variant] = build_model(CONFIG, **VARIANTS[variant]).SerializeToString()
    return _MODELS[variant]


def _session(variant: str) -> ort.InferenceSession:
    return ort.InferenceSession(model_bytes(variant), providers=["CPUExecutionProvider"])


_SESSIONS: dict[str, ort.InferenceSession] = {}


def full_logits(variant: str, tokens: list[int]) -> np.ndarray:
    """Last-position logits of the whole sequence, no past: the no-cache reference."""
    if variant not in _SESSIONS:
        _SESSIONS[variant] = _session(variant)
    return full_recompute_logits(_SESSIONS[variant], tokens)


def reference(variant: str, prompt: list[int], n: int = NEW, seed=None,
              params: SamplingParams | None = None) -> list[int]:
    """Greedy (or seeded sampling) by recomputing the whole sequence every token."""
    key = (variant, tuple(prompt), n, None if seed is None else str(seed.entropy) +
           str(seed.spawn_key), params)
    if key not in _REFS:
        rng = None if seed is None else np.random.default_rng(seed)
        tokens, out = list(prompt), []
        for _ in range(n):
            logits = full_logits(variant, tokens)
            tok = int(np.argmax(logits)) if params is None else sample(logits, params, rng)
            out.append(tok)
            tokens.append(tok)
        _REFS[key] = out
    return _REFS[key]


def decoder(variant: str, **kw) -> OrtDecoder:
    kw.setdefault("num_pages", 256)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    return OrtDecoder(model_bytes(variant), **kw)


# ---------------------------------------------------------------- greedy


def test_references_are_not_degenerate(variant):
    refs = [reference(variant, p) for p in PROMPTS]
    # a model that ignored its context would repeat itself or agree across prompts
    assert all(len(set(r)) >= 10 for r in refs)
    assert len({tuple(r) for r in refs}) == len(refs)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_greedy_equals_full_recompute(variant, layout):
    dec = decoder(variant, layout=layout)
    outs = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert outs == [reference(variant, p) for p in PROMPTS]
    stats = dec.stats
    assert stats["num_generated_tokens"] == NEW * len(PROMPTS)
    assert stats["num_preemptions"] == 0
    # prompts 1..4 reuse the system prompt's full pages (4 pages of 8)
    assert stats["prefix_hit_tokens"] >= 4 * 32
    assert stats["num_running"] == stats["num_waiting"] == 0
    dec.cache.check_invariants()


def test_second_wave_hits_the_system_prompt(variant):
    dec = decoder(variant, max_batch_size=8)
    first = dec.generate(PROMPTS[:1], max_new_tokens=NEW)
    assert first == [reference(variant, PROMPTS[0])]
    before = dec.stats
    assert before["prefix_hit_tokens"] == 0
    wave = WAVE2 + PROMPTS[:1]
    outs = dec.generate(wave, max_new_tokens=NEW)
    assert outs == [reference(variant, p) for p in wave]
    after = dec.stats
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    # the whole system prompt for each new prompt (the tokens after it differ);
    # for the repeated prompt, every token but the last
    assert hits == len(SYSTEM) + len(SYSTEM) + len(PROMPTS[0]) - 1
    assert after["prefix_query_tokens"] - before["prefix_query_tokens"] == sum(map(len, wave))
    assert 0 < after["prefix_hit_rate"] < 1


def test_cached_pages_are_really_read(variant):
    """Corrupting the cached system prompt must change what a hit generates."""
    dec = decoder(variant)
    dec.generate([SYSTEM + [1, 2, 3]], max_new_tokens=2)
    dec.cache.k_cache[...] = 0.5    # every cached K now wrong
    outs = dec.generate(WAVE2[:1], max_new_tokens=NEW)
    assert dec.stats["prefix_hit_tokens"] == len(SYSTEM)
    assert outs[0] != reference(variant, WAVE2[0])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_small_pool_preempts_and_still_gives_the_same_tokens(variant, layout):
    longest = max(len(p) for p in PROMPTS) + NEW - 1
    num_pages = -(-longest // PAGE) + 2      # room for one long request and a bit
    dec = decoder(variant, num_pages=num_pages, max_batch_size=8, layout=layout)
    outs = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert outs == [reference(variant, p) for p in PROMPTS]
    assert dec.stats["num_preemptions"] > 0
    dec.cache.check_invariants()


def test_engine_form_requests_join_and_leave(variant):
    dec = decoder(variant, max_batch_size=3)
    budgets = [NEW, 7, 23, 1, NEW, 12, 31, 5]
    rids, got = {}, {}
    step = 0
    while len(rids) < len(PROMPTS) or dec.has_unfinished_requests():
        if step % 3 == 0 and len(rids) < len(PROMPTS):     # a new request every 3 steps
            i = len(rids)
            rids[dec.add_request(PROMPTS[i], max_new_tokens=budgets[i])] = i
        for rid, toks in dec.step().items():
            got.setdefault(rid, []).extend(toks)
        assert dec.stats["num_running"] <= 3
        step += 1
    for rid, i in rids.items():
        assert dec.is_finished(rid)
        assert got[rid] == dec.pop_output(rid) == reference(variant, PROMPTS[i])[:budgets[i]]
    assert dec.stats["num_regathers"] > 1
    with pytest.raises(RequestNotFound):
        dec.get_output(next(iter(rids)))


@pytest.mark.parametrize("family", ["optimum", "gqa"])
def test_gathers_only_when_the_batch_changes(family, monkeypatch):
    dec = decoder(family)
    gathers, fed = [], []
    real_gather, real_run = dec.cache.gather, dec.session.run
    monkeypatch.setattr(dec.cache, "gather",
                        lambda *a, **k: gathers.append(a[0]) or real_gather(*a, **k))

    def run(names, feeds, *a, **k):
        fed.extend(feeds.values())
        return real_run(names, feeds, *a, **k)

    monkeypatch.setattr(dec.session, "run", run)
    prompts = PROMPTS[5:8] + PROMPTS[:1]      # no shared prefix: no prefill gathers
    outs = dec.generate(prompts, max_new_tokens=NEW)
    assert outs == [reference(family, p) for p in prompts]
    stats = dec.stats
    assert stats["num_decode_steps"] == NEW - 1
    assert stats["num_regathers"] == 1                 # once, when the batch formed
    # each layer once; a gqa batch's rows each alone (see batch_gather.batch_gather),
    # but the last prompt fed, whose row is copied from the runner's buffers
    rows = len(prompts) - 1 if family == "gqa" else 1
    assert sorted(gathers) == sorted(list(range(CONFIG.num_layers)) * rows)
    # a gqa model's prompts and decode steps all run through IOBinding
    assert (fed or family == "gqa") and all(a.flags.c_contiguous for a in fed)


def test_eos_stops_a_request(variant):
    ref = reference(variant, PROMPTS[2])
    eos = ref[6]
    stop = ref.index(eos)
    dec = decoder(variant, eos_token_id=eos)
    outs = dec.generate(PROMPTS[2:4], max_new_tokens=NEW)
    assert outs[0] == ref[:stop + 1]
    other = reference(variant, PROMPTS[3])
    assert outs[1] == (other[:other.index(eos) + 1] if eos in other else other)
    # a per-request override
    rid = dec.add_request(PROMPTS[2], max_new_tokens=NEW, eos_token_id=[])
    while not dec.is_finished(rid):
        dec.step()
    assert dec.pop_output(rid) == ref


def test_abort_returns_pages(variant):
    dec = decoder(variant)
    keep = dec.add_request(PROMPTS[1], max_new_tokens=NEW)
    drop = dec.add_request(PROMPTS[7], max_new_tokens=NEW)
    for _ in range(5):
        dec.step()
    used = dec.stats["pages_used"]
    dec.abort(drop)
    assert dec.is_finished(drop) and dec.stats["pages_used"] < used
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.pop_output(keep) == reference(variant, PROMPTS[1])
    assert len(dec.pop_output(drop)) == 5
    dec.cache.check_invariants()


def _fail_once(monkeypatch, obj, name, when):
    """Make ``obj.name`` raise RuntimeError("<name> failed") on the first call
    for which ``when(call number, args)`` holds."""
    real, calls, failed = getattr(obj, name), [], []

    def flaky(*args):
        calls.append(1)
        if not failed and when(len(calls), args):
            failed.append(1)
            raise RuntimeError(f"{name} failed")
        return real(*args)

    monkeypatch.setattr(obj, name, flaky)


@pytest.mark.parametrize("failing", ["model", "page write", "write at a finish"])
def test_a_failure_mid_step_leaves_a_usable_engine(variant, failing, monkeypatch):
    budgets = [NEW] * 4
    dec = decoder(variant, write_interval=1000 if failing == "write at a finish" else 16)
    if failing == "write at a finish":
        # the decoded K/V is written only when the first request finishes,
        # and that write fails: the finished request keeps its tokens, the
        # others are recomputed
        budgets[2] = 7
        _fail_once(monkeypatch, dec.cache, "write", lambda n, args: args[1].num_seqs > 1)
    elif failing == "model":
        # the second decode call: its tokens were reserved but their K/V is
        # never written; PROMPTS[1] (38 tokens) fills its fifth page with it
        _fail_once(monkeypatch, dec._runner, "decode", lambda n, args: n == 2)
    else:
        # the first write of decoded tokens (a plan of several sequences)
        # fails after its first layer: none of that plan may be indexed
        _fail_once(monkeypatch, dec.cache, "write",
                   lambda n, args: args[1].num_seqs > 1 and args[0] == 1)
    prompts = PROMPTS[:4]
    rids = [dec.add_request(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    # a failure of a batch's step is contained: each of its requests runs
    # again alone (or is recomputed), and a failure that does not come back
    # fails no request
    while dec.has_unfinished_requests():
        events = dec.step()
        assert not events.errors
        dec.cache.check_invariants()
    assert dec.stats["num_batch_failures"] == 1
    assert dec.stats["num_failed_requests"] == 0
    refs = [reference(variant, p) for p in prompts]
    assert [dec.pop_output(r) for r in rids] == [r[:n] for r, n in zip(refs, budgets)]
    # prompts that run through the pages of the failed step must not find
    # unwritten K/V in the prefix index
    longer = [p + r[:10] for p, r in zip(prompts, refs)]
    outs = dec.generate(longer, max_new_tokens=NEW - 10)
    assert outs == [r[10:] for r in refs]
    assert dec.stats["prefix_hit_tokens"] >= sum((len(p) - 1) // PAGE * PAGE for p in longer)


@pytest.mark.parametrize("interval, layout", [(1, "HND"), (5, "HND"), (1000, "HND"),
                                              (5, "NHD")])
def test_the_write_interval_changes_no_token_and_no_hit(variant, interval, layout):
    dec = decoder(variant, max_batch_size=8, write_interval=interval, layout=layout)
    refs = [reference(variant, p) for p in PROMPTS]
    assert dec.generate(PROMPTS, max_new_tokens=NEW) == refs
    # every fed token's K/V reached the pages, whenever it was written: a
    # prompt that continues a finished request is served from the cache but
    # for its last token, and gives that request's next token
    longer = [p + r[:NEW - 1] for p, r in zip(PROMPTS[5:], refs[5:])]
    before = dec.stats["prefix_hit_tokens"]
    assert dec.generate(longer, max_new_tokens=1) == [[r[NEW - 1]] for r in refs[5:]]
    assert dec.stats["prefix_hit_tokens"] - before == sum(len(p) - 1 for p in longer)
    dec.cache.check_invariants()


def test_an_aborted_request_leaves_its_decoded_tokens_cached(variant):
    dec = decoder(variant)
    rid = dec.add_request(PROMPTS[7], max_new_tokens=NEW)
    for _ in range(6):          # a prefill, then 5 decode steps: fewer than write_interval
        dec.step()
    dec.abort(rid)
    out = dec.pop_output(rid)
    assert out == reference(variant, PROMPTS[7])[:6]
    prompt = PROMPTS[7] + out[:5] + [3]
    assert dec.generate([prompt], max_new_tokens=NEW) == [reference(variant, prompt)]
    assert dec.stats["prefix_hit_tokens"] == len(PROMPTS[7]) + 5


@pytest.mark.parametrize("family", ["optimum", "gqa"])
def test_decode_buffers_grow(family, monkeypatch):
    from pagedkv_np.onnxruntime import batching
    monkeypatch.setattr(batching, "_MAX_HEADROOM", 3)   # GQA buffers outgrown every 4 steps
    dec = decoder(family)
    outs = dec.generate(PROMPTS[:3], max_new_tokens=NEW)
    assert outs == [reference(family, p) for p in PROMPTS[:3]]
    regathers = dec.stats["num_regathers"]
    assert regathers >= NEW // 4 if family == "gqa" else regathers == 1


def test_add_request_from_threads(variant):
    dec = decoder(variant)
    rids: dict[int, int] = {}
    lock = threading.Lock()

    def client(indices):
        for i in indices:
            rid = dec.add_request(PROMPTS[i], max_new_tokens=NEW)
            with lock:
                rids[rid] = i

    threads = [threading.Thread(target=client, args=(range(k, 8, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or dec.has_unfinished_requests():
        dec.step()
    for t in threads:
        t.join()
    assert sorted(rids.values()) == list(range(8))
    for rid, i in rids.items():
        assert dec.pop_output(rid) == reference(variant, PROMPTS[i])


# --------------------------------------------------------------- sampling


@pytest.mark.parametrize("family", ["optimum", "gqa"])
def test_seeded_sampling_is_reproducible_and_batch_independent(family):
    params = SamplingParams(temperature=1.5, top_k=40, top_p=0.9)
    prompts = PROMPTS[:6]
    kw = dict(max_new_tokens=24, temperature=1.5, top_k=40, top_p=0.9, seed=1234)
    outs = decoder(family, max_batch_size=6).generate(prompts, **kw)
    seeds = np.random.SeedSequence(1234).spawn(len(prompts))
    assert outs == [reference(family, p, 24, s, params) for p, s in zip(prompts, seeds)]
    # the same through preemption and another batch size
    tight = decoder(family, num_pages=16, max_batch_size=3)
    assert tight.generate(prompts, **kw) == outs
    assert tight.stats["num_preemptions"] > 0
    # sampling really samples: another seed, other tokens, unlike greedy
    other = decoder(family).generate(prompts, **dict(kw, seed=99))
    assert other != outs
    assert outs != [reference(family, p)[:24] for p in prompts]


def test_sample_rules():
    logits = np.array([1.0, 5.0, 3.0, 5.0, -2.0], np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(), None) == 1             # greedy: lowest id on ties
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=2), rng) for _ in range(200)}
    assert draws == {1, 3}
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.01), rng)
             for _ in range(50)}
    assert draws == {1}
    draws = [sample(logits, SamplingParams(temperature=100.0), rng) for _ in range(500)]
    assert set(draws) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kw, err", [
    (dict(temperature=-1.0), ConfigError), (dict(temperature=float("nan")), ConfigError),
    (dict(top_k=-1), ConfigError), (dict(top_p=0.0), ConfigError), (dict(top_p=1.5), ConfigError),
    (dict(top_k=2.5), DTypeError), (dict(temperature="hot"), DTypeError),
])
def test_bad_sampling_params(kw, err):
    dec = decoder("optimum")
    with pytest.raises(err):
        dec.add_request([1, 2, 3], **kw)


# ------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("prompt, err", [
    ([1.0, 2.0], DTypeError), ([1, "2"], DTypeError), ([True, 1], DTypeError),
    ("hello", DTypeError), ([-1, 3], DTypeError), ([], ShapeError),
    (np.zeros((2, 3), np.int64), ShapeError), (np.array([1.5, 2.5]), DTypeError),
    ([1, CONFIG.vocab_size], ConfigError),
])
def test_bad_prompts(prompt, err):
    dec = decoder("optimum")
    with pytest.raises(err, match="prompt"):
        dec.add_request(prompt)
    assert not dec.has_unfinished_requests()


def test_prompt_longer_than_the_pool():
    dec = decoder("gqa", num_pages=4)          # 32 slots
    with pytest.raises(ConfigError, match="pool has 4"):
        dec.add_request(list(range(33)), max_new_tokens=1)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dec.add_request(list(range(20)), max_new_tokens=20)
    rid = dec.add_request(list(range(20)), max_new_tokens=13)      # exactly 32 fed
    while not dec.is_finished(rid):
        dec.step()
    assert len(dec.pop_output(rid)) == 13


def test_bad_arguments():
    dec = decoder("optimum")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dec.add_request([1], max_new_tokens=0)
    with pytest.raises(DTypeError, match="salt"):
        dec.add_request([1], salt=1.5)
    with pytest.raises(DTypeError, match="eos_token_id"):
        dec.add_request([1], eos_token_id="x")
    with pytest.raises(RequestNotFound):
        dec.is_finished(12345)
    with pytest.raises(ConfigError, match="max_batch_size"):
        decoder("optimum", max_batch_size=0)
    with pytest.raises(ConfigError, match="write_interval"):
        decoder("optimum", write_interval=0)
    with pytest.raises((ConfigError, DTypeError), match="write_interval"):
        decoder("optimum", write_interval=2.5)
    with pytest.raises(DTypeError, match="model"):
        OrtDecoder(12345)
    with pytest.raises(ConfigError, match="no file"):
        OrtDecoder("/nonexistent/model.onnx")
    with pytest.raises(UnsupportedModelError, match="not an ONNX model"):
        OrtDecoder(b"this is not a model")


def test_salted_requests_do_not_share_pages():
    dec = decoder("optimum")
    dec.generate([PROMPTS[0]], max_new_tokens=2, salt="tenant-a")
    dec.generate([PROMPTS[1]], max_new_tokens=2, salt="tenant-b")
    assert dec.stats["prefix_hit_tokens"] == 0
    assert dec.generate([PROMPTS[1]], max_new_tokens=NEW, salt="tenant-a") == \
        [reference("optimum", PROMPTS[1])]
    # everything it shares with tenant a's prompt: all its tokens but the last
    assert dec.stats["prefix_hit_tokens"] == len(PROMPTS[1]) - 1


# ------------------------------------------------------- model discovery


def test_model_io_is_read_from_the_model(tmp_path):
    config = DecoderConfig(hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=3,
                           vocab_size=100, max_positions=300)
    path = tmp_path / "m.onnx"
    onnx.save(build_model(config, family="gqa"), str(path))
    dec = OrtDecoder(path, num_pages=64)
    io = dec.io
    assert (io.family, io.num_layers, io.num_kv_heads, io.head_dim) == ("gqa", 3, 3, 8)
    assert (io.dtype, io.vocab_size, io.max_positions) == (np.float32, 100, 300)
    assert not io.has_position_ids
    assert io.past_keys == ("past_key_values.0.key", "past_key_values.1.key",
                            "past_key_values.2.key")
    with pytest.raises(ConfigError, match="300 positions"):
        dec.add_request([1] * 250, max_new_tokens=60)
    # an optimum export's limit is the rows of the table it gathers by position
    opt = OrtDecoder(build_model(config, family="optimum"), num_pages=64).io
    assert (opt.family, opt.num_layers, opt.has_position_ids, opt.max_positions) == \
        ("optimum", 3, True, 300)


def _edited(edit) -> onnx.ModelProto:
    model = build_model(CONFIG, family="optimum")
    edit(model.graph)
    return model


def _drop_output(name):
    def edit(graph):
        keep = [o for o in graph.output if o.name != name]
        del graph.output[:]
        graph.output.extend(keep)
    return edit


def _symbolic_heads(graph):
    for arg in graph.input:
        if arg.name.startswith("past_key_values."):
            arg.type.tensor_type.shape.dim[1].dim_param = "kv_heads"


@pytest.mark.parametrize("edit, match", [
    (_drop_output("present.1.value"), "present.1.value"),
    (_drop_output("logits"), "logits"),
    (lambda g: g.input.append(helper.make_tensor_value_info(
        "token_type_ids", TensorProto.INT64, ["b", "s"])), "token_type_ids"),
    (_symbolic_heads, "num_kv_heads"),
])
def test_unsupported_models_raise_a_typed_error(edit, match):
    with pytest.raises(UnsupportedModelError, match=match):
        OrtDecoder(_edited(edit))


def test_symbolic_heads_can_be_given():
    dec = OrtDecoder(_edited(_symbolic_heads), num_kv_heads=2, num_pages=64)
    assert dec.io.num_kv_heads == 2
    assert dec.generate(PROMPTS[:2], NEW) == [reference("optimum", p) for p in PROMPTS[:2]]


@pytest.mark.parametrize("family", ["optimum", "gqa"])
def test_an_unknown_vocabulary_size_is_fine(family):
    # onnxruntime infers the test model's logits shape, so mark the size unknown
    # as discovery does for a model whose vocabulary dimension stays symbolic
    dec = decoder(family)
    dec.io = dataclasses.replace(dec.io, vocab_size=None)
    dec._runner = type(dec._runner)(dec.session, dec.io)
    assert dec.generate(PROMPTS[:3], NEW) == [reference(family, p) for p in PROMPTS[:3]]


def test_a_model_without_a_kv_cache_is_unsupported():
    node = helper.make_node("Gather", ["emb", "input_ids"], ["logits"])
    emb = onnx.numpy_helper.from_array(np.zeros((10, 10), np.float32), "emb")
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 10])], [emb])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedModelError, match="past_key_values") as info:
        OrtDecoder(model)
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, ValueError)
    graph.input.pop()
    with pytest.raises(UnsupportedModelError, match="attention_mask"):
        OrtDecoder(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "try:\n    import pagedkv_np.onnxruntime\n"
            "except ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "IMPORT-ERROR" in out and "pip install 'pagedkv-np[onnx]'" in out


def test_step_events_say_how_each_request_was_admitted_and_ended():
    """A caller learns cached prompt tokens and finish reasons from ``step``
    alone, without asking the engine about each request."""
    dec = decoder("gqa")
    first = dec.add_request(SYSTEM + [1, 2, 3], max_new_tokens=2, eos_token_id=[])
    admitted, statuses = {}, {}
    for _ in range(20):
        events = dec.step()
        admitted.update(events.admitted)
        statuses.update(events.statuses)
        if first in statuses:
            break
    assert admitted == {first: 0}
    assert statuses[first].finish_reason == "length"
    assert statuses[first].num_generated_tokens == 2
    assert statuses[first] == dec.status(first)
    # the same system prompt again: it comes from the prefix cache
    second = dec.add_request(SYSTEM + [4], max_new_tokens=1, eos_token_id=[])
    third = dec.add_request(SYSTEM + [5], max_new_tokens=5, eos_token_id=[])
    events = dec.step()
    cached = len(SYSTEM)   # partial pages too (partial_page_reuse)
    assert events.admitted == {second: cached, third: cached}
    assert second in events.finished and third not in events.finished
    assert events.statuses[second].num_cached_tokens == cached
    assert set(events.statuses) == set(events.finished)
    dec.abort(third)
    events = dec.step()
    assert events.statuses[third].finish_reason == "abort" and not events.admitted


def test_repr_names_model_context_pool_and_backend(tmp_path):
    model = build_model(DecoderConfig(vocab_size=64, hidden_size=32, num_layers=1,
                                      num_heads=2, num_kv_heads=1))
    path = tmp_path / "tiny.onnx"
    onnx.save(model, str(path))
    dec = OrtDecoder(path, num_pages=8, page_size=4, max_batch_size=2, backend="numpy",
                     max_positions=20)
    assert repr(dec) == ("OrtDecoder(model='tiny.onnx', context=20, pool=8 pages x 4 tokens "
                         "(float32, HND), backend='numpy', max_batch_size=2)")
    assert repr(OrtDecoder(model, num_pages=8)).startswith("OrtDecoder(model='<ModelProto>', ")
