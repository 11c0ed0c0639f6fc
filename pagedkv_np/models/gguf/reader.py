"""What a GGUF file holds, read as a decoder's geometry and weights.

:class:`GGUFFile` reads the metadata and tensor table with the ``gguf``
package; :func:`read_geometry` turns the metadata into a
:class:`~pagedkv_np.models.geometry.DecoderGeometry` and
:func:`read_weights` the tensors into the weights that
:func:`~pagedkv_np.models.graph.build_decoder` takes.

Architectures (:data:`ARCHITECTURES`: each an :class:`Architecture`, a few
facts over the one decoder block of :mod:`pagedkv_np.models.geometry`):

``llama``   Llama 2/3 (``rope_freqs`` for Llama 3's RoPE scaling), SmolLM,
            TinyLlama, Mistral (with its sliding window, on every layer).
``qwen2``   Q/K/V bias.            ``qwen3``   per-head Q/K RMSNorm.
``phi3``    Q/K/V in one ``attn_qkv`` tensor (or three), gate and up in one
            ``ffn_up`` (gate first), split here by rows; its sliding window is
            honoured on every layer, as Hugging Face's Phi-3 does (llama.cpp
            ignores it, so the two differ past the window); LongRoPE factor
            tensors (128k variants) are refused.
``gemma3``  Gemma 3 text: one global layer in six (``attention.sliding_window_pattern``
            when the file has it), the others sliding with a RoPE base of
            10,000 (``rope.freq_base_swa``); per-head Q/K RMSNorm, norms after
            attention and MLP, GeGLU (tanh GELU), embeddings scaled by
            sqrt(hidden); the converter already stored every norm weight as
            ``1 + w``. The query scale is ``attention.scale`` when present,
            else llama.cpp's rule: 1/sqrt(head_dim), 1/sqrt(hidden/heads) for
            the 62-layer 27B model.

Every architecture: linear RoPE scaling (``rope.scaling.type = linear``) and
final logit soft-capping (``final_logit_softcapping``) are read; attention
logit soft-capping, YaRN/LongRoPE, experts and partial rotary dimensions are
refused with :class:`~pagedkv_np.errors.UnsupportedModelError`.

llama.cpp's converter stores the ``llama`` architecture's Q and K rows
permuted for its interleaved RoPE (within each head, rows ``j`` and
``j + d/2`` become neighbours, rows ``2j`` and ``2j + 1``); :func:`read_weights`
puts them back, so the graph uses rotate-half RoPE as the original model
does. The other architectures keep the original order. Rows are whole output
features, so blocks are reordered (and fused tensors split) as they are,
without dequantizing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...errors import ConfigError
from ..geometry import DecoderGeometry, Linear
from .blocks import BLOCK_KINDS, BlockQuantized
from .header import GGUFFormatError, read_header
from ...errors import UnsupportedModelError

try:
    import gguf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading GGUF files needs gguf: pip install 'pagedkv-np[models]'") from exc

__all__ = ["GGUFFormatError", "GGUFFile", "Architecture", "ARCHITECTURES", "SUPPORTED_TYPES",
           "read_geometry", "kept_blocks", "read_weights"]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a GGUF architecture name means beyond the metadata every file has.

    Attributes
    ----------
    hf_class, model_type : str
        ``config.json``'s ``architectures[0]`` and ``model_type``.
    genai_type : str
        ``genai_config.json``'s ``model.type``.
    permuted_qk : bool
        llama.cpp's converter permuted the Q/K rows for interleaved RoPE.
    fused_mlp : bool
        Gate and up projections in one ``ffn_up`` tensor, gate rows first.
    sliding : bool
        ``attention.sliding_window`` is honoured (otherwise it is refused).
    sliding_period : int
        With a window, layer ``i`` slides iff ``period == 0`` or
        ``i % period < period - 1`` (llama.cpp's pattern; 0: every layer).
    local_rope_theta : float
        The sliding layers' RoPE base when the file gives none (0: the file's).
    scaled_embedding : bool
        Embeddings are multiplied by sqrt(hidden).
    options : tuple of (str, object)
        Geometry fields the architecture fixes.
    """

    hf_class: str
    model_type: str
    genai_type: str
    permuted_qk: bool = False
    fused_mlp: bool = False
    sliding: bool = False
    sliding_period: int = 0
    local_rope_theta: float = 0.0
    scaled_embedding: bool = False
    options: tuple = ()


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", "llama", permuted_qk=True, sliding=True),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", "qwen2"),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", "qwen3", options=(("qk_norm", True),)),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", "phi3", fused_mlp=True, sliding=True),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma3_text", sliding=True,
                           sliding_period=6, local_rope_theta=10000.0, scaled_embedding=True,
                           options=(("qk_norm", True), ("post_norms", True),
                                    ("activation", "gelu_tanh"))),
}

