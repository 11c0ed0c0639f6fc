"""Chunked prefill: a prompt fed in chunks between the decode steps of others.

Every token is compared to a full recompute of the whole sequence through a
separate session of the same graph (no cache), and the engine is left with
no page held. Chunk sizes put chunk boundaries inside pages and on them; a
prompt with a cached prefix starts its first chunk after it.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_np.errors import ConfigError, DTypeError, RequestFailed
from pagedkv_np.models.testmodel import DecoderConfig, build_model
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.onnxruntime.chunking import (DEFAULT_PREFILL_CHUNK, SOLO_PREFILL_CHUNK,
                                             TILE_ROWS, ChunkBudget, chunk_rows)
from pagedkv_np.onnxruntime.runners import LOGITS_TO_KEEP

from helpers import deep_state
from test_faults import Reference, assert_idle, poison, run_all

FAMILIES = ["optimum", "gqa"]
PAGE = 8
NEW = 12
RUN = 40           # tokens of the requests that decode while LONG is fed: more than its chunks
_rng = np.random.default_rng(808)
SYSTEM = _rng.integers(1, 256, 21).tolist()                 # 2 pages and 5 tokens
SHORT = [SYSTEM + _rng.integers(1, 256, n).tolist() for n in (3, 11)] + \
        [_rng.integers(1, 256, 6).tolist()]
LONG = SYSTEM + _rng.integers(1, 256, 70).tolist()          # 91 tokens

_MODELS: dict = {}
_REFS: dict = {}


def model(family: str) -> bytes:
    if family not in _MODELS:
        _MODELS[family] = build_model(DecoderConfig(), family=family).SerializeToString()
    return _MODELS[family]


def ref(family: str) -> Reference:
    if family not in _REFS:
        _REFS[family] = Reference(model(family))
    return _REFS[family]


def decoder(family: str, **kw) -> OrtDecoder:
    kw.setdefault("num_pages", 96)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    return OrtDecoder(model(family), **kw)


def _long_arrives_while_others_decode(dec: OrtDecoder) -> tuple[list[int], int, list[dict]]:
    """Three short requests decode (RUN tokens each); LONG arrives after two
    steps. Returns their ids (LONG's last) and the events of every step after
    it arrived."""
    rids = [dec.add_request(p, max_new_tokens=RUN) for p in SHORT]
    dec.step()
    dec.step()
    long = dec.add_request(LONG, max_new_tokens=NEW)
    steps = []
    while dec.has_unfinished_requests():
        steps.append(dec.step())
    return rids + [long], long, steps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("caching", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("chunk", [3, 8, 13])
def test_a_long_prompt_is_chunked_between_decode_steps(family, caching, chunk):
    dec = decoder(family, prefill_chunk=chunk, enable_prefix_caching=caching)
    rids, long, steps = _long_arrives_while_others_decode(dec)
    cached = dec.status(long).num_cached_tokens
    for rid, p in zip(rids, SHORT):
        assert dec.pop_output(rid) == ref(family).tokens(p, RUN)
    assert dec.pop_output(long) == ref(family).tokens(LONG, NEW)
    # the SYSTEM pages (and with partial reuse its last 5 tokens) came from the cache
    assert cached == (len(SYSTEM) if caching else 0)
    chunks = math.ceil((len(LONG) - cached) / chunk)
    # every step until LONG's first token prefilled one chunk of it and gave
    # each running request a token
    first = next(i for i, ev in enumerate(steps) if long in ev)
    assert first == chunks - 1
    for ev in steps[:first + 1]:
        assert all(rid in ev for rid in rids[:3])
    assert dec.stats["num_prefill_chunks"] >= chunks
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_chunks_give_the_same_tokens(family):
    dec = decoder(family)
    rids, long, steps = _long_arrives_while_others_decode(dec)
    cached = dec.status(long).num_cached_tokens
    for rid, p in zip(rids, SHORT):
        assert dec.pop_output(rid) == ref(family).tokens(p, RUN)
    assert dec.pop_output(long) == ref(family).tokens(LONG, NEW)
    first = next(i for i, ev in enumerate(steps) if long in ev)
    assert first == math.ceil((len(LONG) - cached) / DEFAULT_PREFILL_CHUNK) - 1
    assert_idle(dec)


def test_chunk_budget():
    assert ChunkBudget().tokens(decoding=True) == DEFAULT_PREFILL_CHUNK
    assert ChunkBudget().tokens(decoding=False) == SOLO_PREFILL_CHUNK
    assert ChunkBudget(24).tokens(decoding=True) == 24
    assert ChunkBudget(24).tokens(decoding=False) == SOLO_PREFILL_CHUNK
    assert ChunkBudget(4096).tokens(decoding=False) == 4096


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_and_whole_prefill_give_the_same_tokens(family):
    chunked = decoder(family, prefill_chunk=5)
    whole = decoder(family, prefill_chunk=10_000)
    prompts = SHORT + [LONG, LONG[:40] + [7, 7, 7]]
    a = chunked.generate(prompts, max_new_tokens=NEW)
    b = whole.generate(prompts, max_new_tokens=NEW)
    assert a == b == [ref(family).tokens(p, NEW) for p in prompts]
    assert whole.stats["num_prefill_chunks"] == whole.stats["num_prefills"]
    assert chunked.stats["num_prefill_chunks"] == whole.stats["num_prefill_chunks"]
    # generate admits all at once: with nothing decoding a step takes
    # solo-sized chunks, so only the step with running requests chunks
    assert_idle(chunked)
    assert_idle(whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_longer_than_a_solo_chunk_is_fed_in_solo_chunks(family):
    prompt = _rng.integers(1, 256, SOLO_PREFILL_CHUNK + 37).tolist()
    dec = decoder(family, num_pages=(len(prompt) + NEW) // PAGE + 4)
    rid = dec.add_request(prompt, max_new_tokens=4)
    events = dec.step()
    assert rid not in events and dec.stats["num_prefill_chunks"] == 1
    run_all(dec)
    assert dec.pop_output(rid) == ref(family).tokens(prompt, 4)
    assert dec.stats["num_prefill_chunks"] == 2
    assert_idle(dec)


def _second_chunk_of_long(tokens, num_past, past=None, capacity=None):
    """A prefill call that feeds LONG's second chunk (or a later one)."""
    n = len(tokens)
    return num_past > len(SYSTEM) and list(tokens) == LONG[num_past:num_past + n]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_failure_mid_prompt_ends_that_request_and_leaks_no_page(family):
    dec = decoder(family, prefill_chunk=8)
    raised = poison(dec._runner, "prefill", _second_chunk_of_long, times=1)
    rids, long, _ = _long_arrives_while_others_decode(dec)
    assert raised == ["prefill"]
    status = dec.status(long)
    assert status.finish_reason == "error" and isinstance(status.error, RequestFailed)
    assert dec.pop_output(long) == []
    for rid, p in zip(rids, SHORT):
        assert dec.pop_output(rid) == ref(family).tokens(p, RUN)
    assert_idle(dec)
    # the engine goes on: LONG again, from what the cache holds
    assert dec.generate([LONG], max_new_tokens=NEW) == [ref(family).tokens(LONG, NEW)]
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_interrupt_mid_prompt_loses_no_request(family):
    dec = decoder(family, prefill_chunk=8)
    poison(dec._runner, "prefill", _second_chunk_of_long, exc=KeyboardInterrupt, times=1)
    rids = [dec.add_request(p, max_new_tokens=NEW) for p in SHORT]
    dec.step()
    long = dec.add_request(LONG, max_new_tokens=NEW)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(100):
            dec.step()
    run_all(dec)
    for rid, p in zip(rids + [long], SHORT + [LONG]):
        assert dec.pop_output(rid) == ref(family).tokens(p, NEW)
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_abort_mid_prompt_releases_its_pages(family):
    dec = decoder(family, prefill_chunk=8)
    rids = [dec.add_request(p, max_new_tokens=NEW) for p in SHORT]
    dec.step()
    long = dec.add_request(LONG, max_new_tokens=NEW)
    dec.step()
    dec.step()
    assert dec.stats["num_running"] == 4 and not dec.is_finished(long)
    dec.abort(long)
    assert dec.status(long).finish_reason == "abort" and dec.get_output(long) == []
    run_all(dec)
    for rid, p in zip(rids, SHORT):
        assert dec.pop_output(rid) == ref(family).tokens(p, NEW)
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("caching", [True, False], ids=["reuse", "no-reuse"])
def test_a_pool_that_runs_short_puts_the_open_prompt_back(family, caching):
    """Decode steps take the pages a half-fed prompt needs: the prompt goes
    back to the queue (its written chunks stay cached) and comes back later."""
    longest = len(LONG) + NEW
    dec = decoder(family, prefill_chunk=4, num_pages=longest // PAGE + 5,
                  enable_prefix_caching=caching)
    prompts = [SHORT[2], SHORT[2][::-1], LONG]
    rids = [dec.add_request(p, max_new_tokens=3 * NEW) for p in prompts[:2]]
    dec.step()
    long = dec.add_request(LONG, max_new_tokens=NEW)
    run_all(dec)
    assert dec.stats["num_preemptions"] > 0
    assert dec.pop_output(long) == ref(family).tokens(LONG, NEW)
    for rid, p in zip(rids, prompts):
        assert dec.pop_output(rid) == ref(family).tokens(p, 3 * NEW)
    assert_idle(dec)


@pytest.mark.parametrize("value, error", [(0, ConfigError), (-3, ConfigError),
                                          (2.5, DTypeError), ("64", DTypeError)])
def test_prefill_chunk_is_checked(value, error):
    with pytest.raises(error, match="prefill_chunk"):
        decoder("optimum", prefill_chunk=value)


@pytest.mark.parametrize("family", FAMILIES)
def test_continuing_a_prompt_the_runner_does_not_hold_is_refused(family):
    dec = decoder(family)
    runner = dec._runner
    tokens = np.array(LONG[:10], np.int64)
    runner.prefill(tokens, 0, None, 20)                 # keeps 10 positions
    before = deep_state(runner)
    with pytest.raises(ConfigError, match="no prompt of 7 positions"):
        runner.prefill(tokens[:3], 7, None, 20)
    assert deep_state(runner) == before
    runner.prefill(tokens[:3], 10, None, 20)            # continues: 13 kept
    runner.forget_prompt()
    with pytest.raises(ConfigError, match="no prompt of 13 positions"):
        runner.prefill(tokens[:3], 13, None, 20)


# ---------------------------------------------------------- logits_to_keep


def _full_and_kept(family: str, tie: bool, keep: int | None):
    m = build_model(DecoderConfig(tie_word_embeddings=tie), family=family)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    tokens = LONG[:17]
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, len(tokens)), np.int64)}
    for arg in sess.get_inputs():
        if arg.name == "position_ids":
            feeds[arg.name] = np.arange(len(tokens), dtype=np.int64)[None]
        elif arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
        elif arg.name == "num_logits_to_keep":   # 0: every position
            feeds[arg.name] = np.zeros(1, np.int64)
    full = sess.run(["logits"], feeds)[0]
    if keep is not None:
        feeds[LOGITS_TO_KEEP] = np.array([keep], np.int64)
    return full, sess.run(["logits"], feeds)[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("keep", [None, 0, 1, 3, 17])
def test_logits_to_keep_gives_the_last_positions(family, tie, keep):
    full, kept = _full_and_kept(family, tie, keep)
    assert full.shape == (1, 17, DecoderConfig().vocab_size)
    want = full if not keep else full[:, -keep:]
    assert kept.shape == want.shape
    np.testing.assert_allclose(kept, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_graph_without_logits_to_keep_is_served_the_same(family):
    """An exported graph that returns every position's logits (here: the
    input removed, a constant 0 in its place)."""
    proto = onnx.load_from_string(model(family))
    kept = [i for i in proto.graph.input if i.name != LOGITS_TO_KEEP]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.int64),
                                                                LOGITS_TO_KEEP))
    dec = OrtDecoder(proto.SerializeToString(), num_pages=96, page_size=PAGE,
                     prefill_chunk=8)
    assert dec._runner._last_logits is None
    rids, long, _ = _long_arrives_while_others_decode(dec)
    for rid, p in zip(rids, SHORT):
        assert dec.pop_output(rid) == ref(family).tokens(p, RUN)
    assert dec.pop_output(long) == ref(family).tokens(LONG, NEW)
    assert_idle(dec)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 700), remaining=st.integers(1, 1200), first=st.booleans())
def test_no_chunk_leaves_a_lone_row_in_a_tile(budget, remaining, first):
    n = chunk_rows(budget, remaining, first)
    assert 0 <= n <= remaining
    if remaining == 1:                        # a prompt of one token: nothing to split
        assert n == (1 if budget >= 1 else 0)
        return
    if n:
        assert n % TILE_ROWS != 1 and (remaining - n) % TILE_ROWS != 1
    if not first:
        assert n <= budget
    else:                                     # a step's first chunk always moves
        assert 0 < n <= max(budget, 3)
    # the most that fits the budget
    assert all(m % TILE_ROWS == 1 or (remaining - m) % TILE_ROWS == 1
               for m in range(n + 1, min(budget, remaining) + 1))
