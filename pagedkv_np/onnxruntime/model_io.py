"""A decoder's interface: what it takes and gives, read from the model.

Two I/O families are supported (both take ``input_ids`` and
``attention_mask`` and return ``logits`` plus one ``present`` K and V per
layer, shape ``[batch, num_kv_heads, seq, head_dim]``):

``optimum``
    optimum / ``torch.onnx`` exports: ``past_key_values.{i}.key|value`` are
    concatenated with the new tokens' K/V, so ``present`` has ``past + S``
    positions, the new ones last. Padding anywhere is masked by
    ``attention_mask``. ``position_ids`` is optional; a model without it is
    taken to number positions by the running sum of ``attention_mask`` (as
    exports that build positions in the graph do).
``gqa``
    onnxruntime-genai builder models: ``com.microsoft.GroupQueryAttention``
    reads ``seqlens_k = sum(attention_mask) - 1``, so batches are right padded
    and each sequence's new token lands at its own length. Past and present
    may share one buffer of fixed capacity. A step with past context and
    more than one new token takes a batch of one.

The family is the ``gqa`` one when the graph holds a GroupQueryAttention node.
Inputs and outputs are matched by name, never by position (builder models
list all keys, then all values).

How each family is fed lives in :mod:`pagedkv_np.onnxruntime.runners`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UnsupportedModelError
from ..checks import check_positive_int, shown
from ..models.geometry import GEOMETRY_KEY
from ..models.head_file import HIDDEN_OUTPUT, METADATA_KEY

try:
    import onnxruntime as ort  # noqa: F401 - fail early with the extra to install
except ImportError as exc:  # pragma: no cover - __init__ reports this first
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime: pip install 'pagedkv-np[onnx]'") from exc

__all__ = ["ModelIO", "FAMILIES", "discover", "graph_facts"]

FAMILIES = ("optimum", "gqa")

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present(?:_key_values)?\.(\d+)\.(key|value)$")
_KV_DTYPES: dict[str, np.dtype] = {"tensor(float)": np.dtype(np.float32),
                                   "tensor(float16)": np.dtype(np.float16)}
_INT_DTYPES: dict[str, np.dtype] = {"tensor(int64)": np.dtype(np.int64),
                                    "tensor(int32)": np.dtype(np.int32)}


@dataclass(frozen=True)
class ModelIO:
    """What the engine needs to know about a decoder's interface.

    Attributes
    ----------
    family : {"optimum", "gqa"}
    num_layers, num_kv_heads, head_dim : int
    dtype : numpy dtype
        Of past/present K/V (float32 or float16).
    vocab_size : int or None
        Last dimension of ``logits`` when the model fixes it.
    max_positions : int or None
        Positions the graph can encode: the rows of the position table it
        indexes by position (a learned position embedding or rotary cos/sin
        cache of an ``optimum`` export, the cos cache of a ``gqa`` model);
        None when it has none (positions computed on the fly).
    input_ids_dtype, attention_mask_dtype : numpy dtype
    position_ids_dtype : numpy dtype or None
        None when the model takes no ``position_ids``.
    logits_dtype : numpy dtype
    past_keys, past_values, present_keys, present_values : tuple of str
        Names by layer.
    logits : str
        The output the runners read: ``"logits"``, or ``"hidden"`` for a
        graph whose LM head the engine runs (:mod:`pagedkv_np.onnxruntime.head`).
    """

    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype
    vocab_size: int | None
    max_positions: int | None
    input_ids_dtype: np.dtype
    attention_mask_dtype: np.dtype
    position_ids_dtype: np.dtype | None
    logits_dtype: np.dtype
    past_keys: tuple[str, ...]
    past_values: tuple[str, ...]
    present_keys: tuple[str, ...]
    present_values: tuple[str, ...]
    logits: str = "logits"

    @property
    def has_position_ids(self) -> bool:
        return self.position_ids_dtype is not None


@dataclass(frozen=True)
class GraphFacts:
    """Facts read off the graph (not the I/O): attention op, position limit."""

    has_gqa: bool
    max_positions: int | None
    op_types: frozenset
    #: the LM head file a graph without one names in its metadata (see
    #: :mod:`pagedkv_np.models.head_file`), relative to the model's folder
    head_file: str | None = None
    #: the JSON geometry a graph built by :mod:`pagedkv_np.models.graph` carries
    #: (:func:`pagedkv_np.models.geometry.geometry_json`)
    geometry: str | None = None
    #: whether every MatMulNBits node quantizes its activations to int8
    #: (``accuracy_level`` 4; False without such nodes)
    int8_matmuls: bool = False


# ops that pass a table through without changing its first axis' bound
_TABLE_VIEWS = frozenset({"Cast", "Identity", "Slice"})


def _table_rows(graph: Any) -> dict[str, int]:
    """Rows of every 2-D constant (initializer or Constant node) by name,
    also under the names of Cast / Identity / Slice views of it."""
    rows = {init.name: int(init.dims[0]) for init in graph.initializer if len(init.dims) == 2}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and len(attr.t.dims) == 2:
                    rows[node.output[0]] = int(attr.t.dims[0])
        elif node.op_type in _TABLE_VIEWS and node.input and node.input[0] in rows:
            rows[node.output[0]] = rows[node.input[0]]
    return rows


def _position_rows(graph: Any) -> int | None:
    """Fewest rows of a table that the graph indexes by position.

    A position table (GPT-2's learned position embedding, a rotary cos/sin
    cache) is a 2-D constant gathered with indices computed from
    ``position_ids`` (or, in graphs that number positions themselves, from
    ``attention_mask``); a position past its rows makes onnxruntime fail.
    GroupQueryAttention reads its cos and sin caches (inputs 7, 8) the same way.
    """
    rows = _table_rows(graph)
    derived = {i.name for i in graph.input} & {"position_ids", "attention_mask"}
    found = []
    for node in graph.node:   # ONNX graphs are topologically sorted
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in derived \
                and node.input[0] in rows:
            found.append(rows[node.input[0]])
        elif node.op_type == "GroupQueryAttention":   # inputs 7 and 8: cos and sin caches
            found += [rows[name] for name in node.input[7:9] if name in rows]
        if any(name in derived for name in node.input):
            derived.update(node.output)
    return min(found) if found else None


def graph_facts(model: Any) -> GraphFacts:
    """Op types of a model's main graph, whether it holds GroupQueryAttention,
    and the positions its tables can encode (see :func:`_position_rows`).

    Parameters
    ----------
    model : onnx.ModelProto
        Loaded without external data (only names and shapes are read).
    """
    graph = model.graph
    op_types = frozenset(node.op_type for node in graph.node)
    props = {p.key: p.value for p in model.metadata_props}
    levels = [next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
              for node in graph.node if node.op_type == "MatMulNBits"]
    return GraphFacts("GroupQueryAttention" in op_types, _position_rows(graph), op_types,
                      props.get(METADATA_KEY), props.get(GEOMETRY_KEY),
                      bool(levels) and all(level == 4 for level in levels))


def _static_dim(shape: list, axis: int, name: str, what: str, override: int | None) -> int:
    if override is not None:
        return check_positive_int(override, what)
    dim = shape[axis] if len(shape) > axis else None
    if isinstance(dim, int) and dim > 0:
        return dim
    raise UnsupportedModelError(
        f"cannot read {what} from input {name!r} of shape {shape}: dimension {axis} is "
        f"{dim!r}, not a fixed size; pass {what}= to OrtDecoder")


def discover(inputs: list, outputs: list, facts: GraphFacts | None = None, *,
             family: str = "auto", num_kv_heads: int | None = None,
             head_dim: int | None = None) -> ModelIO:
    """Match a session's inputs and outputs to a supported decoder family.

    Parameters
    ----------
    inputs, outputs : list of onnxruntime NodeArg
        ``session.get_inputs()`` and ``session.get_outputs()``.
    facts : GraphFacts, optional
        From :func:`graph_facts`; needed to tell the families apart when
        ``family="auto"``.
    family : {"auto", "optimum", "gqa"}
    num_kv_heads, head_dim : int, optional
        For models whose past inputs leave these dimensions symbolic.

    Raises
    ------
    UnsupportedModelError
        Naming the missing or unexpected input/output.
    """
    if not isinstance(family, str) or family not in ("auto",) + FAMILIES:
        raise UnsupportedModelError(
            f"Invalid family: expected 'auto', 'optimum' or 'gqa', got {shown(family)}")
    if family == "auto":
        family = "gqa" if facts is not None and facts.has_gqa else "optimum"
    ins = {arg.name: arg for arg in inputs}
    outs = {arg.name: arg for arg in outputs}

    for required in ("input_ids", "attention_mask"):
        if required not in ins:
            raise UnsupportedModelError(
                f"the model has no {required!r} input (inputs: {sorted(ins)}); a decoder "
                "needs input_ids, attention_mask and past_key_values.{i}.key|value")
    logits = "logits"
    if facts is not None and facts.head_file is not None and HIDDEN_OUTPUT in outs:
        logits = HIDDEN_OUTPUT        # the engine runs the head (runners: head=)
    elif "logits" not in outs:
        raise UnsupportedModelError(f"the model has no 'logits' output (outputs: {sorted(outs)})")

    past: dict[tuple[int, str], Any] = {}
    present: dict[tuple[int, str], str] = {}
    unexpected = []
    for name, arg in ins.items():
        m = _PAST.match(name)
        if m:
            past[int(m.group(1)), m.group(2)] = arg
        elif name not in ("input_ids", "attention_mask", "position_ids",
                          "num_logits_to_keep", "logits_to_keep"):
            unexpected.append(name)
    if unexpected:
        raise UnsupportedModelError(
            f"the model has inputs this engine does not know how to feed: {sorted(unexpected)}")
    for name in outs:
        m = _PRESENT.match(name)
        if m:
            present[int(m.group(1)), m.group(2)] = name
    if not past:
        raise UnsupportedModelError(
            "the model has no past_key_values.{i}.key|value inputs: it is not a decoder "
            "with a K/V cache (export it with past key values)")
    num_layers = max(i for i, _ in past) + 1
    for i in range(num_layers):
        for kind in ("key", "value"):
            if (i, kind) not in past:
                raise UnsupportedModelError(f"the model has no past_key_values.{i}.{kind} input")
            if (i, kind) not in present:
                raise UnsupportedModelError(f"the model has no present.{i}.{kind} output")

    first = past[0, "key"]
    dtype = _KV_DTYPES.get(first.type)
    if dtype is None:
        raise UnsupportedModelError(
            f"past_key_values.0.key has type {first.type}; supported: "
            f"{sorted(_KV_DTYPES)}")
    shape = list(first.shape)
    if len(shape) != 4:
        raise UnsupportedModelError(
            f"past_key_values.0.key has shape {shape}; expected "
            "[batch, num_kv_heads, past_sequence_length, head_dim]")
    heads = _static_dim(shape, 1, first.name, "num_kv_heads", num_kv_heads)
    dim = _static_dim(shape, 3, first.name, "head_dim", head_dim)
    for arg in past.values():
        s = list(arg.shape)
        if arg.type != first.type or len(s) != 4 or any(
                isinstance(s[a], int) and s[a] != want for a, want in ((1, heads), (3, dim))):
            raise UnsupportedModelError(
                f"{arg.name} has type {arg.type} and shape {s}, unlike past_key_values.0.key "
                f"({first.type}, [*, {shown(heads)}, *, {shown(dim)}])")

    def int_type(name: str) -> np.dtype:
        t = _INT_DTYPES.get(ins[name].type)
        if t is None:
            raise UnsupportedModelError(
                f"input {name!r} has type {ins[name].type}; expected int64 or int32")
        return t

    logits_dtype = _KV_DTYPES.get(outs[logits].type)
    if logits_dtype is None:
        raise UnsupportedModelError(
            f"output {logits!r} has type {outs[logits].type}; supported: {sorted(_KV_DTYPES)}")
    vocab = list(outs[logits].shape)[-1] if outs[logits].shape else None
    if logits != "logits":
        vocab = None        # the head's, which the engine sets
    return ModelIO(
        family=family,
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        dtype=dtype,
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        max_positions=facts.max_positions if facts is not None else None,
        input_ids_dtype=int_type("input_ids"),
        attention_mask_dtype=int_type("attention_mask"),
        position_ids_dtype=int_type("position_ids") if "position_ids" in ins else None,
        logits_dtype=logits_dtype,
        past_keys=tuple(past[i, "key"].name for i in range(num_layers)),
        past_values=tuple(past[i, "value"].name for i in range(num_layers)),
        present_keys=tuple(present[i, "key"] for i in range(num_layers)),
        present_values=tuple(present[i, "value"] for i in range(num_layers)),
        logits=logits,
    )