_Q = gguf.GGMLQuantizationType
#: GGUF types read as ggml blocks (pagedkv_np.models.gguf.blocks), by kind
_BLOCKS = {q: q.name.lower() for q in (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q2_K,
                                       _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)}
_FLOATS = (_Q.F32, _Q.F16, _Q.BF16)
SUPPORTED_TYPES = _FLOATS + tuple(_BLOCKS)
_LAYER_TENSORS = {"attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
                  "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk",
                  "attn_v.bias": "bv", "attn_output.weight": "wo", "ffn_norm.weight": "mlp_norm",
                  "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
                  "ffn_down.weight": "w_down", "attn_q_norm.weight": "q_norm",
                  "attn_k_norm.weight": "k_norm", "post_attention_norm.weight": "post_attn_norm",
                  "post_ffw_norm.weight": "post_mlp_norm"}
_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs"}


class GGUFFile:
    """A GGUF file's metadata (as Python values) and tensor table by name,
    read from its header (:mod:`.header`: long arrays and tensor data are
    read when asked for)."""

    def __init__(self, path: str) -> None:
        self.path = path
        header = read_header(path)
        self.meta = header.metadata
        self.tensors = header.tensors

    def get(self, key: str, default: Any = None, kind: type | tuple = (int,)) -> Any:
        """Metadata ``key`` (``default`` when absent), which must be of ``kind``."""
        value = self.meta.get(key, default)
        if value is not None and not (isinstance(value, kind) and not isinstance(value, bool)
                                      or kind is bool and isinstance(value, bool)):
            raise GGUFFormatError(f"{self.path!r}: metadata {key} is {value!r:.60}, expected "
                                  f"{getattr(kind, '__name__', kind)}")
        return value

    def need(self, key: str, kind: type | tuple = (int,)) -> Any:
        """Metadata ``key``, which must be there and of ``kind``."""
        if key not in self.meta:
            raise GGUFFormatError(f"{self.path!r}: metadata {key} is missing")
        return self.get(key, kind=kind)


