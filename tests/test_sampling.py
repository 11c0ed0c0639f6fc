"""``sample``: every temperature that ``SamplingParams`` accepts gives a valid
token from a finite distribution, and a temperature too small to tell the best
logit from the next one (down to the smallest subnormal double) gives the
argmax, as greedy would."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_np.onnxruntime.sampling import SamplingParams, distribution, sample

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
