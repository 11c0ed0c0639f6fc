"""GGUF files (llama.cpp's format) converted into ONNX model folders.

:func:`import_gguf` reads a GGUF file with the ``gguf`` package and writes a
folder that :class:`~pagedkv_np.onnxruntime.OrtDecoder` and
onnxruntime-genai both load::

    model.onnx, model.onnx.data   the decoder (pagedkv_np.onnxruntime.graph)
    config.json                   Hugging Face style geometry
    generation_config.json        bos / eos
    tokenizer.json                rebuilt from the GGUF vocabulary and merges
    tokenizer_config.json         chat template, bos / eos, add_bos_token
    genai_config.json             onnxruntime-genai's description of the decoder

Architectures: ``llama`` (Llama 2/3, SmolLM, TinyLlama, Mistral without a
sliding window) and ``qwen2`` (Q/K/V bias). llama.cpp's converter stores the
``llama`` architecture's Q and K rows permuted for its interleaved RoPE
(within each head, row pairs ``(j, j + d/2)`` become neighbours); the import
puts them back, so the graph uses rotate-half RoPE as the original model
does. ``qwen2`` files keep the original order.

Weight modes (``weights=``):

``"q4"``       Q4_0 / Q4_1 (and Q8_0) tensors stay in their blocks and run as
               exact ``MatMulNBits``; F32 / F16 tensors stay as they are.
``"float32"``  every tensor dequantized to float32.
``"float16"``  every matrix stored as float16 (norms stay float32); the
               session casts them to float32 when it loads, so this halves
               the disk size, not the memory.

The embedding is always gathered from float rows (dequantized); a tied LM
head keeps the embedding's blocks in ``"q4"`` mode.

Default ``"q4"``: on SmolLM2-135M-Instruct (Q4_1, this 2-core CPU, batch 1,
``scripts/bench_gguf_modes.py``) it decodes fastest and is the smallest on
disk and in memory, and it computes with the file's exact values, as
llama.cpp does; float32 is slower, float16 only smaller on disk. (Figures in
the script's docstring.)

Results are cached under ``$PAGEDKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedkv_np``, else ``~/.cache/pagedkv_np``, in a folder
named after the file's content digest (blake2b), the mode, the family and
:data:`FORMAT_VERSION`; a second call returns that folder. Folders are
written beside their final place and renamed into it, so a failed import
leaves nothing behind.

Command line::

    python -m pagedkv_np.onnxruntime.gguf_import FILE.gguf [--weights q4]
        [--family gqa] [--accuracy-level 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .geometry import DecoderGeometry, Linear
from .ggml_blocks import BlockQuantized
from .graph import build_decoder, save_decoder
from .model_io import UnsupportedModelError

try:
    import gguf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading GGUF files needs gguf: pip install 'pagedkv-np[models]'") from exc

from .gguf_tokenizer import build_tokenizer

__all__ = ["GGUFFormatError", "WEIGHT_MODES", "ARCHITECTURES", "FORMAT_VERSION",
           "import_gguf", "convert_gguf", "cache_dir_default", "file_digest", "main"]

WEIGHT_MODES = ("q4", "float32", "float16")
FAMILIES = ("gqa", "optimum")
#: architecture -> (Hugging Face class, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
#: bump when the folder's contents for the same file change
FORMAT_VERSION = 1

_Q = gguf.GGMLQuantizationType
_BLOCKS = {_Q.Q4_0: "q4_0", _Q.Q4_1: "q4_1", _Q.Q8_0: "q8_0"}
_SUPPORTED = (_Q.F32, _Q.F16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1)
_LAYER_TENSORS = {"attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
                  "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk",
                  "attn_v.bias": "bv", "attn_output.weight": "wo", "ffn_norm.weight": "mlp_norm",
                  "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
                  "ffn_down.weight": "w_down"}
_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                "output.weight": "lm_head", "rope_freqs.weight": "rope_freqs"}

_digests: dict[tuple[str, int, int], str] = {}
_digest_lock = threading.Lock()


class GGUFFormatError(UnsupportedModelError):
    """The file is not a readable GGUF file (truncated, corrupt, or its
    metadata contradicts its tensors); the message says what is wrong."""


def cache_dir_default() -> Path:
    """``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv_np``, else
    ``~/.cache/pagedkv_np``."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv_np"