def read_geometry(f: GGUFFile) -> tuple[str, DecoderGeometry]:
    """The architecture name and the geometry the metadata gives.

    ``tie_word_embeddings`` is whether the file lacks ``output.weight``.

    Raises
    ------
    UnsupportedModelError
        An architecture or feature (experts, a sliding window where the
        architecture has none, RoPE scaling other than linear, LongRoPE
        factors, attention logit soft-capping, a partial rotary dimension)
        that is not converted.
    GGUFFormatError
        Metadata that is missing or gives no valid geometry.
    """
    arch = f.get("general.architecture", kind=str)
    if arch is None:
        raise GGUFFormatError(f"{f.path!r}: metadata general.architecture is missing")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{f.path!r}: architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    spec = ARCHITECTURES[arch]
    if f.get(f"{arch}.expert_count", 0):
        raise UnsupportedModelError(f"{f.path!r}: mixture-of-experts models are not supported")
    window = f.get(f"{arch}.attention.sliding_window", 0) or 0
    if window and not spec.sliding:
        raise UnsupportedModelError(f"{f.path!r}: sliding-window attention is not supported "
                                    f"for {arch}")
    if f.get(f"{arch}.attn_logit_softcapping", 0.0, kind=(int, float)):
        raise UnsupportedModelError(f"{f.path!r}: attention logit soft-capping is not supported")
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        raise UnsupportedModelError(f"{f.path!r}: LongRoPE (rope_factors_long/short) is not "
                                    "supported")
    scaling = f.get(f"{arch}.rope.scaling.type", "none", kind=str)
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{f.path!r}: RoPE scaling {scaling!r} is not supported")
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = float(f.need(f"{arch}.rope.scaling.factor", (int, float)))
    hidden = f.need(f"{arch}.embedding_length")
    heads = f.need(f"{arch}.attention.head_count")
    num_layers = f.need(f"{arch}.block_count")
    options = dict(spec.options)
    if spec.scaled_embedding:
        options["embed_scale"] = float(np.sqrt(np.float32(hidden)))
    if window:
        options.update(sliding_window=window,
                       global_layers=_global_layers(f, arch, spec, num_layers),
                       rope_local_theta=float(f.get(f"{arch}.rope.freq_base_swa",
                                                    spec.local_rope_theta, kind=(int, float))))
    scale = f.get(f"{arch}.attention.scale", 0.0, kind=(int, float))
    if not scale and arch == "gemma3" and num_layers == 62:
        scale = 1.0 / np.sqrt(hidden / heads)     # 27B: query_pre_attn_scalar = hidden / heads
    options["attn_scale"] = float(scale)
    head_dim = f.get(f"{arch}.attention.key_length", hidden // max(heads, 1))
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        if f.get(key, head_dim) != head_dim:
            raise UnsupportedModelError(f"{f.path!r}: {key} = {f.get(key)} differs from the "
                                        f"head size {head_dim}; not supported")
    embed = f.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFFormatError(f"{f.path!r}: no 2-D tensor token_embd.weight")
    try:
        geometry = DecoderGeometry(
            vocab_size=int(embed.shape[1]), hidden_size=hidden,
            num_layers=num_layers, num_heads=heads,
            num_kv_heads=f.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim, intermediate_size=f.need(f"{arch}.feed_forward_length"),
            rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0, kind=(int, float))),
            rms_eps=float(f.need(f"{arch}.attention.layer_norm_rms_epsilon", (int, float))),
            max_positions=f.need(f"{arch}.context_length"),
            qkv_bias="blk.0.attn_q.bias" in f.tensors,
            tie_word_embeddings="output.weight" not in f.tensors, rope_scale=rope_scale,
            final_softcap=float(f.get(f"{arch}.final_logit_softcapping", 0.0,
                                      kind=(int, float))), **options)
    except ConfigError as exc:
        raise GGUFFormatError(f"{f.path!r}: the metadata gives no valid geometry: "
                              f"{exc}") from None
    return arch, geometry


def _global_layers(f: GGUFFile, arch: str, spec: Architecture, num_layers: int
                   ) -> tuple[int, ...]:
    """The layers that ignore the sliding window: ``attention.sliding_window_pattern``
    (a period, or one bool per layer, true where the layer slides), else the
    architecture's period."""
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", spec.sliding_period,
                    kind=(int, list))
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
            raise GGUFFormatError(f"{f.path!r}: {arch}.attention.sliding_window_pattern is "
                                  f"not one bool per layer of {num_layers}")
        return tuple(i for i, sliding in enumerate(pattern) if not sliding)
    if pattern < 0:
        raise GGUFFormatError(f"{f.path!r}: {arch}.attention.sliding_window_pattern is "
                              f"{pattern}, expected >= 0")
    return tuple(i for i in range(num_layers) if pattern and i % pattern == pattern - 1)


