"""What a GGUF file holds, read as a decoder's geometry and weights.

:class:`GGUFFile` reads the metadata and tensor table with the ``gguf``
package; :func:`read_geometry` turns the metadata into a
:class:`~pagedkv_np.models.geometry.DecoderGeometry` and
:func:`read_weights` the tensors into the weights that
:func:`~pagedkv_np.models.graph.build_decoder` takes.

llama.cpp's converter stores the ``llama`` architecture's Q and K rows
permuted for its interleaved RoPE (within each head, rows ``j`` and
``j + d/2`` become neighbours, rows ``2j`` and ``2j + 1``); :func:`read_weights`
puts them back, so the graph uses rotate-half RoPE as the original model
does. ``qwen2`` files keep the original order. Rows are whole output
features, so blocks are reordered as they are, without dequantizing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...errors import ConfigError
from ..geometry import DecoderGeometry, Linear
from .blocks import BLOCK_KINDS, BlockQuantized
from ...errors import UnsupportedModelError

try:
    import gguf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading GGUF files needs gguf: pip install 'pagedkv-np[models]'") from exc

__all__ = ["GGUFFormatError", "GGUFFile", "ARCHITECTURES", "SUPPORTED_TYPES", "read_geometry",
           "kept_blocks", "read_weights"]

#: architecture -> (Hugging Face class, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

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
                  "ffn_down.weight": "w_down"}
_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs"}


class GGUFFormatError(UnsupportedModelError):
    """The file is not a readable GGUF file (truncated, corrupt, or its
    metadata contradicts its tensors); the message says what is wrong."""


class GGUFFile:
    """A GGUF file's metadata (as Python values) and tensors by name."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            reader = gguf.GGUFReader(path, "r")
            self.meta = {name: field.contents() for name, field in reader.fields.items()}
            self.tensors = {t.name: t for t in reader.tensors}
        except FileNotFoundError:
            raise ConfigError(f"Invalid path: no file {path!r}") from None
        except Exception as exc:   # numpy, struct and unicode errors of a bad file
            raise GGUFFormatError(f"{path!r} is not a readable GGUF file (truncated or "
                                  f"corrupt): {type(exc).__name__}: {exc}") from None

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
        An architecture or feature (experts, sliding window, RoPE scaling, a
        partial rotary dimension) that is not converted.
    GGUFFormatError
        Metadata that is missing or gives no valid geometry.
    """
    arch = f.get("general.architecture", kind=str)
    if arch is None:
        raise GGUFFormatError(f"{f.path!r}: metadata general.architecture is missing")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{f.path!r}: architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    if f.get(f"{arch}.expert_count", 0):
        raise UnsupportedModelError(f"{f.path!r}: mixture-of-experts models are not supported")
    if f.get(f"{arch}.attention.sliding_window") is not None:
        raise UnsupportedModelError(f"{f.path!r}: sliding-window attention is not supported")
    scaling = f.get(f"{arch}.rope.scaling.type", "none", kind=str)
    if scaling != "none":
        raise UnsupportedModelError(f"{f.path!r}: RoPE scaling {scaling!r} is not supported")
    hidden = f.need(f"{arch}.embedding_length")
    heads = f.need(f"{arch}.attention.head_count")
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
            num_layers=f.need(f"{arch}.block_count"), num_heads=heads,
            num_kv_heads=f.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim, intermediate_size=f.need(f"{arch}.feed_forward_length"),
            rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0, kind=(int, float))),
            rms_eps=float(f.need(f"{arch}.attention.layer_norm_rms_epsilon", (int, float))),
            max_positions=f.need(f"{arch}.context_length"),
            qkv_bias="blk.0.attn_q.bias" in f.tensors,
            tie_word_embeddings="output.weight" not in f.tensors)
    except ConfigError as exc:
        raise GGUFFormatError(f"{f.path!r}: the metadata gives no valid geometry: "
                              f"{exc}") from None
    return arch, geometry


def _expected(c: DecoderGeometry) -> dict[str, tuple[int, ...]]:
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
    took 15-40x the time of a float32 MatMul here, and float32 holds those
    values exactly (figures: :mod:`pagedkv_np.models.gguf.blocks`).
    """
    if mode != "q4":
        return {}
    return {q: kind for q, kind in _BLOCKS.items()
            if BLOCK_KINDS[kind].bits == 4 or accuracy_level == 4}


def read_weights(f: GGUFFile, arch: str, c: DecoderGeometry, mode: str, blocks: dict
             ) -> tuple[DecoderGeometry, dict[str, Linear]]:
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

    Returns
    -------
    (DecoderGeometry, dict)
        The geometry of the graph (a tied head whose blocks are kept becomes
        an ``lm_head`` of its own) and the weights by graph name, Q/K rows
        back in the original order.

    Raises
    ------
    UnsupportedModelError
        A tensor of an unsupported type (named, with its type) or one that is
        not part of the architecture.
    GGUFFormatError
        A missing tensor, or one whose shape contradicts the metadata.
    """
    expected = _expected(c)
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
    permuted = ARCHITECTURES[arch][1]
    out: dict[str, Linear] = {}
    for name, t in f.tensors.items():
        if name in _TOP_TENSORS:
            key = _TOP_TENSORS[name]
        else:
            _, layer, rest = name.split(".", 2)
            key = f"l{layer}.{_LAYER_TENSORS[rest]}"
        try:
            raw = np.array(t.data)              # a copy: nothing keeps the file mapped
        except Exception as exc:
            raise GGUFFormatError(f"{f.path!r}: tensor {name!r} cannot be read: {exc}") from None
        if permuted and key[-2:] in ("wq", "bq", "wk", "bk"):
            raw = _unpermute(raw, c.num_heads if key[-1] == "q" else c.num_kv_heads)
        out[key] = _convert(raw, t.tensor_type, key, mode, blocks)
    embed = f.tensors["token_embd.weight"]
    if "lm_head" not in out and embed.tensor_type in blocks:
        # the tied head keeps the embedding's blocks; the graph gets it as its own head
        out["lm_head"] = BlockQuantized(blocks[embed.tensor_type], np.array(embed.data))
        c = dataclasses.replace(c, tie_word_embeddings=False)
    return c, out


def _convert(raw: np.ndarray, qtype: Any, key: str, mode: str, blocks: dict) -> Linear:
    """One tensor as the graph takes it: [in, out] matrices, float vectors.

    Outside ``blocks``, ``"q4"`` mode keeps F16 matrices as float16 and turns
    every other type into float32 (exact: a block's values are float32
    products of its codes and scales)."""
    if key in ("final_norm", "rope_freqs") or key.endswith(("norm", ".bq", ".bk", ".bv")):
        return gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    if key == "embed":      # gathered by rows: float [vocab, hidden]
        dtype = np.float16 if mode == "float16" else np.float32
        return gguf.quants.dequantize(raw, qtype).astype(dtype)
    if qtype in blocks:
        return BlockQuantized(blocks[qtype], raw)
    if mode == "q4":
        dtype = np.float16 if qtype == _Q.F16 else np.float32
    else:
        dtype = np.float16 if mode == "float16" else np.float32
    return np.ascontiguousarray(gguf.quants.dequantize(raw, qtype).astype(dtype).T)

