"""How much one request may hold: the one rule for the library and the server.

Every token of a request but the last generated one takes a position of the
model and a slot of the page pool, so a request of ``p`` prompt tokens and
``n`` new tokens fits when ``p + n - 1`` is at most the model's positions
(its context length) and at most the pool's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_positive_int, shown
from ..errors import ContextLengthExceeded

__all__ = ["RequestLimits"]


@dataclass(frozen=True)
class RequestLimits:
    """The limits of one decoder.

    Attributes
    ----------
    max_positions : int or None
        The model's positions (graph and configuration), None when unknown.
    num_pages, page_size : int
        The pool.
    """

    max_positions: int | None
    num_pages: int
    page_size: int

    @property
    def pool_tokens(self) -> int:
        """Tokens the page pool holds."""
        return self.num_pages * self.page_size

    @property
    def context_length(self) -> int:
        """The model's positions, or the pool's tokens when the model sets no limit."""
        return self.pool_tokens if self.max_positions is None else self.max_positions

    def room(self, num_prompt_tokens: int) -> int:
        """Most new tokens a request of ``num_prompt_tokens`` can ask for (0:
        the prompt alone does not fit)."""
        prompt = check_positive_int(num_prompt_tokens, "num_prompt_tokens")
        return max(0, min(self.context_length, self.pool_tokens) - prompt + 1)

    def check(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise unless a request of this size fits the model and the pool.

        Raises
        ------
        DTypeError
            An argument is not an integer.
        ConfigError
            An argument is below 1.
        ContextLengthExceeded
            The request does not fit; the message says which setting limits it.
        """
        prompt = check_positive_int(num_prompt_tokens, "num_prompt_tokens")
        new = check_positive_int(max_new_tokens, "max_new_tokens")
        needed = prompt + new - 1
        context, pool = self.context_length, self.pool_tokens
        if needed <= min(context, pool):
            return
        if needed > context and self.max_positions is not None:
            limit = f"context {context:,} positions: the model's limit (max_positions)"
        else:
            limit = (f"the pool's {pool:,} tokens (the pool has {self.num_pages:,} pages "
                     f"of {self.page_size}): raise num_pages")
        raise ContextLengthExceeded(
            f"Invalid prompt: prompt {prompt:,} tokens + max_new_tokens {shown(new)} need "
            f"{shown(needed)} positions (the last new token takes none) > {limit}",
            num_prompt_tokens=prompt, max_new_tokens=new, context_length=min(context, pool))
