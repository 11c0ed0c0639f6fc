"""What a request may ask of OrtDecoder (request_api.py): penalties, logit
bias, end tokens, log-probabilities and n continuations of one prompt,
against a no-cache full recompute of the same ONNX model with the penalties,
masks and log-softmax written out here from their formulas."""

from __future__ import annotations

import collections
import math

import numpy as np
import onnxruntime as ort
import pytest

from pagedkv_np import ConfigError, DTypeError
from pagedkv_np.onnxruntime import OrtDecoder, SamplingParams
from pagedkv_np.onnxruntime.sampling import sample
from pagedkv_np.models.testmodel import DecoderConfig, build_model

from helpers import full_recompute_logits

CONFIG = DecoderConfig()              # vocab 256
PAGE = 8
NEW = 24
_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (13, 5, 21)]
LONG = _rng.integers(0, CONFIG.vocab_size, 45).tolist()   # 5 pages and 5 tokens
HOT = 8.0    # this model's logits span about 190: a temperature that varies its draws

_MODEL: list = []
_SESSION: list = []


def model() -> bytes:
    if not _MODEL:
        _MODEL.append(build_model(CONFIG).SerializeToString())
        _SESSION.append(ort.InferenceSession(_MODEL[0], providers=["CPUExecutionProvider"]))
    return _MODEL[0]


def decoder(**kw) -> OrtDecoder:
    kw.setdefault("num_pages", 128)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    return OrtDecoder(model(), **kw)


GREEDY = SamplingParams()


def reference(prompt, n=NEW, *, params=GREEDY, seed=None, eos=(), min_tokens=0):
    """Tokens and per-token log-softmax rows, recomputing the whole sequence
    every token and applying bias, repetition, presence / frequency and the
    min_tokens mask by hand (in sampling.py's order)."""
    model()
    rng = None if params.greedy else np.random.default_rng(seed)
    bias = dict(params.logit_bias)
    out, rows = [], []
    for i in range(n):
        row = full_recompute_logits(_SESSION[0], prompt + out).astype(np.float64)
        for t, b in bias.items():
            row[t] += b
        p = params.repetition_penalty
        for t in set(prompt + out):
            row[t] = row[t] / p if row[t] > 0 else row[t] * p
        for t, c in collections.Counter(out).items():
            row[t] -= params.presence_penalty + params.frequency_penalty * c
        if i < min_tokens:
            for t in eos:
                row[t] = -math.inf
        m = row.max()
        rows.append(row - (m + math.log(np.exp(row - m).sum())))
        tok = int(np.argmax(row)) if params.greedy else sample(row, params, rng)
        out.append(tok)
        if tok in eos:
            break
    return out, rows


def run(dec: OrtDecoder, rids: list[int]) -> dict:
    """Step until done; every step's tokens and logprobs, per request."""
    tokens: dict = collections.defaultdict(list)
    logprobs: dict = collections.defaultdict(list)
    while dec.has_unfinished_requests():
        events = dec.step()
        for rid, new in events.items():
            tokens[rid].extend(new)
        for rid, entries in events.logprobs.items():
            logprobs[rid].extend(entries)
    for rid in rids:
        assert tokens[rid] == dec.get_output(rid)
    return {"tokens": tokens, "logprobs": logprobs}


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(logit_bias={3: 4.0, 200: -100.0}, presence_penalty=-0.5),
    dict(repetition_penalty=0.7, presence_penalty=0.3, frequency_penalty=-0.2,
         logit_bias={17: 1.5}),
]


