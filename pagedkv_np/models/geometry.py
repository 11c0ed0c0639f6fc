"""A decoder's geometry, the names and shapes of its weights, and its RoPE tables.

One pre-norm decoder block serves every architecture the package builds
(Llama, Qwen2/3, Phi-3, Mistral, Gemma 3); an architecture is a handful of
fields of :class:`DecoderGeometry` over that block, not a code path of its own:

====================  =====================================================
field                 what it changes (who uses it)
====================  =====================================================
``qkv_bias``          Q/K/V projections have a bias (Qwen2)
``qk_norm``           RMSNorm of each head's Q and K before RoPE (Qwen3,
                      Gemma 3)
``post_norms``        RMSNorm of the attention and MLP outputs before each
                      residual add (Gemma 3)
``activation``        ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma)
``embed_scale``       embedding rows are multiplied by it (Gemma: sqrt(hidden))
``attn_scale``        the query scale (0: ``1 / sqrt(head_dim)``)
``sliding_window``    a query sees the keys of its last ``sliding_window``
                      positions, itself included (0: all), in every layer but
                      ``global_layers`` (Mistral, Phi-3, Gemma 3)
``rope_local_theta``  the RoPE base of the sliding layers (Gemma 3: 10,000;
                      0: ``rope_theta``)
``rope_scale``        linear RoPE scaling of the ``rope_theta`` table
                      (positions divided by it)
``final_softcap``     ``logits = cap * tanh(logits / cap)`` (0: none)
====================  =====================================================

Weight names (``x @ w`` convention, ``w`` is ``[in, out]``)::

    embed [vocab, hidden] (or blocks)  final_norm [hidden]
    lm_head [hidden, vocab]            (absent when tie_word_embeddings)
    l{i}.attn_norm, l{i}.mlp_norm [hidden]
    l{i}.wq [hidden, heads * head_dim]   l{i}.wk, l{i}.wv [hidden, kv_heads * head_dim]
    l{i}.bq, l{i}.bk, l{i}.bv [out]      (only with qkv_bias)
    l{i}.q_norm, l{i}.k_norm [head_dim]  (only with qk_norm)
    l{i}.wo [heads * head_dim, hidden]
    l{i}.post_attn_norm, l{i}.post_mlp_norm [hidden]   (only with post_norms)
    l{i}.w_gate, l{i}.w_up [hidden, ffn]  l{i}.w_down [ffn, hidden]
    rope_freqs [head_dim // 2]           (optional: divides each rotary frequency)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Union

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from ..checks import check_positive_int, is_int
from .gguf.blocks import BlockQuantized

__all__ = ["ACTIVATIONS", "GEOMETRY_KEY", "DecoderGeometry", "Linear", "weight_names",
           "weight_shapes", "check_weights", "rope_tables", "geometry_json", "geometry_from_json"]

#: the metadata key under which a built decoder carries its geometry
#: (:func:`geometry_json`), so that a runtime can compute its layers itself
GEOMETRY_KEY = "pagedkv_np.geometry"

#: the MLP gate's activation: SwiGLU's SiLU, GeGLU's tanh-approximated GELU
ACTIVATIONS = ("silu", "gelu_tanh")

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
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    sliding_window: int = 0
    global_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    rope_scale: float = 1.0
    final_softcap: float = 0.0

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
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"Invalid activation: expected one of {ACTIVATIONS}, "
                              f"got {self.activation!r}")
        for name in ("embed_scale", "rope_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"Invalid {name}: expected > 0, got {getattr(self, name)!r}")
        for name in ("attn_scale", "rope_local_theta", "final_softcap"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"Invalid {name}: expected >= 0 (0: none), "
                                  f"got {getattr(self, name)!r}")
        if self.sliding_window:
            check_positive_int(self.sliding_window, "sliding_window")
        layers = self.global_layers
        if not isinstance(layers, (tuple, list)) or not all(is_int(i) for i in layers) \
                or any(not 0 <= i < self.num_layers for i in layers):
            raise ConfigError(f"Invalid global_layers: {layers!r} is not a tuple of layers "
                              f"of 0..{self.num_layers - 1}")
        object.__setattr__(self, "global_layers", tuple(sorted({int(i) for i in layers})))

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def query_scale(self) -> float:
        """What the attention scores are multiplied by."""
        return self.attn_scale or 1.0 / float(np.sqrt(self.head_dim))

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: it sees every earlier position)."""
        return 0 if layer in self.global_layers else self.sliding_window

    @property
    def local_rope(self) -> bool:
        """Whether the sliding layers have RoPE tables of their own."""
        return bool(self.sliding_window and self.rope_local_theta
                    and len(self.global_layers) < self.num_layers)