def file_digest(path: str | os.PathLike) -> str:
    """blake2b hex digest of the file's bytes, read in 1 MiB chunks; remembered
    per (path, size, mtime) in this process, so a file is hashed once."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _digest_lock:
        if key in _digests:
            return _digests[key]
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    with _digest_lock:
        _digests[key] = h.hexdigest()
    return _digests[key]


# ------------------------------------------------------------------ reading


class _File:
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
        value = self.meta.get(key, default)
        if value is not None and not (isinstance(value, kind) and not isinstance(value, bool)
                                      or kind is bool and isinstance(value, bool)):
            raise GGUFFormatError(f"{self.path!r}: metadata {key} is {value!r:.60}, expected "
                                  f"{getattr(kind, '__name__', kind)}")
        return value

    def need(self, key: str, kind: type | tuple = (int,)) -> Any:
        if key not in self.meta:
            raise GGUFFormatError(f"{self.path!r}: metadata {key} is missing")
        return self.get(key, kind=kind)


def _geometry(f: _File) -> tuple[str, DecoderGeometry]:
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


def _kept_blocks(mode: str, accuracy_level: int) -> dict:
    """The GGUF types whose blocks the graph runs as MatMulNBits. Q8_0 only with
    int8 activations: onnxruntime 1.32's 8-bit MatMulNBits at accuracy_level 0
    took ~20x the time of a float32 MatMul here, and Q8_0 is exact in float32."""
    if mode != "q4":
        return {}
    return {q: kind for q, kind in _BLOCKS.items() if q != _Q.Q8_0 or accuracy_level == 4}


def _weights(f: _File, arch: str, c: DecoderGeometry, mode: str, blocks: dict
             ) -> tuple[DecoderGeometry, dict[str, Linear]]:
    expected = _expected(c)
    for name, t in f.tensors.items():
        if name not in expected and name != "rope_freqs.weight":
            raise UnsupportedModelError(f"{f.path!r}: tensor {name!r} is not part of a "
                                        f"{arch} decoder this importer knows")
        if t.tensor_type not in _SUPPORTED:
            raise UnsupportedModelError(
                f"{f.path!r}: tensor {name!r} has type {t.tensor_type.name}; supported: "
                f"{', '.join(q.name for q in _SUPPORTED)}")
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
    """One tensor as the graph takes it: [in, out] matrices, float vectors."""
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


# ------------------------------------------------------------------ writing


def _text_files(f: _File, arch: str, c: DecoderGeometry, family: str, tied: bool
                ) -> dict[str, Any]:
    tokens = f.get("tokenizer.ggml.tokens", kind=list)
    if tokens is None:
        raise GGUFFormatError(f"{f.path!r}: metadata tokenizer.ggml.tokens is missing")
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    pad = f.get("tokenizer.ggml.padding_token_id", eos)
    for what, tid in (("bos", bos), ("eos", eos), ("padding", pad)):
        if tid is not None and not 0 <= tid < len(tokens):
            raise GGUFFormatError(f"{f.path!r}: tokenizer.ggml.{what}_token_id {tid} is "
                                  f"outside the {len(tokens)} tokens")
    if len(tokens) > c.vocab_size:
        raise GGUFFormatError(f"{f.path!r}: {len(tokens)} tokens but an embedding of "
                              f"{c.vocab_size} rows")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", arch == "llama", kind=bool))
    tokenizer = build_tokenizer(
        model=f.get("tokenizer.ggml.model", "", kind=str),
        pre=f.get("tokenizer.ggml.pre", "gpt-2", kind=str), tokens=tokens,
        token_types=f.get("tokenizer.ggml.token_type", kind=list),
        merges=f.get("tokenizer.ggml.merges", [], kind=list), bos_token_id=bos,
        add_bos_token=add_bos)
    hf_class, _ = ARCHITECTURES[arch]
    token = lambda tid: None if tid is None else tokens[tid]  # noqa: E731
    config = {
        "architectures": [hf_class], "model_type": arch, "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "max_position_embeddings": c.max_positions, "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "bos_token_id": bos,
        "eos_token_id": eos, "tie_word_embeddings": tied, "torch_dtype": "float32"}
    tok_config = {"add_bos_token": add_bos, "add_eos_token": False, "bos_token": token(bos),
                  "eos_token": token(eos), "pad_token": token(pad),
                  "chat_template": f.get("tokenizer.chat_template", kind=str),
                  "model_max_length": c.max_positions, "clean_up_tokenization_spaces": False,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    decoder_io = {"input_ids": "input_ids", "attention_mask": "attention_mask",
                  "past_key_names": "past_key_values.%d.key",
                  "past_value_names": "past_key_values.%d.value"}
    if family == "optimum":
        decoder_io["position_ids"] = "position_ids"
    genai = {
        "model": {
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
            "context_length": c.max_positions, "vocab_size": c.vocab_size, "type": arch,
            "decoder": {
                "filename": "model.onnx", "session_options": {"provider_options": []},
                "head_size": c.head_dim, "hidden_size": c.hidden_size,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                "num_hidden_layers": c.num_layers, "inputs": decoder_io,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"}}},
        "search": {"do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": c.max_positions, "min_length": 0, "no_repeat_ngram_size": 0,
                   "num_beams": 1, "num_return_sequences": 1,
                   "past_present_share_buffer": family == "gqa", "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0}}
    return {"tokenizer.json": tokenizer, "config.json": config,
            "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos,
                                       "pad_token_id": pad},
            "tokenizer_config.json": tok_config, "genai_config.json": genai}


@dataclasses.dataclass(frozen=True)
class _Options:
    weights: str
    family: str
    accuracy_level: int

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"Invalid weights: expected one of {WEIGHT_MODES}, "
                              f"got {self.weights!r}")
        if self.family not in FAMILIES:
            raise ConfigError(f"Invalid family: expected one of {FAMILIES}, "
                              f"got {self.family!r}")
        if self.accuracy_level not in (0, 4):
            raise ConfigError(f"Invalid accuracy_level: expected 0 or 4, "
                              f"got {self.accuracy_level!r}")

    @property
    def tag(self) -> str:
        """How the options appear in a cache folder's name."""
        acc = f"-acc{self.accuracy_level}" if self.accuracy_level else ""
        return f"{self.weights}{acc}-{self.family}"

    def provenance(self, path: str) -> dict:
        return {"source": os.path.basename(path), "weights": self.weights,
                "family": self.family, "accuracy_level": self.accuracy_level,
                "format_version": FORMAT_VERSION}