@pytest.mark.parametrize("options", PENALTIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_equal_full_recompute(options, temperature):
    dec = decoder()
    params = SamplingParams(temperature=temperature, top_k=40, **options)
    seeds = np.random.SeedSequence(5).spawn(len(PROMPTS))
    outs = dec.generate(PROMPTS, NEW, temperature=temperature, top_k=40, seed=5, **options)
    refs = [reference(p, params=params, seed=s)[0] for p, s in zip(PROMPTS, seeds)]
    assert outs == refs
    # the penalties changed something (else this test would prove nothing)
    plain = [reference(p, params=SamplingParams(temperature=temperature, top_k=40), seed=s)[0]
             for p, s in zip(PROMPTS, seeds)]
    assert outs != plain


@pytest.mark.parametrize("temperature, options", [(0.0, {}), (1.0, {}),
                                                  (0.0, PENALTIES[3]), (0.8, PENALTIES[1])])
def test_logprobs_are_the_log_softmax_of_full_recompute(temperature, options):
    dec = decoder()
    seeds = np.random.SeedSequence(9).spawn(len(PROMPTS))
    rids = [dec.add_request(p, NEW, temperature=temperature, seed=s, logprobs=5, **options)
            for p, s in zip(PROMPTS, seeds)]
    plain = dec.add_request(PROMPTS[0], NEW)
    got = run(dec, rids + [plain])
    params = SamplingParams(temperature=temperature, **options)
    for rid, prompt, seed in zip(rids, PROMPTS, seeds):
        tokens, rows = reference(prompt, params=params, seed=seed)
        entries = dec.get_logprobs(rid)
        assert got["tokens"][rid] == tokens
        assert got["logprobs"][rid] == entries and len(entries) == len(tokens)
        for entry, token, row in zip(entries, tokens, rows):
            assert entry.token == token
            assert entry.logprob == pytest.approx(row[token], abs=1e-4)
            best = np.argsort(-row, kind="stable")[:5]
            assert [i for i, _ in entry.top] == best.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(row[best], abs=1e-4)
            assert entry.logprob <= entry.top[0][1] + 1e-12
    assert plain not in got["logprobs"]
    with pytest.raises(ConfigError, match="logprobs"):
        dec.get_logprobs(plain)


def test_logit_bias_favours_and_bans_tokens():
    dec = decoder()
    # this model's logits span about 190, so +100 favours 7 without forcing it
    favoured = dec.generate([PROMPTS[0]], 6, logit_bias={7: 100})[0]
    assert favoured == reference(PROMPTS[0], 6, params=SamplingParams(logit_bias={7: 100}))[0]
    assert favoured.count(7) >= 2 and 7 not in reference(PROMPTS[0], 6)[0]
    greedy = reference(PROMPTS[0], 6)[0]
    banned = dec.generate([PROMPTS[0]], 6, logit_bias={greedy[0]: -100})[0]
    assert banned[0] != greedy[0]


def _first_new(tokens: list[int], start: int) -> int:
    """An index >= start whose token does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_end_tokens_stop_tokens_ignore_eos_and_min_tokens():
    prompt = PROMPTS[0]
    greedy = reference(prompt, NEW)[0]
    k = _first_new(greedy, 4)
    end = greedy[k]
    dec = decoder(eos_token_id=end)
    a = dec.add_request(prompt, NEW)
    b = dec.add_request(prompt, NEW, ignore_eos=True)
    c = dec.add_request(prompt, NEW, ignore_eos=True, stop_token_ids=[end])
    d = dec.add_request(prompt, NEW, eos_token_id=[], stop_token_ids=end)
    got = run(dec, [a, b, c, d])["tokens"]
    assert got[a] == got[c] == got[d] == greedy[:k + 1]
    assert got[b] == greedy
    assert [dec.status(r).finish_reason for r in (a, b, c, d)] == ["stop", "length", "stop",
                                                                    "stop"]
    # min_tokens: the end token is masked for the first k + 3 tokens
    min_tokens = k + 3
    masked = reference(prompt, NEW, eos=(end,), min_tokens=min_tokens)[0]
    assert masked[:k] == greedy[:k] and masked[k] != end
    e = dec.add_request(prompt, NEW, min_tokens=min_tokens)
    assert run(dec, [e])["tokens"][e] == masked
    assert end not in masked[:min_tokens]


def test_a_plain_request_is_unchanged_by_its_batch():
    alone = decoder()
    want = alone.generate([PROMPTS[1]], NEW, temperature=0.7, seed=3)[0]
    dec = decoder()
    others = [dec.add_request(PROMPTS[0], NEW, logprobs=20, repetition_penalty=1.5),
              dec.add_request(PROMPTS[2], NEW, temperature=1.2, seed=1, min_p=0.1,
                              frequency_penalty=1.0, logit_bias={5: 2.0})]
    rid = dec.add_request(PROMPTS[1], NEW, temperature=0.7,
                          seed=np.random.SeedSequence(3).spawn(1)[0])
    assert run(dec, others + [rid])["tokens"][rid] == want


@pytest.mark.parametrize("options, error, field", [
    (dict(min_p=2.0), ConfigError, "min_p"),
    (dict(presence_penalty="1"), DTypeError, "presence_penalty"),
    (dict(frequency_penalty=3.0), ConfigError, "frequency_penalty"),
    (dict(repetition_penalty=0), ConfigError, "repetition_penalty"),
    (dict(logit_bias={256: 1.0}), ConfigError, "logit_bias"),
    (dict(logit_bias={1: 101}), ConfigError, "logit_bias"),
    (dict(stop_token_ids=[256]), ConfigError, "stop_token_ids"),
    (dict(stop_token_ids=["a"]), DTypeError, "stop_token_ids"),
    (dict(stop_token_ids=-1), ConfigError, "stop_token_ids"),
    (dict(ignore_eos=1), DTypeError, "ignore_eos"),
    (dict(min_tokens=-1), ConfigError, "min_tokens"),
    (dict(min_tokens=NEW + 1), ConfigError, "min_tokens"),
    (dict(min_tokens=1.0), DTypeError, "min_tokens"),
    (dict(logprobs=21), ConfigError, "logprobs"),
    (dict(logprobs=-1), ConfigError, "logprobs"),
    (dict(logprobs=True), DTypeError, "logprobs"),
    (dict(constraint="json"), DTypeError, "constraint"),
])
def test_bad_options_raise_typed_errors_and_queue_nothing(options, error, field):
    dec = decoder()
    with pytest.raises(error, match=field):
        dec.add_request(PROMPTS[0], NEW, **options)
    with pytest.raises(error, match=field):
        dec.generate(PROMPTS, NEW, **options)
    with pytest.raises(error, match=field):
        dec.add_parallel_requests(PROMPTS[0], 2, NEW, **options)
    assert not dec.has_unfinished_requests() and dec.stats["num_waiting"] == 0
    assert dec.step() == {}


# ------------------------------------------------------------- n continuations
def _peak_pages(dec: OrtDecoder, rids: list[int]) -> tuple[dict, int]:
    tokens: dict = collections.defaultdict(list)
    peak = 0
    while dec.has_unfinished_requests():
        for rid, new in dec.step().items():
            tokens[rid].extend(new)
        peak = max(peak, dec.stats["pages_used"])
    return {r: tokens[r] for r in rids}, peak


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_continuations_share_the_prompt_and_equal_separate_requests(prefix_caching):
    params = SamplingParams(temperature=HOT, top_k=50)
    separate = decoder(enable_prefix_caching=prefix_caching)
    seeds = np.random.SeedSequence(21).spawn(4)
    rids = [separate.add_request(LONG, 16, temperature=HOT, top_k=50, seed=s) for s in seeds]
    want, separate_peak = _peak_pages(separate, rids)
    dec = decoder(enable_prefix_caching=prefix_caching)
    rids = dec.add_parallel_requests(LONG, 4, 16, temperature=HOT, top_k=50, seed=21)
    got, peak = _peak_pages(dec, rids)
    assert list(got.values()) == list(want.values())
    assert len({tuple(t) for t in got.values()}) == 4
    assert list(got.values()) == [reference(LONG, 16, params=params, seed=s)[0] for s in seeds]
    # the prompt was computed once
    assert dec.stats["num_prefills"] == 1 and separate.stats["num_prefills"] == 4
    assert dec.stats["prefix_query_tokens"] == len(LONG)
    assert [dec.status(r).num_prompt_tokens for r in rids] == [45] * 4
    if not prefix_caching:
        # 4 x 8 pages apart; 5 shared + 4 x 3 (the copied last prompt page, then 2 new)
        assert (peak, separate_peak) == (17, 32)
    else:
        # as many pages (separate requests share the full ones through the
        # index), but the last partial page is computed once, not 4 times
        assert peak == separate_peak == 17
        computed = [d.stats["prefix_query_tokens"] - d.stats["prefix_hit_tokens"]
                    for d in (dec, separate)]
        assert computed == [45, 45 + 3 * 5]


def test_n_continuations_survive_preemption():
    prompt = LONG[:20]
    kw = dict(temperature=HOT, seed=4)
    want = decoder().generate([prompt] * 4, 30, **kw)
    dec = decoder(num_pages=12)      # 4 x 7 pages do not fit: some are preempted
    rids = dec.add_parallel_requests(prompt, 4, 30, **kw)
    got, _ = _peak_pages(dec, rids)
    assert list(got.values()) == want
    assert dec.stats["num_preemptions"] > 0


def test_aborting_the_first_or_another_continuation_before_it_starts():
    prompt = PROMPTS[2]
    kw = dict(temperature=HOT, seed=8)
    want = decoder().generate([prompt] * 3, 10, **kw)
    for victim in (0, 1):
        dec = decoder()
        rids = dec.add_parallel_requests(prompt, 3, 10, **kw)
        dec.abort(rids[victim])
        got, _ = _peak_pages(dec, rids)
        assert dec.status(rids[victim]).finish_reason == "abort"
        assert got[rids[victim]] == []
        for i, rid in enumerate(rids):
            if i != victim:
                assert got[rid] == want[i] and dec.status(rid).finish_reason == "length"
        assert dec.stats["num_prefills"] == 1


def test_n_checks():
    dec = decoder(max_batch_size=3)
    with pytest.raises(ConfigError, match="n"):
        dec.add_parallel_requests(PROMPTS[0], 4)
    with pytest.raises(ConfigError, match="n"):
        dec.add_parallel_requests(PROMPTS[0], 0)
    with pytest.raises(DTypeError, match="n"):
        dec.add_parallel_requests(PROMPTS[0], 2.0)
    assert not dec.has_unfinished_requests()
    # greedy continuations are all the greedy answer
    rids = dec.add_parallel_requests(PROMPTS[0], 3, 8)
    got, _ = _peak_pages(dec, rids)
    assert list(got.values()) == [reference(PROMPTS[0], 8)[0]] * 3


def test_aborting_the_first_continuation_while_its_prompt_is_prefilled():
    prompt = LONG * 3                        # 135 tokens: chunks of 16 beside a decode
    kw = dict(temperature=HOT, seed=3)
    want = decoder().generate([prompt] * 3, 8, **kw)
    dec = decoder(prefill_chunk=16)
    busy = dec.add_request(PROMPTS[0], 40)
    dec.step()
    rids = dec.add_parallel_requests(prompt, 3, 8, **kw)
    for _ in range(3):
        dec.step()
    assert dec.stats["num_prefill_chunks"] >= 3 and dec.get_output(rids[0]) == []
    dec.abort(rids[0])
    got, _ = _peak_pages(dec, [busy] + rids)
    assert got[rids[0]] == [] and dec.status(rids[0]).finish_reason == "abort"
    assert [got[r] for r in rids[1:]] == want[1:]
    assert dec.get_output(busy) == reference(PROMPTS[0], 40)[0]