def weight_names(geometry: DecoderGeometry) -> list[str]:
    """The names :func:`build_decoder` needs, in graph order (``rope_freqs`` is optional)."""
    names = ["embed"]
    for i in range(geometry.num_layers):
        names += [f"l{i}.attn_norm", f"l{i}.wq", f"l{i}.wk", f"l{i}.wv"]
        if geometry.qkv_bias:
            names += [f"l{i}.bq", f"l{i}.bk", f"l{i}.bv"]
        if geometry.qk_norm:
            names += [f"l{i}.q_norm", f"l{i}.k_norm"]
        names += [f"l{i}.wo"]
        if geometry.post_norms:
            names += [f"l{i}.post_attn_norm", f"l{i}.post_mlp_norm"]
        names += [f"l{i}.mlp_norm", f"l{i}.w_gate", f"l{i}.w_up", f"l{i}.w_down"]
    names.append("final_norm")
    if not geometry.tie_word_embeddings:
        names.append("lm_head")
    return names


def weight_shapes(c: DecoderGeometry) -> dict[str, tuple[int, ...]]:
    """Every weight name a decoder of ``c`` may have -> its shape."""
    h, f, nq, nkv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, \
        c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, h), "final_norm": (h,),
                                          "lm_head": (h, c.vocab_size),
                                          "rope_freqs": (c.head_dim // 2,)}
    for i in range(c.num_layers):
        shapes.update({f"l{i}.attn_norm": (h,), f"l{i}.mlp_norm": (h,), f"l{i}.wq": (h, nq),
                       f"l{i}.wk": (h, nkv), f"l{i}.wv": (h, nkv), f"l{i}.bq": (nq,),
                       f"l{i}.bk": (nkv,), f"l{i}.bv": (nkv,), f"l{i}.wo": (nq, h),
                       f"l{i}.w_gate": (h, f), f"l{i}.w_up": (h, f), f"l{i}.w_down": (f, h),
                       f"l{i}.q_norm": (c.head_dim,), f"l{i}.k_norm": (c.head_dim,),
                       f"l{i}.post_attn_norm": (h,), f"l{i}.post_mlp_norm": (h,)})
    return shapes


def check_weights(c: DecoderGeometry, weights: dict[str, Linear]) -> None:
    """Raise unless ``weights`` has every name of ``c`` with its shape and a usable type.

    Raises
    ------
    ConfigError
        A weight is missing.
    ShapeError, DTypeError
        A weight has the wrong shape, or is neither a float32/float16 array nor
        (for a matrix) BlockQuantized; a BlockQuantized ``embed`` holds one
        row of blocks per token, so its ``shape`` is ``(hidden, vocab)``.
    """
    shapes = weight_shapes(c)
    for name in weight_names(c) + (["rope_freqs"] if "rope_freqs" in weights else []):
        if name not in weights:
            raise ConfigError(f"Invalid weights: no {name!r}")
        w = weights[name]
        shape = tuple(w.shape)
        if isinstance(w, BlockQuantized):
            if len(shapes[name]) != 2:
                raise DTypeError(f"Invalid weights: {name!r} must be a float array, "
                                 "not quantized blocks")
            if name == "embed":         # one row of blocks per token: (hidden, vocab)
                shape = shape[::-1]
        elif not isinstance(w, np.ndarray) or w.dtype not in (np.float32, np.float16):
            raise DTypeError(f"Invalid weights: {name!r} must be a float32 or float16 array "
                             f"or BlockQuantized, got {type(w).__name__}")
        if shape != shapes[name]:
            raise ShapeError(f"Invalid shape of {name}: expected {list(shapes[name])}, "
                             f"got {list(shape)}")


def rope_tables(c: DecoderGeometry, freq_factors: np.ndarray | None = None, *,
                local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32 [max_positions, head_dim // 2] of rotate-half RoPE.

    ``local=True`` gives the sliding layers' tables: base ``rope_local_theta``
    without ``rope_scale`` when the geometry has one (:attr:`local_rope`), else
    the same as the others. ``freq_factors`` (a GGUF's ``rope_freqs``, Llama 3's
    frequency-dependent scaling) divide each frequency.
    """
    half = c.head_dim // 2
    theta, scale = ((c.rope_local_theta, 1.0) if local and c.local_rope
                    else (c.rope_theta, c.rope_scale))
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) / half)) / scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def geometry_json(c: DecoderGeometry) -> str:
    """``c`` as a JSON object of its fields (read back by :func:`geometry_from_json`)."""
    return json.dumps(dataclasses.asdict(c), sort_keys=True)


def geometry_from_json(text: str) -> DecoderGeometry:
    """The geometry a JSON object of :func:`geometry_json` describes.

    Raises
    ------
    ConfigError
        Not a JSON object of :class:`DecoderGeometry`'s fields, or values
        that the geometry refuses.
    """
    try:
        fields = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"Invalid geometry: not JSON ({exc})") from None
    known = {f.name for f in dataclasses.fields(DecoderGeometry)}
    if not isinstance(fields, dict) or not set(fields) <= known:
        extra = sorted(set(fields) - known) if isinstance(fields, dict) else fields
        raise ConfigError(f"Invalid geometry: unknown fields {extra!r:.200}")
    if isinstance(fields.get("global_layers"), list):
        fields["global_layers"] = tuple(fields["global_layers"])
    try:
        return DecoderGeometry(**fields)
    except (TypeError, ValueError) as exc:     # a field of the wrong type
        raise ConfigError(f"Invalid geometry: {exc}") from None
