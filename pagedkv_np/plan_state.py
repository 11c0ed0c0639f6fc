"""What a cache knows about the plans it built: the index arrays stay data
(:class:`pagedkv_np.plan.Plan`), the bookkeeping lives here.

A :class:`PlanTable` maps each live plan to its :class:`PlanState`; entries
go when their plan is garbage collected, so a cache that builds a plan every
step holds only the plans its callers still hold.
"""

from __future__ import annotations

import weakref
from typing import Any

from .plan import Plan

__all__ = ["PlanState", "PlanTable"]


class PlanState:
    """The cache's record of one plan.

    Parameters
    ----------
    epoch : int
        The cache's epoch when the plan was built.
    seqs : tuple of Sequence
        The plan's sequences, in plan order.
    num_layers : int
        Layers the plan must be written in.
    """

    __slots__ = ("epoch", "seqs", "versions", "discarded", "_written", "_num_written")

    def __init__(self, epoch: int, seqs: tuple, num_layers: int) -> None:
        self.epoch = epoch
        self.seqs = seqs
        self.versions = tuple(s.version for s in seqs)
        self.discarded = False
        self._written = bytearray(num_layers)   # per layer: written yet?
        self._num_written = 0

    def mark_written(self, layer: int) -> bool:
        """Record a written layer; True exactly when the last one arrives."""
        if self._written[layer]:
            return False
        self._written[layer] = 1
        self._num_written += 1
        return self._num_written == len(self._written)

    @property
    def is_written(self) -> bool:
        """Whether every layer has been written through the plan."""
        return 0 < len(self._written) == self._num_written

    def is_current(self) -> bool:
        """Whether none of the plan's sequences reserved or released pages since."""
        return all(s.version == v for s, v in zip(self.seqs, self.versions))


class PlanTable:
    """Plan -> PlanState, holding plans by weak reference."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Plan, PlanState] = weakref.WeakKeyDictionary()

    def add(self, plan: Plan, state: PlanState) -> None:
        self._states[plan] = state

    def get(self, plan: Any) -> PlanState | None:
        """The state of ``plan``, or None for a plan this table does not hold."""
        return self._states.get(plan)

    def __len__(self) -> int:
        return len(self._states)
