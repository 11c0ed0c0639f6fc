"""Next-token choice from one row of logits: greedy, or seeded sampling.

Each request draws from its own ``numpy.random.Generator``, so its tokens do
not depend on which other requests share its batch, nor on being preempted
and recomputed: one draw per generated token, always in the same order.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, DTypeError
from ..checks import is_int, shown

__all__ = ["SamplingParams", "distribution", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token.

    ``temperature == 0`` is greedy (argmax, lowest id on ties). Otherwise
    logits are divided by ``temperature``, cut to the ``top_k`` best
    (``0``: no cut), then to the smallest set whose probability reaches
    ``top_p``, and one token is drawn.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise DTypeError(f"Invalid {name}: expected a number, got {type(value).__name__}")
        if not is_int(self.top_k):
            raise DTypeError(f"Invalid top_k: expected an integer, got {type(self.top_k).__name__}")
        try:
            finite = math.isfinite(self.temperature)
        except OverflowError:   # an int past float's range
            finite = False
        if not (self.temperature >= 0.0 and finite):
            raise ConfigError(f"Invalid temperature: expected a finite value >= 0, "
                              f"got {shown(self.temperature)}")
        if self.top_k < 0:
            raise ConfigError(f"Invalid top_k: expected >= 0, got {shown(self.top_k)}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"Invalid top_p: expected 0 < top_p <= 1, got {shown(self.top_p)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        Finite.
    params : SamplingParams
        Not greedy (``temperature > 0``).

    Returns
    -------
    ids : ndarray, shape [n], int64
        Tokens in descending order of logit (equal logits: ascending id),
        after the ``top_k`` and ``top_p`` cuts.
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
    return keep.astype(np.int64, copy=False), probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token.

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