def _expected(c: DecoderGeometry, spec: Architecture, fused_qkv: bool
              ) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape as NumPy reads it ([out, in] for matrices)."""
    h, nq, nkv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, h),
                                          "output_norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, h)
    per_layer: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,), "attn_q.weight": (nq, h), "attn_k.weight": (nkv, h),
        "attn_v.weight": (nkv, h), "attn_output.weight": (h, nq), "ffn_norm.weight": (h,),
        "ffn_gate.weight": (f, h), "ffn_up.weight": (f, h), "ffn_down.weight": (h, f)}
    if c.qkv_bias:
        per_layer.update({"attn_q.bias": (nq,), "attn_k.bias": (nkv,), "attn_v.bias": (nkv,)})
    if c.qk_norm:
        per_layer.update({"attn_q_norm.weight": (c.head_dim,),
                          "attn_k_norm.weight": (c.head_dim,)})
    if c.post_norms:
        per_layer.update({"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)})
    if fused_qkv:
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
            del per_layer[name]
        per_layer["attn_qkv.weight"] = (nq + 2 * nkv, h)
    if spec.fused_mlp:
        del per_layer["ffn_gate.weight"]
        per_layer["ffn_up.weight"] = (2 * f, h)
    for i in range(c.num_layers):
        shapes.update({f"blk.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: in each head, GGUF row ``2j + t`` is the
    original row ``t * d/2 + j`` (rows may be float values or whole blocks)."""
    d = rows.shape[0] // num_heads
    order = np.arange(rows.shape[0]).reshape(num_heads, d // 2, 2).transpose(0, 2, 1)
    return rows[order.reshape(-1)]


def kept_blocks(mode: str, accuracy_level: int) -> dict:
    """The GGUF types whose blocks the graph runs as MatMulNBits.

    ``"q4"`` mode keeps the types whose codes fit in 4 bits (Q4_0, Q4_1,
    Q4_K, Q3_K, Q2_K) at any ``accuracy_level``, and the 5-8-bit types
    (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) only with int8 activations
    (``accuracy_level=4``): onnxruntime 1.32's 8-bit MatMulNBits at level 0
    took 25-50x the time of a float32 MatMul here, and float32 holds those
    values exactly (figures: :mod:`pagedkv_np.models.gguf.blocks`).
    """
    if mode != "q4":
        return {}
    return {q: kind for q, kind in _BLOCKS.items()
            if BLOCK_KINDS[kind].bits == 4 or accuracy_level == 4}


def read_weights(f: GGUFFile, arch: str, c: DecoderGeometry, mode: str, blocks: dict,
                 head_blocks: dict | None = None) -> tuple[DecoderGeometry, dict[str, Linear]]:
    """The weights that :func:`~pagedkv_np.models.graph.build_decoder` takes.

    Parameters
    ----------
    f : GGUFFile
    arch : str
        From :func:`read_geometry`, with its geometry ``c``.
    mode : {"q4", "float32", "float16"}
        Float dtype of the tensors that are not kept as blocks (``"q4"``:
        as stored).
    blocks : dict
        From :func:`kept_blocks`: GGUF types kept as ggml blocks.
    head_blocks : dict, optional
        The same for the LM head (default ``blocks``): the head may run at an
        accuracy level of its own.

    Returns
    -------
    (DecoderGeometry, dict)
        The geometry of the graph and the weights by graph name, Q/K rows
        back in the original order, fused tensors split. In ``"q4"`` mode the
        embedding keeps its blocks (gathered exactly) unless it is a tied
        head whose type ``head_blocks`` leaves out: then it is float rows that
        the head reads transposed.

    Raises
    ------
    UnsupportedModelError
        A tensor of an unsupported type (named, with its type) or one that is
        not part of the architecture.
    GGUFFormatError
        A missing tensor, or one whose shape contradicts the metadata.
    """
    spec = ARCHITECTURES[arch]
    fused_qkv = spec.fused_mlp and "blk.0.attn_qkv.weight" in f.tensors
    expected = _expected(c, spec, fused_qkv)
    for name, t in f.tensors.items():
        if name not in expected and name != "rope_freqs.weight":
            raise UnsupportedModelError(f"{f.path!r}: tensor {name!r} is not part of a "
                                        f"{arch} decoder this importer knows")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{f.path!r}: tensor {name!r} has type {t.tensor_type.name}; supported: "
                f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
        want = expected.get(name, (c.head_dim // 2,))
        if tuple(int(n) for n in reversed(t.shape)) != want:
            raise GGUFFormatError(f"{f.path!r}: tensor {name!r} has shape "
                                  f"{list(reversed(t.shape))}, expected {list(want)}")
    for name in expected:
        if name not in f.tensors:
            raise GGUFFormatError(f"{f.path!r}: tensor {name!r} is missing")
    head_blocks = blocks if head_blocks is None else head_blocks
    kinds = {"lm_head": head_blocks,
             "embed": {} if mode != "q4" else head_blocks if c.tie_word_embeddings
             else _BLOCKS}
    out: dict[str, Linear] = {}
    for name, t in f.tensors.items():
        try:
            raw = np.array(t.data)              # a copy: nothing keeps the file mapped
        except Exception as exc:
            raise GGUFFormatError(f"{f.path!r}: tensor {name!r} cannot be read: {exc}") from None
        for key, rows in _graph_tensors(name, raw, c, spec):
            if spec.permuted_qk and key[-2:] in ("wq", "bq", "wk", "bk"):
                rows = _unpermute(rows, c.num_heads if key[-1] == "q" else c.num_kv_heads)
            out[key] = _convert(rows, t.tensor_type, key, mode, kinds.get(key, blocks))
    return c, out


def _graph_tensors(name: str, raw: np.ndarray, c: DecoderGeometry, spec: Architecture
                   ) -> list[tuple[str, np.ndarray]]:
    """A GGUF tensor's rows under their graph names: fused Q/K/V and gate/up split
    by rows (whole output features, so blocks stay whole)."""
    if name in _TOP_TENSORS:
        return [(_TOP_TENSORS[name], raw)]
    _, layer, rest = name.split(".", 2)
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if rest == "attn_qkv.weight":
        parts = {"wq": raw[:nq], "wk": raw[nq:nq + nkv], "wv": raw[nq + nkv:]}
    elif rest == "ffn_up.weight" and spec.fused_mlp:
        parts = {"w_gate": raw[:c.intermediate_size], "w_up": raw[c.intermediate_size:]}
    else:
        parts = {_LAYER_TENSORS[rest]: raw}
    return [(f"l{layer}.{key}", np.ascontiguousarray(rows)) for key, rows in parts.items()]


def _convert(raw: np.ndarray, qtype: Any, key: str, mode: str, blocks: dict) -> Linear:
    """One tensor as the graph takes it: [in, out] matrices, float vectors.

    Outside ``blocks``, ``"q4"`` mode keeps F16 matrices as float16 and turns
    every other type into float32 (exact: a block's values are float32
    products of its codes and scales)."""
    if key in ("final_norm", "rope_freqs") or key.endswith(("norm", ".bq", ".bk", ".bv")):
        return gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    if key == "embed" and qtype in blocks:     # one row of blocks per token
        return BlockQuantized(blocks[qtype], raw)
    if key == "embed":      # gathered by rows: float [vocab, hidden]
        dtype = np.float16 if mode == "float16" else np.float32
        return _rows(raw, qtype).astype(dtype, copy=False)
    if qtype in blocks:
        return BlockQuantized(blocks[qtype], raw)
    if mode == "q4":
        dtype = np.float16 if qtype == _Q.F16 else np.float32
    else:
        dtype = np.float16 if mode == "float16" else np.float32
    return np.ascontiguousarray(_rows(raw, qtype).astype(dtype, copy=False).T)


def _rows(raw: np.ndarray, qtype: Any) -> np.ndarray:
    """A matrix's float values [rows, columns]: ggml blocks decoded by
    :class:`BlockQuantized` (the values ``gguf.quants.dequantize`` gives, in
    less time and memory), other types by ``gguf``."""
    if qtype in _BLOCKS and raw.ndim == 2:
        return BlockQuantized(_BLOCKS[qtype], raw).dequantize_rows()
    return gguf.quants.dequantize(raw, qtype)

