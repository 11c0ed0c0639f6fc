"""A Llama-family decoder's geometry and the names and shapes of its weights.

Weight names (``x @ w`` convention, ``w`` is ``[in, out]``)::

    embed [vocab, hidden] (float)      final_norm [hidden]
    lm_head [hidden, vocab]            (absent when tie_word_embeddings)
    l{i}.attn_norm, l{i}.mlp_norm [hidden]
    l{i}.wq [hidden, heads * head_dim]   l{i}.wk, l{i}.wv [hidden, kv_heads * head_dim]
    l{i}.bq, l{i}.bk, l{i}.bv [out]      (only with qkv_bias)
    l{i}.wo [heads * head_dim, hidden]
    l{i}.w_gate, l{i}.w_up [hidden, ffn]  l{i}.w_down [ffn, hidden]
    rope_freqs [head_dim // 2]           (optional: divides each rotary frequency)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from ..checks import check_positive_int
from .gguf.blocks import BlockQuantized

__all__ = ["DecoderGeometry", "Linear", "weight_names", "check_weights"]

#: a linear layer's weight: a float array [in, out] or ggml blocks
Linear = Union[np.ndarray, BlockQuantized]  # noqa: UP007 - a runtime alias; X | Y needs 3.10 objects


@dataclass(frozen=True)
class DecoderGeometry:
    """Sizes of a Llama-family decoder: the one description of a decoder's shape,
    which the graph builder, the GGUF reader and the test model all take.

    ``head_dim`` may differ from ``hidden_size // num_heads``; ``num_heads`` is a
    multiple of ``num_kv_heads``. The defaults are the small test decoder of
    :mod:`pagedkv_np.models.testmodel` (which calls this class ``DecoderConfig``);
    ``head_dim = 0`` stands for ``hidden_size // num_heads`` (which must then
    divide) and ``intermediate_size = 0`` for ``3 * hidden_size``, both filled in
    when the geometry is made.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 4096
    qkv_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_positions"):
            check_positive_int(getattr(self, name), name)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"Invalid hidden_size: {self.hidden_size} is not a multiple "
                                  f"of num_heads = {self.num_heads} (give head_dim)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 3 * self.hidden_size)
        check_positive_int(self.head_dim, "head_dim")
        check_positive_int(self.intermediate_size, "intermediate_size")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"Invalid num_kv_heads: num_heads = {self.num_heads} is not a "
                              f"multiple of {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"Invalid head_dim: {self.head_dim} must be even for rotary "
                              "embedding")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise ConfigError(f"Invalid rope_theta / rms_eps: expected > 0, got "
                              f"{self.rope_theta} / {self.rms_eps}")

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def weight_names(geometry: DecoderGeometry) -> list[str]:
    """The names :func:`build_decoder` needs, in graph order (``rope_freqs`` is optional)."""
    names = ["embed"]
    for i in range(geometry.num_layers):
        names += [f"l{i}.attn_norm", f"l{i}.wq", f"l{i}.wk", f"l{i}.wv"]
        if geometry.qkv_bias:
            names += [f"l{i}.bq", f"l{i}.bk", f"l{i}.bv"]
        names += [f"l{i}.wo", f"l{i}.mlp_norm", f"l{i}.w_gate", f"l{i}.w_up", f"l{i}.w_down"]
    names.append("final_norm")
    if not geometry.tie_word_embeddings:
        names.append("lm_head")
    return names


def _expected_shapes(c: DecoderGeometry) -> dict[str, tuple[int, ...]]:
    h, f, nq, nkv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, \
        c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, h), "final_norm": (h,),
                                          "lm_head": (h, c.vocab_size),
                                          "rope_freqs": (c.head_dim // 2,)}
    for i in range(c.num_layers):
        shapes.update({f"l{i}.attn_norm": (h,), f"l{i}.mlp_norm": (h,), f"l{i}.wq": (h, nq),
                       f"l{i}.wk": (h, nkv), f"l{i}.wv": (h, nkv), f"l{i}.bq": (nq,),
                       f"l{i}.bk": (nkv,), f"l{i}.bv": (nkv,), f"l{i}.wo": (nq, h),
                       f"l{i}.w_gate": (h, f), f"l{i}.w_up": (h, f), f"l{i}.w_down": (f, h)})
    return shapes


def check_weights(c: DecoderGeometry, weights: dict[str, Linear]) -> None:
    """Raise unless ``weights`` has every name of ``c`` with its shape and a usable type.

    Raises
    ------
    ConfigError
        A weight is missing.
    ShapeError, DTypeError
        A weight has the wrong shape, or is neither a float32/float16 array nor
        (for a matrix other than ``embed``) BlockQuantized.
    """
    shapes = _expected_shapes(c)
    for name in weight_names(c) + (["rope_freqs"] if "rope_freqs" in weights else []):
        if name not in weights:
            raise ConfigError(f"Invalid weights: no {name!r}")
        w = weights[name]
        if isinstance(w, BlockQuantized):
            if name == "embed" or len(shapes[name]) != 2:
                raise DTypeError(f"Invalid weights: {name!r} must be a float array, "
                                 "not quantized blocks")
        elif not isinstance(w, np.ndarray) or w.dtype not in (np.float32, np.float16):
            raise DTypeError(f"Invalid weights: {name!r} must be a float32 or float16 array "
                             f"or BlockQuantized, got {type(w).__name__}")
        if tuple(w.shape) != shapes[name]:
            raise ShapeError(f"Invalid shape of {name}: expected {list(shapes[name])}, "
                             f"got {list(w.shape)}")