def _build(path: str, folder: Path, opts: _Options, provenance: dict) -> None:
    """Write the model folder's files into ``folder`` (an empty directory)."""
    f = _File(path)
    arch, c = _geometry(f)
    if opts.family == "gqa" and c.head_dim % 16:
        raise UnsupportedModelError(f"{path!r}: head size {c.head_dim} is not a multiple of "
                                    "16, which GroupQueryAttention needs; use family='optimum'")
    text = _text_files(f, arch, c, opts.family, c.tie_word_embeddings)
    graph_geometry, tensors = _weights(f, arch, c, opts.weights,
                                       _kept_blocks(opts.weights, opts.accuracy_level))
    del f
    model = build_decoder(graph_geometry, tensors, family=opts.family,
                          accuracy_level=opts.accuracy_level, name=f"{arch}_{opts.weights}")
    del tensors
    save_decoder(model, folder)
    del model
    text["tokenizer.json"].save(str(folder / "tokenizer.json"))
    text["config.json"]["pagedkv_np"] = provenance
    for name, value in text.items():
        if name != "tokenizer.json":
            (folder / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _write_atomically(path: str, target: Path, opts: _Options, provenance: dict) -> Path:
    """Build into a fresh directory beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)     # mkdtemp's 0700 would hide a shared cache from other users
        _build(path, tmp, opts, provenance)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.onnx").is_file():
                raise
            shutil.rmtree(tmp)        # another process finished the same folder first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, weights: str = "q4",
                 family: str = "gqa", accuracy_level: int = 0) -> Path:
    """Write the model folder for ``path`` at ``out_dir`` (which must not exist
    or be empty), without the cache. Same options and errors as :func:`import_gguf`."""
    opts = _Options(weights, family, accuracy_level)
    target = Path(out_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"Invalid out_dir: {str(target)!r} exists and is not an empty folder")
    source = os.fspath(path)
    if not os.path.isfile(source):
        raise ConfigError(f"Invalid path: no file {source!r}")
    if target.is_dir():
        target.rmdir()
    return _write_atomically(source, target, opts, opts.provenance(source))


def import_gguf(path: str | os.PathLike, *, weights: str = "q4", family: str = "gqa",
                cache_dir: str | os.PathLike | None = None, accuracy_level: int = 0) -> Path:
    """The model folder of a GGUF file, built once and cached.

    Parameters
    ----------
    path : str or path
        A ``.gguf`` file.
    weights : {"q4", "float32", "float16"}
        How weights are stored (see the module docstring).
    family : {"gqa", "optimum"}
        The graph's I/O family (:mod:`pagedkv_np.onnxruntime.model_io`).
    cache_dir : str or path, optional
        Where model folders are kept (default :func:`cache_dir_default`).
    accuracy_level : {0, 4}
        MatMulNBits' ``accuracy_level`` in ``"q4"`` mode: 0 computes with the
        file's exact weights in float32; 4 quantizes activations to int8, as
        llama.cpp does for its 4-bit products (faster, not exact), and then
        also runs Q8_0 tensors as 8-bit blocks.

    Returns
    -------
    pathlib.Path
        The folder (``model.onnx`` + ``model.onnx.data``, ``config.json``,
        ``generation_config.json``, ``tokenizer.json``,
        ``tokenizer_config.json``, ``genai_config.json``).

    Raises
    ------
    ConfigError
        An unknown mode, family or accuracy level, or no such file.
    UnsupportedModelError
        An architecture, tensor type (the message names the tensor), tokenizer
        or feature this importer does not convert.
    GGUFFormatError
        A truncated or corrupt file (a subclass of UnsupportedModelError).
    """
    opts = _Options(weights, family, accuracy_level)
    source = os.fspath(path)
    if not os.path.isfile(source):
        raise ConfigError(f"Invalid path: no file {source!r}")
    root = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    digest = file_digest(source)
    target = root / f"{digest[:32]}-{opts.tag}-v{FORMAT_VERSION}"
    if (target / "model.onnx").is_file() and (target / "config.json").is_file():
        return target
    return _write_atomically(source, target, opts, dict(opts.provenance(source), blake2b=digest))


def main(argv: list[str] | None = None) -> int:
    """Convert a GGUF file (see the module docstring); prints the folder."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv_np.onnxruntime.gguf_import",
                                     description="Convert a GGUF file into an ONNX model folder.")
    parser.add_argument("path", help="the .gguf file")
    parser.add_argument("--weights", choices=WEIGHT_MODES, default="q4")
    parser.add_argument("--family", choices=FAMILIES, default="gqa")
    parser.add_argument("--accuracy-level", type=int, choices=(0, 4), default=0,
                        help="q4 mode: 4 computes with int8 activations (faster, inexact)")
    parser.add_argument("--out", default=None,
                        help="write the folder here instead of the cache")
    args = parser.parse_args(argv)
    options = dict(weights=args.weights, family=args.family,
                   accuracy_level=args.accuracy_level)
    try:
        if args.out is not None:
            folder = convert_gguf(args.path, args.out, **options)
        else:
            folder = import_gguf(args.path, **options)
    except (ConfigError, UnsupportedModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
