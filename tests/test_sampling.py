"""``sample``: every temperature that ``SamplingParams`` accepts gives a valid
token from a finite distribution, and a temperature too small to tell the best
logit from the next one (down to the smallest subnormal double) gives the
argmax, as greedy would."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_np import ConfigError, DTypeError
from pagedkv_np.onnxruntime.requests import Request, StepEvents
from pagedkv_np.onnxruntime.sampling import (SamplingParams, TokenPenalties, distribution,
                                             log_softmax, sample, top_logprobs)

SMALLEST_SUBNORMAL = 5e-324

logit_rows = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1,
                      max_size=40).map(lambda xs: np.asarray(xs, dtype=np.float32))
temperatures = st.one_of(
    st.sampled_from([SMALLEST_SUBNORMAL, 1e-320, 2.2250738585072014e-308, 1e-308, 1e-300,
                     1e-200, 1e-30, 1e-7, 0.5, 1.0, 2.0, 1e30, 1.7976931348623157e308]),
    st.floats(min_value=SMALLEST_SUBNORMAL, max_value=1e308, allow_subnormal=True))


def _gap(logits: np.ndarray) -> float:
    """The best logit minus the second best (inf for one token)."""
    top = np.sort(logits.astype(np.float64))[::-1]
    return float(top[0] - top[1]) if top.shape[0] > 1 else float("inf")


@settings(max_examples=400, deadline=None)
@given(logits=logit_rows, temperature=temperatures, top_k=st.integers(0, 8),
       top_p=st.sampled_from([1.0, 0.9, 0.5, 1e-9]), seed=st.integers(0, 2 ** 32 - 1))
def test_every_temperature_gives_a_valid_token(logits, temperature, top_k, top_p, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no overflow or invalid-value warnings either
        ids, probs = distribution(logits, params)
        token = sample(logits, params, np.random.default_rng(seed))
    assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
    assert probs.sum() == pytest.approx(1.0)
    assert 0 <= token < logits.shape[0]
    assert token in ids[probs > 0]
    # a draw never picks a token below the best one's logit by more than
    # the temperature can bridge
    best = float(logits.max())
    if (best - float(logits[token])) / temperature > 800:
        pytest.fail(f"token {token} has probability exp(-{(best - logits[token]) / temperature})")


@settings(max_examples=300, deadline=None)
@given(logits=logit_rows, temperature=temperatures, seed=st.integers(0, 2 ** 32 - 1))
def test_tiny_temperature_is_greedy(logits, temperature, seed):
    gap = _gap(logits)
    if not gap / temperature > 800:   # exp(-800) is 0 in float64: only the best remains
        return
    params = SamplingParams(temperature=temperature)
    assert sample(logits, params, np.random.default_rng(seed)) == int(np.argmax(logits))


@pytest.mark.parametrize("temperature", [SMALLEST_SUBNORMAL, 1e-320, 1e-308, 1e-300])
def test_tiny_temperature_reported_cases(temperature):
    """Each of these used to overflow to NaN probabilities and return the
    lowest-id positive logit instead of the best one."""
    logits = np.array([1.0, 3.0, 2.0, 5.0, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert sample(logits, SamplingParams(temperature=temperature), rng) == 3


def test_ties_at_a_tiny_temperature_share_the_draw():
    logits = np.array([0.0, 7.0, 7.0, 1.0], dtype=np.float32)
    ids, probs = distribution(logits, SamplingParams(temperature=SMALLEST_SUBNORMAL))
    assert dict(zip(ids.tolist(), probs.tolist())) == {1: 0.5, 2: 0.5, 0: 0.0, 3: 0.0}


def test_huge_logits_do_not_overflow():
    logits = np.array([-3e38, 3e38, 1e38], dtype=np.float32)
    for t in (SMALLEST_SUBNORMAL, 1.0, 1e308):
        ids, probs = distribution(logits, SamplingParams(temperature=t))
        assert np.all(np.isfinite(probs)) and probs.sum() == pytest.approx(1.0)
    assert sample(logits, SamplingParams(temperature=1.0), np.random.default_rng(0)) == 1


# ------------------------------------------------ penalties, bias, min_p, logprobs
# Hand-computed over a vocabulary of 6 (the order and formulas of sampling.py's
# docstring): these numbers are the reference, not the code under test.

LOGITS6 = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
PROMPT6 = np.array([1, 2], dtype=np.int64)
GENERATED6 = [3, 3, 5]


@pytest.mark.parametrize("field, value, error", [
    ("min_p", -0.1, ConfigError), ("min_p", 1.5, ConfigError), ("min_p", "0.1", DTypeError),
    ("presence_penalty", 2.5, ConfigError), ("presence_penalty", None, DTypeError),
    ("frequency_penalty", -2.01, ConfigError), ("frequency_penalty", True, DTypeError),
    ("repetition_penalty", 0.0, ConfigError), ("repetition_penalty", -1.0, ConfigError),
    ("repetition_penalty", float("inf"), ConfigError),
    ("repetition_penalty", float("nan"), ConfigError),
    ("temperature", float("nan"), ConfigError), ("temperature", 10 ** 400, ConfigError),
    ("logit_bias", [(1, 2.0)], DTypeError), ("logit_bias", {"1": 2.0}, DTypeError),
    ("logit_bias", {-1: 2.0}, ConfigError), ("logit_bias", {1: 100.5}, ConfigError),
    ("logit_bias", {1: float("nan")}, ConfigError), ("logit_bias", {1: "x"}, DTypeError),
])
def test_bad_parameters_name_the_field(field, value, error):
    with pytest.raises(error, match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_logit_bias_is_checked_against_the_vocabulary_and_stays_hashable():
    params = SamplingParams(logit_bias={5: 1.0, np.int64(2): -100, 0: 100})
    assert params.logit_bias == ((0, 100.0), (2, -100.0), (5, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias={0: 100, 2: -100, 5: 1}))
    params.check_vocab(6)
    with pytest.raises(ConfigError, match="logit_bias: token id 5"):
        params.check_vocab(5)


def _penalised(params: SamplingParams) -> np.ndarray:
    pen = TokenPenalties(params, PROMPT6)
    for t in GENERATED6:
        pen.add(t)
    row = LOGITS6.astype(np.float64)
    pen.apply(row)
    return row


def test_penalties_by_hand():
    # repetition 2 over {1, 2, 3, 5} (prompt + generated): positive / 2, negative * 2
    assert _penalised(SamplingParams(repetition_penalty=2.0)).tolist() == \
        [2.0, -2.0, 0.25, 1.5, -2.0, 0.5]
    # presence 0.5 and frequency 0.25 over the generated {3: 2, 5: 1} only
    assert _penalised(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)).tolist() == \
        [2.0, -1.0, 0.5, 2.0, -2.0, 0.25]
    # bias first, then repetition, then presence / frequency
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25, logit_bias={0: -1.0, 4: 10.0})
    assert _penalised(params).tolist() == [1.0, -2.0, 0.25, 0.5, 8.0, -0.25]
    # negative penalties reward repeats
    assert _penalised(SamplingParams(presence_penalty=-1.0)).tolist() == \
        [2.0, -1.0, 0.5, 4.0, -2.0, 2.0]


def test_min_p_by_hand():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids, probs = distribution(logits, SamplingParams(temperature=1.0, min_p=0.35))
    assert ids.tolist() == [0, 1] and probs == pytest.approx([0.625, 0.375])
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, min_p=0.11))
    assert ids.tolist() == [0, 1, 2]
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert ids.tolist() == [0]
    # after top_p: the smaller of the two prefixes
    ids, _ = distribution(logits, SamplingParams(temperature=1.0, top_p=0.7, min_p=0.1))
    assert ids.tolist() == [0, 1]


def test_log_softmax_and_top_logprobs_by_hand():
    logits = np.array([0.0, math.log(3.0), -math.inf, math.log(3.0), math.log(1.0)])
    lp = log_softmax(logits)
    # probabilities 1/8, 3/8, 0, 3/8, 1/8
    assert lp[[0, 1, 3, 4]] == pytest.approx(np.log([1 / 8, 3 / 8, 3 / 8, 1 / 8]))
    assert lp[2] == -math.inf
    assert top_logprobs(lp, 2) == [(1, pytest.approx(math.log(3 / 8))),
                                   (3, pytest.approx(math.log(3 / 8)))]
    # the masked token is never an alternative
    assert [i for i, _ in top_logprobs(lp, 5)] == [1, 3, 0, 4]
    assert top_logprobs(lp, 0) == []


def _request(params: SamplingParams, rng=None, **kw) -> Request:
    return Request(PROMPT6, 10, frozenset({4}), params, rng, None, **kw)


def test_greedy_with_penalties_is_deterministic():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={0: -1.0, 4: 10.0})
    chosen = set()
    for _ in range(3):
        req = _request(params)
        events = StepEvents()
        for t in GENERATED6:
            req.accept(t, events)
        chosen.add(req.choose(LOGITS6))
    assert chosen == {4}   # argmax of [1.0, -2.0, 0.25, 0.5, 8.0, -0.25]


def test_min_tokens_masks_the_end_tokens_until_reached():
    logits = np.array([0.0, 0.0, 0.0, 0.0, 9.0, 0.0], dtype=np.float32)   # 4 is the end token
    req = _request(SamplingParams(), min_tokens=2)
    events = StepEvents()
    for _ in range(2):
        token = req.choose(logits)
        assert token == 0          # the best token but the end token, lowest id
        assert req.accept(token, events) is None
    assert req.choose(logits) == 4
    assert req.accept(4, events) == "stop"
    assert events == {-1: [0, 0, 4]}


def test_a_chosen_tokens_logprobs_are_reported_once():
    req = _request(SamplingParams(logit_bias={5: 1.0}), logprobs=2)
    events = StepEvents()
    token = req.choose(LOGITS6)
    assert token == 3
    req.accept(token, events)
    expected = log_softmax(LOGITS6.astype(np.float64) + np.array([0, 0, 0, 0, 0, 1.0]))
    entry = events.logprobs[-1][0]
    assert entry.token == 3 and entry.logprob == pytest.approx(expected[3])
    # logits after the bias: 2, -1, .5, 3, -2, 2 -> 3, then 0 and 5 tied: lowest id
    assert entry.top == [(3, pytest.approx(expected[3])), (0, pytest.approx(expected[0]))]
    assert req.logprob_entries == [entry]
