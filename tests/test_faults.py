"""Fault containment: what the engine and the cache do when a call fails.

Failures are injected by wrapping the real onnxruntime session, runner and
cache methods (the model stays a real ONNX graph run by onnxruntime, and every
token is compared to a full recompute through another session of the same
graph). The promise checked everywhere: a failure ends at most the requests
it concerns, with a typed error naming them; every other request gets exactly
the tokens of a full recompute; nothing is left queued, running or holding
pages; and the engine serves new requests afterwards.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import pagedkv_np as pk
from pagedkv_np.errors import (AllocationError, ConfigError, DTypeError, PagedKVError,
                               RequestFailed)
from pagedkv_np.onnxruntime import OrtDecoder, RequestNotFound, UnsupportedModelError
from pagedkv_np.onnxruntime.requests import Request, RequestStatus, StepEvents
from pagedkv_np.onnxruntime.sampling import SamplingParams, sample
from pagedkv_np.models.testmodel import DecoderConfig, build_model

from helpers import CACHE_BACKENDS, deep_state

FAMILIES = ["optimum", "gqa"]
CHOOSE = Request.choose
PAGE = 4
_rng = np.random.default_rng(17)
SYSTEM = _rng.integers(1, 256, 9).tolist()
PROMPTS = [SYSTEM + _rng.integers(1, 256, n).tolist() for n in (2, 5, 0, 7)] + \
          [_rng.integers(1, 256, n).tolist() for n in (1, 6)]
NEW = 9


class Reference:
    """Greedy or seeded sampled tokens by recomputing the whole sequence
    through a separate session of the same model, no cache."""

    def __init__(self, model: bytes) -> None:
        self.model = model
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.memo: dict = {}

    def logits(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        feeds = {"input_ids": np.array([tokens], np.int64),
                 "attention_mask": np.ones((1, n), np.int64)}
        for arg in self.session.get_inputs():
            if arg.name == "position_ids":
                feeds[arg.name] = np.arange(n, dtype=np.int64)[None]
            elif arg.name.startswith("past_key_values."):
                feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
            elif arg.name == "num_logits_to_keep":   # 0: every position
                feeds[arg.name] = np.zeros(1, np.int64)
        return self.session.run(["logits"], feeds)[0][0, -1]

    def tokens(self, prompt, n: int, seed=None, temperature: float = 0.0) -> list[int]:
        key = (tuple(prompt), n, seed, temperature)
        if key not in self.memo:
            params = SamplingParams(temperature)
            rng = None if params.greedy else np.random.default_rng(seed)
            seq, out = list(prompt), []
            for _ in range(n):
                tok = sample(self.logits(seq), params, rng)
                out.append(tok)
                seq.append(tok)
            self.memo[key] = out
        return self.memo[key]


_MODELS: dict = {}


def model(family: str, **config) -> bytes:
    key = (family, tuple(sorted(config.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(DecoderConfig(**config), family=family).SerializeToString()
    return _MODELS[key]


_REFS: dict = {}


def ref(family: str, **config) -> Reference:
    key = (family, tuple(sorted(config.items())))
    if key not in _REFS:
        _REFS[key] = Reference(model(family, **config))
    return _REFS[key]


def decoder(family: str, **kw) -> OrtDecoder:
    kw.setdefault("num_pages", 64)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    return OrtDecoder(model(family), **kw)


def run_all(dec: OrtDecoder, rids=None) -> dict:
    """Step until nothing is left; returns {rid: StepEvents errors seen}."""
    errors: dict = {}
    for _ in range(10_000):
        if not dec.has_unfinished_requests():
            return errors
        events = dec.step()
        assert isinstance(events, StepEvents)
        assert set(events.errors) <= events.finished
        for rid in events.finished:
            assert dec.is_finished(rid)
        errors.update(events.errors)
    raise AssertionError("the engine never finished")


def assert_idle(dec: OrtDecoder) -> None:
    assert not dec.has_unfinished_requests()
    stats = dec.stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["pages_used"] == 0
    assert dec.cache.stats.num_sequences == 0
    dec.cache.check_invariants()


def serves_new_requests(dec: OrtDecoder, family: str) -> None:
    """The engine still gives full-recompute tokens, and holds no page after."""
    prompts = PROMPTS[1:4] + [PROMPTS[0] + [3, 1, 4]]
    assert dec.generate(prompts, max_new_tokens=NEW) == \
        [ref(family).tokens(p, NEW) for p in prompts]
    assert_idle(dec)


def poison(obj, name: str, when, exc=RuntimeError, times: int | None = None):
    """Wrap ``obj.name`` to raise ``exc`` when ``when(*args)`` holds (at most
    ``times`` times); returns the list of failures raised."""
    real, raised = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        if (times is None or len(raised) < times) and when(*args, **kwargs):
            raised.append(name)
            raise exc(f"injected failure of {name}")
        return real(*args, **kwargs)

    setattr(obj, name, wrapped)
    return raised


# ------------------------------------------------ bug 1: a failing request


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("position_ids", [True, False])
def test_the_graph_position_limit_is_checked_at_add_request(family, position_ids):
    m = build_model(DecoderConfig(max_positions=24), family=family,
                    position_ids=position_ids).SerializeToString()
    dec = OrtDecoder(m, num_pages=64, page_size=PAGE)
    assert dec.max_positions == 24 and dec.io.max_positions == 24
    before = deep_state(dec)
    with pytest.raises(ConfigError, match="24 positions"):
        dec.generate([list(range(1, 21))], max_new_tokens=8)    # 27 positions
    assert deep_state(dec) == before
    # the longest request that fits runs to its end
    out = dec.generate([list(range(1, 21))], max_new_tokens=5)   # 24 positions
    assert out == [Reference(m).tokens(list(range(1, 21)), 5)]
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_max_positions_limits_what_the_graph_allows(family):
    dec = decoder(family, max_positions=20)
    assert dec.max_positions == 20 and dec.io.max_positions == 4096
    with pytest.raises(ConfigError, match="20 positions"):
        dec.add_request(list(range(1, 16)), max_new_tokens=7)
    rid = dec.add_request(list(range(1, 16)), max_new_tokens=6)
    run_all(dec)
    assert dec.pop_output(rid) == ref(family).tokens(list(range(1, 16)), 6)
    # a larger setting does not lift the graph's own limit
    small = build_model(DecoderConfig(max_positions=24), family=family).SerializeToString()
    assert OrtDecoder(small, num_pages=16, max_positions=8192).max_positions == 24
    with pytest.raises(ConfigError, match="max_positions"):
        decoder(family, max_positions=0)
    with pytest.raises(DTypeError, match="max_positions"):
        decoder(family, max_positions=2.5)


def _positions_reach(limit: int):
    """A decode or prefill call that feeds a position >= limit."""
    def when(*args):
        if len(args) == 2:                     # decode(tokens, lens)
            return int(np.max(args[1])) >= limit
        tokens, num_past = args[0], args[1]    # prefill(tokens, num_past, past)
        return num_past + len(tokens) - 1 >= limit
    return when


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_that_always_fails_in_decode_ends_alone(family):
    """The culprit is decoded in batches with others: each failed batch step
    is retried request by request, and only the culprit fails."""
    dec = decoder(family)
    culprit = list(range(1, 31))                       # positions 30.. only for it
    raised = poison(dec._runner, "decode", _positions_reach(33))
    others = PROMPTS[:3]
    rids = [dec.add_request(p, max_new_tokens=NEW) for p in others]
    bad = dec.add_request(culprit, max_new_tokens=NEW)
    errors = run_all(dec)
    assert list(errors) == [bad] and len(raised) == 2   # the batch, then it alone
    err = errors[bad]
    assert isinstance(err, RequestFailed) and isinstance(err, RuntimeError)
    assert err.request_id == bad and isinstance(err.__cause__, RuntimeError)
    assert f"request {bad}" in str(err) and "injected failure of decode" in str(err)
    status = dec.status(bad)
    # a prefill (positions 0..29) and decode steps at positions 30, 31, 32
    assert status == RequestStatus(bad, True, "error", 30, 0, 4, err)
    # its tokens until the failure are those of a full recompute
    assert dec.pop_output(bad) == ref(family).tokens(culprit, 4)
    for rid, p in zip(rids, others):
        assert dec.status(rid).finish_reason == "length"
        assert dec.pop_output(rid) == ref(family).tokens(p, NEW)
    assert dec.stats["num_failed_requests"] == 1
    assert_idle(dec)
    serves_new_requests(dec, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_whose_prefill_fails_is_not_retried(family):
    dec = decoder(family)
    raised = poison(dec._runner, "prefill", _positions_reach(30))
    bad = dec.add_request(list(range(1, 41)), max_new_tokens=NEW)
    good = dec.add_request(PROMPTS[4], max_new_tokens=NEW)
    events = dec.step()
    assert set(events.errors) == {bad} and bad in events.finished and good in events
    run_all(dec)
    assert len(raised) == 1                   # once: never tried again
    assert dec.status(bad).finish_reason == "error" and dec.pop_output(bad) == []
    assert dec.pop_output(good) == ref(family).tokens(PROMPTS[4], NEW)
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_raises_request_failed_and_leaves_nothing(family):
    dec = decoder(family)
    raised = poison(dec._runner, "prefill", _positions_reach(30))
    bystander = dec.add_request(PROMPTS[5], max_new_tokens=NEW)   # not of the call
    with pytest.raises(RequestFailed) as info:
        dec.generate(PROMPTS[:2] + [list(range(1, 41))] + PROMPTS[2:4], max_new_tokens=NEW)
    assert len(raised) == 1 and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RequestNotFound):
        dec.status(info.value.request_id)
    # none of the call's requests is left; the bystander still runs to its end
    assert dec.stats["num_running"] + dec.stats["num_waiting"] <= 1
    run_all(dec)
    assert dec.pop_output(bystander) == ref(family).tokens(PROMPTS[5], NEW)
    assert_idle(dec)
    serves_new_requests(dec, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transient_model_failure_mid_generate_changes_no_token(family):
    dec = decoder(family)
    raised = poison(dec._runner, "decode", lambda t, lens: len(t) > 1, times=1)
    prompts = PROMPTS[:4]
    assert dec.generate(prompts, max_new_tokens=NEW) == \
        [ref(family).tokens(p, NEW) for p in prompts]
    assert raised and dec.stats["num_batch_failures"] == 1
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_interrupt_inside_generate_leaves_nothing(family):
    dec = decoder(family)
    poison(dec._runner, "decode", lambda t, lens: True, exc=KeyboardInterrupt, times=1)
    with pytest.raises(KeyboardInterrupt):
        dec.generate(PROMPTS[:3], max_new_tokens=NEW)
    assert_idle(dec)
    serves_new_requests(dec, family)


def test_status_and_step_events_report_every_finish():
    family = "optimum"
    dec = decoder(family, eos_token_id=ref(family).tokens(PROMPTS[1], NEW)[2])
    dec.generate([PROMPTS[0]], max_new_tokens=2)       # the system prompt's pages cached
    stop = dec.add_request(PROMPTS[1], max_new_tokens=NEW)
    length = dec.add_request(PROMPTS[4], max_new_tokens=3, eos_token_id=[])
    gone = dec.add_request(PROMPTS[5], max_new_tokens=NEW)
    assert dec.status(stop) == RequestStatus(stop, False, None, len(PROMPTS[1]), 0, 0, None)
    seen: dict = {}
    dec.step()
    dec.abort(gone)
    while dec.has_unfinished_requests() or not seen.get(gone):
        events = dec.step()
        for rid in events.finished:
            seen[rid] = dec.status(rid).finish_reason
        if not dec.has_unfinished_requests() and gone in seen:
            break
    assert seen == {stop: "stop", length: "length", gone: "abort"}
    st = dec.status(stop)
    assert st.num_cached_tokens == len(SYSTEM)     # full pages and the partial one
    assert st.num_generated_tokens == 3 and st.error is None
    assert dec.status(length).num_generated_tokens == 3


def test_generate_leaves_the_finishes_of_other_requests_to_the_next_step():
    family = "gqa"
    dec = decoder(family)
    other = dec.add_request(PROMPTS[4], max_new_tokens=2)
    assert dec.generate([PROMPTS[1]], max_new_tokens=NEW) == \
        [ref(family).tokens(PROMPTS[1], NEW)]
    assert dec.is_finished(other)
    assert dec.step().finished == {other}
    assert dec.pop_output(other) == ref(family).tokens(PROMPTS[4], 2)
    assert_idle(dec)


# ------------------------------------------------- bug 2: the caller's array


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reused_prompt_buffer_changes_nothing(family):
    dec = decoder(family)
    buf = np.array(PROMPTS[1], dtype=np.int64)          # what tokenizers return
    rid = dec.add_request(buf, max_new_tokens=NEW)
    buf[:] = 300                                        # outside the vocabulary
    buf2 = np.array(PROMPTS[2], dtype=np.int64)
    rid2 = dec.add_request(buf2, max_new_tokens=NEW)
    buf2[:] = PROMPTS[3][:len(buf2)]
    run_all(dec)
    assert dec.pop_output(rid) == ref(family).tokens(PROMPTS[1], NEW)
    assert dec.pop_output(rid2) == ref(family).tokens(PROMPTS[2], NEW)


def test_as_tokens_never_returns_the_callers_memory():
    from pagedkv_np.tokens import as_tokens
    for arr in (np.arange(5, dtype=np.int64), np.arange(500, dtype=np.int64),
                np.arange(5, dtype=np.int32), np.arange(10, dtype=np.int64)[::2]):
        out = as_tokens(arr)
        assert not np.shares_memory(out, arr) and out.tolist() == arr.tolist()


# -------------------------------------------- bug 4: a failure inside admit


@pytest.mark.parametrize("family", FAMILIES)
def test_a_memory_error_while_admitting_a_cached_prefix_ends_that_request(family):
    dec = decoder(family)
    dec.generate([PROMPTS[0]], max_new_tokens=2)        # cache the system prompt
    raised = poison(dec.cache, "gather", lambda *a, **k: True, exc=MemoryError, times=1)
    rid = dec.add_request(PROMPTS[1], max_new_tokens=NEW)    # admitted with a prefix hit
    errors = run_all(dec)
    assert raised and list(errors) == [rid]
    assert isinstance(errors[rid].__cause__, MemoryError)
    assert dec.is_finished(rid) and dec.pop_output(rid) == []
    assert_idle(dec)
    serves_new_requests(dec, family)


@pytest.mark.parametrize("family", FAMILIES)
# (a prompt admitted alone writes nothing while admitted: its buffers become its
# decode buffers, written when its batch ends; tests/test_prefill_memory.py)
@pytest.mark.parametrize("point", ["gather", "extend", "plan"])
def test_an_interrupt_while_admitting_keeps_the_request_queued(family, point):
    dec = decoder(family)
    dec.generate([PROMPTS[0]], max_new_tokens=2)
    raised = poison(dec.cache, point, lambda *a, **k: True, exc=KeyboardInterrupt, times=1)
    rid = dec.add_request(PROMPTS[1], max_new_tokens=NEW)
    with pytest.raises(KeyboardInterrupt):
        dec.step()
    assert raised and not dec.is_finished(rid) and dec.has_unfinished_requests()
    assert dec.stats["pages_used"] == 0
    dec.cache.check_invariants()
    run_all(dec)
    assert dec.pop_output(rid) == ref(family).tokens(PROMPTS[1], NEW)
    assert_idle(dec)


# ------------------------------------- every point of a step, both families

POINTS = ["model", "gather", "extend", "extend_batch", "plan", "write", "sampling"]
SPECS = [(p, NEW, (i % 2) * 0.8, 100 + i) for i, p in enumerate(PROMPTS)]


def _targets(dec: OrtDecoder, point: str) -> list[tuple[object, str]]:
    """The (object, method) pairs a failure at ``point`` goes through."""
    if point == "model":
        names = ["run"] + (["run_with_iobinding"] if dec.io.family == "gqa" else [])
        return [(dec.session, n) for n in names]
    if point == "sampling":
        return [(Request, "choose")]
    return [(dec.cache, point)]


def _inject(dec: OrtDecoder, point: str, when, exc, monkeypatch) -> list:
    """Make ``point`` raise ``exc`` on the calls for which ``when()`` holds."""
    raised: list = []
    for obj, name in _targets(dec, point):
        real = getattr(obj, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            if when():
                raised.append(_name)
                raise exc(f"injected failure of {_name}")
            return _real(*args, **kwargs)
        monkeypatch.setattr(obj, name, wrapped)
    return raised


def _busy_decoder(family: str) -> OrtDecoder:
    """A small pool (preemptions), batches of 3 and writes every 3 steps, with
    the system prompt cached (prefix gathers)."""
    dec = decoder(family, max_batch_size=3, write_interval=3, num_pages=24)
    dec.generate([PROMPTS[0]], max_new_tokens=2)
    return dec


def _add_specs(dec: OrtDecoder) -> list[int]:
    # greedy and seeded sampled requests: sampling is called in every step
    return [dec.add_request(p, max_new_tokens=n, temperature=t, seed=s)
            for p, n, t, s in SPECS]


def _expected(family: str, spec) -> list[int]:
    p, n, t, s = spec
    return ref(family).tokens(p, n, s if t else None, t)


_NUM_CALLS: dict = {}


def _num_calls(family: str, point: str, monkeypatch) -> int:
    """How many times a clean run of the workload calls ``point``."""
    if (family, point) not in _NUM_CALLS:
        with monkeypatch.context() as m:
            dec = _busy_decoder(family)
            calls: list = []
            _inject(dec, point, lambda: calls.append(1) and False, RuntimeError, m)
            _add_specs(dec)
            run_all(dec)
        _NUM_CALLS[family, point] = len(calls)
    return _NUM_CALLS[family, point]


def _nth(n: int):
    count: list = []
    return lambda: count.append(1) or len(count) == n


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_failure_at_any_point_of_a_step_is_contained(family, point, which, monkeypatch):
    total = _num_calls(family, point, monkeypatch)
    assert total >= 3
    n = {"first": 1, "middle": (total + 1) // 2, "last": total}[which]
    dec = _busy_decoder(family)
    raised = _inject(dec, point, _nth(n), RuntimeError, monkeypatch)
    rids = _add_specs(dec)
    errors = run_all(dec)
    assert len(raised) == 1
    assert len(errors) <= 1                       # one failure ends one request at most
    for rid, spec in zip(rids, SPECS):
        status, out = dec.status(rid), dec.pop_output(rid)
        if rid in errors:
            assert status.finish_reason == "error" and status.error is errors[rid]
            assert isinstance(status.error.__cause__, RuntimeError)
            assert out == _expected(family, spec)[:len(out)]
        else:
            assert status.finish_reason == "length" and out == _expected(family, spec)
    monkeypatch.undo()
    assert_idle(dec)
    serves_new_requests(dec, family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("which", ["first", "middle"])
def test_an_interrupt_at_any_point_of_a_step_loses_no_request(family, point, which,
                                                              monkeypatch):
    total = _num_calls(family, point, monkeypatch)
    n = {"first": 1, "middle": (total + 1) // 2}[which]
    dec = _busy_decoder(family)
    raised = _inject(dec, point, _nth(n), KeyboardInterrupt, monkeypatch)
    rids = _add_specs(dec)
    interrupted = 0
    while dec.has_unfinished_requests():
        try:
            dec.step()
        except KeyboardInterrupt:
            interrupted += 1
            dec.cache.check_invariants()
    assert interrupted == len(raised) == 1
    for rid, spec in zip(rids, SPECS):
        assert dec.pop_output(rid) == _expected(family, spec)
    monkeypatch.undo()
    assert_idle(dec)


# -------------------------------------- bug 6: every error is a PagedKVError


def _cache(backend) -> pk.PagedKVCache:
    cache = pk.PagedKVCache(1, 8, 4, 1, 2, backend=backend)
    seq = cache.add_sequence([1, 2, 3])
    cache.extend(seq, [1, 2, 3])
    return cache


def _ort_calls():
    m = model("optimum")
    return [
        ("salt-surrogate", lambda d, c, p: d.add_request([1], 2, salt="\ud800"),
         ConfigError, "salt"),
        ("abort-list", lambda d, c, p: d.abort([1]), DTypeError, "request_id"),
        ("is-finished-dict", lambda d, c, p: d.is_finished({}), DTypeError, "request_id"),
        ("pop-output-list", lambda d, c, p: d.pop_output([1]), DTypeError, "request_id"),
        ("status-str", lambda d, c, p: d.status("1"), DTypeError, "request_id"),
        ("status-unknown", lambda d, c, p: d.status(10**6), RequestNotFound, "request_id"),
        ("seed-generator", lambda d, c, p: d.add_request(
            [1], 2, temperature=1.0, seed=np.random.default_rng(0)), DTypeError, "seed"),
        ("gather-huge", lambda d, c, p: c.gather(0, p, num_positions=10**15),
         AllocationError, "num_positions"),
        ("gather-past-int64", lambda d, c, p: c.gather(0, p, num_positions=2**63),
         ConfigError, "num_positions"),
        ("cache-too-large", lambda d, c, p: pk.PagedKVCache(10**4, 10**6, 4, 8, 128,
                                                             backend=c.backend),
         AllocationError, "num_pages"),
        ("cache-past-int64", lambda d, c, p: pk.PagedKVCache(10**9, 10**8, 16, 64, 256,
                                                              backend=c.backend),
         ConfigError, "num_pages"),
        ("model-empty-bytes", lambda d, c, p: OrtDecoder(b""), UnsupportedModelError,
         "model"),
        ("session-options-str", lambda d, c, p: OrtDecoder(m, session_options="x"),
         DTypeError, "session_options"),
        ("providers-str", lambda d, c, p: OrtDecoder(m, providers="CPUExecutionProvider"),
         DTypeError, "providers"),
        ("providers-unknown", lambda d, c, p: OrtDecoder(m, providers=["NoSuchProvider"]),
         ConfigError, "providers"),
        ("kv-heads-str", lambda d, c, p: OrtDecoder(m, num_kv_heads="2"), DTypeError,
         "num_kv_heads"),
        ("head-dim-negative", lambda d, c, p: OrtDecoder(m, head_dim=-1), ConfigError,
         "head_dim"),
        ("eos-str", lambda d, c, p: d.add_request([1], 2, eos_token_id="2"), DTypeError,
         "eos_token_id"),
        # numbers too long for Python's int -> str limit still give their message
        ("max-new-huge", lambda d, c, p: d.add_request([1], 10**5000), ConfigError,
         "max_new_tokens"),
        ("max-new-huge-negative", lambda d, c, p: d.add_request([1], -(10**5000)),
         ConfigError, "max_new_tokens"),
        ("temperature-huge", lambda d, c, p: d.add_request([1], 2, temperature=10**5000),
         ConfigError, "temperature"),
        ("top-p-huge", lambda d, c, p: d.add_request([1], 2, top_p=10**5000), ConfigError,
         "top_p"),
        ("status-huge", lambda d, c, p: d.status(10**5000), RequestNotFound, "request_id"),
        ("layout-huge", lambda d, c, p: OrtDecoder(m, layout=10**5000), pk.LayoutError,
         "layout"),
        ("kv-heads-huge", lambda d, c, p: OrtDecoder(m, num_kv_heads=10**5000),
         UnsupportedModelError, "past_key_values"),
        ("generate-0d-array", lambda d, c, p: d.generate(np.array(1), 2), DTypeError,
         "prompts"),
        ("family-array", lambda d, c, p: OrtDecoder(m, family=np.array([1, 2])),
         UnsupportedModelError, "family"),
        ("backend-array", lambda d, c, p: OrtDecoder(m, backend=np.array([1, 2])),
         ConfigError, "backend"),
        ("prefix-caching-array",
         lambda d, c, p: OrtDecoder(m, enable_prefix_caching=np.array([1, 2])), DTypeError,
         "enable_prefix_caching"),
        ("cache-flag-array", lambda d, c, p: pk.PagedKVCache(
            1, 8, 4, 1, 2, partial_page_reuse=np.array([1, 2])), DTypeError,
         "partial_page_reuse"),
        ("cache-backend-array", lambda d, c, p: pk.PagedKVCache(
            1, 8, 4, 1, 2, backend=np.array([1, 2])), ConfigError, "backend"),
        ("cache-layers-huge", lambda d, c, p: pk.PagedKVCache(10**5000, 8, 4, 1, 2),
         ConfigError, "num_pages"),
        ("gather-layer-huge", lambda d, c, p: c.gather(10**5000, p), pk.PageIdError,
         "layer"),
        ("write-layer-huge", lambda d, c, p: c.write(-(10**5000), p, np.zeros((3, 1, 2),
                                                                              np.float32),
                                                     np.zeros((3, 1, 2), np.float32)),
         pk.PageIdError, "layer"),
        ("gather-positions-negative-huge",
         lambda d, c, p: c.gather(0, p, num_positions=-(10**5000)), pk.ShapeError,
         "num_positions"),
    ]


# The calls on the cache (and the cache constructions sized by it) run on each
# backend; the engine's calls, which do not depend on it, on NumPy only.
_CACHE_CALLS = ("gather-huge", "gather-past-int64", "cache-too-large", "cache-past-int64",
                "gather-layer-huge", "write-layer-huge", "gather-positions-negative-huge")


def _malformed_params() -> list:
    params, cases = [], _ort_calls()
    assert set(_CACHE_CALLS) <= {case[0] for case in cases}
    for case in cases:
        if case[0] in _CACHE_CALLS:
            params += [pytest.param(*case, b, id=f"{case[0]}-{b}") for b in CACHE_BACKENDS]
        else:
            params.append(pytest.param(*case, "numpy", id=case[0]))
    return params


@pytest.mark.parametrize("name, call, error, names, cache_backend", _malformed_params(),
                         indirect=["cache_backend"])
def test_malformed_calls_raise_a_typed_error_and_change_nothing(name, call, error, names,
                                                                cache_backend):
    dec = decoder("optimum")
    done = dec.add_request([1, 2, 3], 1)
    dec.add_request([4, 5, 6, 7], 5)
    dec.step()
    assert dec.is_finished(done)
    cache = _cache(cache_backend)
    plan = cache.plan(list(cache._live.values()))
    before = (deep_state(dec), deep_state(cache))
    with pytest.raises(PagedKVError) as info:
        call(dec, cache, plan)
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    assert names in str(info.value)
    assert (deep_state(dec), deep_state(cache)) == before


def test_a_huge_int_salt_is_a_salt_of_its_own(cache_backend):
    cache = pk.PagedKVCache(1, 16, 4, 1, 2, backend=cache_backend)
    for salt in (10**5000, 10**5000 + 1, -(10**5000)):
        seq = cache.add_sequence([1, 2, 3, 4, 5, 6], salt=salt)
        cache.extend(seq, [1, 2, 3, 4, 5, 6])
        plan = cache.plan([seq])
        kv = np.ones((6, 1, 2), np.float32)
        cache.write(0, plan, kv, kv)
        cache.release(seq)
    again = cache.add_sequence([1, 2, 3, 4, 5, 6], salt=10**5000)
    assert again.num_cached_tokens == 5        # its own pages, the others' not mixed in
    other = cache.add_sequence([1, 2, 3, 4, 5, 6], salt=10**5000 + 2)
    assert other.num_cached_tokens == 0


def test_the_engine_fuzz_script_runs_clean(capsys):
    """scripts/fuzz_engine.py (run by CI for a bounded time) on a short budget."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_engine.py"
    spec = importlib.util.spec_from_file_location("fuzz_engine", path)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    assert fuzz.main(["--seconds", "2", "--seed", "7"]) == 0
    summary = capsys.readouterr().out
    assert "fuzz_engine: " in summary and " 0 wrong tokens, 0 leftover pages" in summary
    assert Request.choose is CHOOSE           # the sampler is restored
