"""Next-token choice from one row of logits: penalties and biases, greedy or
seeded sampling, and the log-probabilities a request may ask for.

Each request draws from its own ``numpy.random.Generator``, so its tokens do
not depend on which other requests share its batch, nor on being preempted
and recomputed: one draw per generated token, always in the same order.

A row of logits goes through, in this order (vLLM's order)::

    logit_bias          logit[t] += bias[t]
    repetition_penalty  over every distinct token of prompt + generated:
                        logit / p if logit > 0 else logit * p
                        (Hugging Face's and vLLM's rule; llama.cpp's
                        repeat_penalty is the same rule over its last 64 tokens)
    presence_penalty,   over generated tokens only (OpenAI's definition):
    frequency_penalty   logit[t] -= presence * (count[t] > 0) + frequency * count[t]
    masks               end tokens before ``min_tokens``, a grammar's
                        disallowed tokens (the request's, see requests.py):
                        logit = -inf
    choice              greedy argmax, or temperature -> top_k -> top_p ->
                        min_p -> one draw

Log-probabilities are the log-softmax of the row after the masks and before
the temperature and the cuts: what the request's own rules make of the
model's distribution (vLLM's ``logprobs_mode="processed_logprobs"``; vLLM's
default reports the raw model's instead).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, DTypeError
from ..checks import is_int, shown

__all__ = ["SamplingParams", "TokenPenalties", "distribution", "sample", "log_softmax",
           "top_logprobs", "MAX_LOGPROBS"]

#: Most alternatives a request may ask for at each token (OpenAI's and vLLM's limit).
MAX_LOGPROBS = 20


def _check_number(value: Any, name: str, lo: float, hi: float, *, lo_open: bool = False,
                  hi_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DTypeError(f"Invalid {name}: expected a number, got {type(value).__name__}")
    number: Any = value
    try:
        x = float(number)
    except OverflowError:   # an int past float's range
        x = math.inf if number > 0 else -math.inf
    ok = (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not ok or math.isnan(x):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ConfigError(f"Invalid {name}: expected a value in {left}{lo}, {hi}{right}, "
                          f"got {shown(value)}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token.

    ``temperature == 0`` is greedy (argmax, lowest id on ties). Otherwise
    logits are divided by ``temperature``, cut to the ``top_k`` best
    (``0``: no cut), then to the smallest set whose probability reaches
    ``top_p``, then to the tokens whose probability is at least ``min_p``
    times the best one's, and one token is drawn. The penalties and
    ``logit_bias`` change the logits before either (the module docstring
    gives the order and the formulas); greedy stays deterministic with them.

    Attributes
    ----------
    temperature : float, >= 0
    top_k : int, >= 0
    top_p : float, in (0, 1]
    min_p : float, in [0, 1]
    presence_penalty, frequency_penalty : float, in [-2, 2]
        OpenAI's, over generated tokens.
    repetition_penalty : float, > 0
        1 is none; over prompt and generated tokens.
    logit_bias : tuple of (int, float)
        Given as a dict ``{token id: bias}`` (bias in [-100, 100]); kept as
        sorted pairs so that the parameters stay hashable. Ids are checked
        against a vocabulary by :meth:`check_vocab`.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()

    def __post_init__(self) -> None:
        _check_number(self.temperature, "temperature", 0.0, math.inf, hi_open=True)
        if not is_int(self.top_k):
            raise DTypeError(f"Invalid top_k: expected an integer, got {type(self.top_k).__name__}")
        if self.top_k < 0:
            raise ConfigError(f"Invalid top_k: expected >= 0, got {shown(self.top_k)}")
        _check_number(self.top_p, "top_p", 0.0, 1.0, lo_open=True)
        _check_number(self.min_p, "min_p", 0.0, 1.0)
        _check_number(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_number(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_number(self.repetition_penalty, "repetition_penalty", 0.0, math.inf,
                      lo_open=True, hi_open=True)
        object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether a penalty or a bias applies (else the model's logits are used as they are)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`ConfigError` unless every ``logit_bias`` id is below ``vocab_size``."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise ConfigError(f"Invalid logit_bias: token id {self.logit_bias[-1][0]} is "
                              f"outside the model's vocabulary [0, {vocab_size})")


def _parse_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if isinstance(bias, tuple):   # already parsed (dataclasses.replace), or pairs
        items = list(bias)
    elif isinstance(bias, dict):
        items = list(bias.items())
    else:
        raise DTypeError(f"Invalid logit_bias: expected a dict of token id to bias, "
                         f"got {type(bias).__name__}")
    out = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise DTypeError(f"Invalid logit_bias: expected (token id, bias) pairs, "
                             f"got {shown(item)}")
        token, value = item
        if not is_int(token):
            raise DTypeError(f"Invalid logit_bias: token ids must be integers, "
                             f"got {shown(token)}")
        if token < 0:
            raise ConfigError(f"Invalid logit_bias: token id {shown(token)} is negative")
        _check_number(value, f"logit_bias[{int(token)}]", -100.0, 100.0)
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


class TokenPenalties:
    """What the penalties of one request read: the distinct tokens of its
    prompt and generated tokens, and how often each token was generated.

    Kept sparse (a set and a dict): a step touches only the tokens seen, not
    the vocabulary. Tokens are added as they are accepted, so a preempted
    and recomputed request keeps its counts.

    Parameters
    ----------
    params : SamplingParams
    prompt : ndarray, shape [n], int64
    """

    __slots__ = ("params", "_seen", "_seen_ids", "_counts", "_bias_ids", "_bias")

    def __init__(self, params: SamplingParams, prompt: np.ndarray) -> None:
        self.params = params
        self._seen: set[int] = set()
        self._seen_ids: np.ndarray | None = None
        if params.repetition_penalty != 1.0:
            self._seen = set(prompt.tolist())
        self._counts: dict[int, int] = {}
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float64)

    def add(self, token: int) -> None:
        """One more generated token."""
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.params.repetition_penalty != 1.0 and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = None

    def apply(self, row: np.ndarray) -> None:
        """Bias and penalise ``row`` (shape [vocab_size], float64) in place."""
        p = self.params
        if self._bias_ids.shape[0]:
            if int(self._bias_ids[-1]) >= row.shape[0]:
                p.check_vocab(row.shape[0])
            row[self._bias_ids] += self._bias
        if p.repetition_penalty != 1.0 and self._seen:
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(self._seen, np.int64, len(self._seen))
            vals = row[self._seen_ids]
            row[self._seen_ids] = np.where(vals > 0, vals / p.repetition_penalty,
                                           vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a sampled draw chooses from, best first, and their probabilities.

    Logits are shifted by their maximum *before* the division by the
    temperature: every shifted logit is then <= 0, so dividing by any
    temperature (down to the smallest subnormal, 5e-324) gives 0 for the best
    tokens and at worst -inf (probability exactly 0) for the others, never
    inf - inf = NaN. A temperature too small to tell the best logit from the
    next one therefore leaves only the best tokens, as greedy would.

    Parameters
    ----------
    logits : ndarray, shape [vocab_size], float dtype
        Finite, or -inf for masked tokens (at least one finite).
    params : SamplingParams
        Not greedy (``temperature > 0``); its penalties are not applied here.

    Returns
    -------
    ids : ndarray, shape [n], int64
        Tokens in descending order of logit (equal logits: ascending id),
        after the ``top_k``, ``top_p`` and ``min_p`` cuts.
    probs : ndarray, shape [n], float64
        Finite, >= 0, summing to 1; ``probs[0] > 0``.
    """
    row = logits.astype(np.float64)
    with np.errstate(over="ignore"):   # -big / tiny temperature -> -inf: probability 0
        scaled = (row - row.max()) / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        keep = np.argpartition(scaled, -params.top_k)[-params.top_k:]
    else:
        keep = np.arange(scaled.shape[0])
    # stable descending order: equal logits keep ascending ids, so the draw
    # does not depend on argpartition's arbitrary tie order
    keep = keep[np.lexsort((keep, -scaled[keep]))]
    probs = np.exp(scaled[keep])   # scaled[keep[0]] == 0: probs[0] == 1 before normalising
    probs /= probs.sum()
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        keep, probs = keep[:cut], probs[:cut] / probs[:cut].sum()
    if params.min_p > 0.0:
        # probs is descending: the tokens at least min_p times the best are a prefix
        cut = max(1, int(np.count_nonzero(probs >= params.min_p * probs[0])))
        keep, probs = keep[:cut], probs[:cut] / probs[:cut].sum()
    return keep.astype(np.int64, copy=False), probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token from logits that any penalties were applied to.

    Parameters
    ----------
    logits : ndarray, shape [vocab_size], float dtype
    params : SamplingParams
    rng : numpy.random.Generator
        Used (one ``random()`` draw) unless ``params`` is greedy.

    Returns
    -------
    int
        The token id.
    """
    if params.greedy:
        return int(np.argmax(logits))
    keep, probs = distribution(logits, params)
    # rng is None only with greedy params, which returned above
    idx = int(np.searchsorted(np.cumsum(probs), rng.random(),  # type: ignore[union-attr]
                              side="right"))
    # a cumulative sum that rounds below the draw must not reach the
    # zero-probability tail
    return int(keep[min(idx, int(np.flatnonzero(probs)[-1]))])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 [vocab_size]: ``logits - logsumexp(logits)``; -inf stays -inf.

    Parameters
    ----------
    logits : ndarray, shape [vocab_size], float dtype
        At least one finite entry.
    """
    row = logits.astype(np.float64)
    shifted = row - row.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens as ``(id, logprob)``, best first (equal
    logprobs: ascending id); tokens of probability 0 are left out."""
    if k <= 0:
        return []
    k = min(k, logprobs.shape[0])
    ids = np.argpartition(-logprobs, k - 1)[:k]
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return [(int(i), float(logprobs[i])) for i in ids if logprobs[i] > -math.inf]
