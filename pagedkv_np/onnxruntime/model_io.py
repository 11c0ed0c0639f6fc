"""A decoder's interface: what it takes (discovery) and how to feed it (runners).

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

A :class:`Runner` feeds one family: a prefill of one sequence after its
cached past, and decode steps of a batch whose contiguous past it keeps
between steps (:class:`OptimumRunner`: ``present`` becomes the next
``past``; :class:`GqaRunner`: one past/present buffer per layer, shared
through IOBinding). It knows nothing of pages: the engine hands it a
``gather`` callback when the batch changes and writes the new K/V it
returns into the cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import PagedKVError

try:
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover - __init__ reports this first
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime: pip install 'pagedkv-np[onnx]'") from exc

__all__ = ["UnsupportedModelError", "ModelIO", "FAMILIES", "discover", "graph_facts",
           "Runner", "OptimumRunner", "GqaRunner", "make_runner"]

# gather(layer, out) -> (k, v): one layer's past K/V of the batch, [B, H, T, D]
Gather = Callable[[int, "tuple[np.ndarray, np.ndarray] | None"],
                  "tuple[np.ndarray, np.ndarray]"]

FAMILIES = ("optimum", "gqa")

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present(?:_key_values)?\.(\d+)\.(key|value)$")
_KV_DTYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16)}
_INT_DTYPES = {"tensor(int64)": np.dtype(np.int64), "tensor(int32)": np.dtype(np.int32)}


class UnsupportedModelError(PagedKVError, ValueError):
    """The ONNX model lacks the inputs/outputs of a supported decoder family.

    The message names what is missing or unexpected.
    """


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
        Rows of the rotary tables of a ``gqa`` model (positions it can encode).
    input_ids_dtype, attention_mask_dtype : numpy dtype
    position_ids_dtype : numpy dtype or None
        None when the model takes no ``position_ids``.
    logits_dtype : numpy dtype
    past_keys, past_values, present_keys, present_values : tuple of str
        Names by layer.
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
    """Facts read off the graph (not the I/O): attention op, rotary table size."""

    has_gqa: bool
    max_positions: int | None
    op_types: frozenset


def graph_facts(model: Any) -> GraphFacts:
    """Op types of a model's main graph and, for GroupQueryAttention models,
    the length of the rotary cos table.

    Parameters
    ----------
    model : onnx.ModelProto
        Loaded without external data (only names and shapes are read).
    """
    graph = model.graph
    op_types = frozenset(node.op_type for node in graph.node)
    max_positions = None
    gqa_nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if gqa_nodes and len(gqa_nodes[0].input) > 7 and gqa_nodes[0].input[7]:
        cos_name = gqa_nodes[0].input[7]
        for init in graph.initializer:
            if init.name == cos_name and len(init.dims) == 2:
                max_positions = int(init.dims[0])
                break
    return GraphFacts(bool(gqa_nodes), max_positions, op_types)


def _static_dim(shape: list, axis: int, name: str, what: str, override: int | None) -> int:
    if override is not None:
        return int(override)
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
    if family not in ("auto",) + FAMILIES:
        raise UnsupportedModelError(
            f"Invalid family: expected 'auto', 'optimum' or 'gqa', got {family!r}")
    if family == "auto":
        family = "gqa" if facts is not None and facts.has_gqa else "optimum"
    ins = {arg.name: arg for arg in inputs}
    outs = {arg.name: arg for arg in outputs}

    for required in ("input_ids", "attention_mask"):
        if required not in ins:
            raise UnsupportedModelError(
                f"the model has no {required!r} input (inputs: {sorted(ins)}); a decoder "
                "needs input_ids, attention_mask and past_key_values.{i}.key|value")
    if "logits" not in outs:
        raise UnsupportedModelError(f"the model has no 'logits' output (outputs: {sorted(outs)})")

    past: dict[tuple[int, str], Any] = {}
    present: dict[tuple[int, str], str] = {}
    unexpected = []
    for name, arg in ins.items():
        m = _PAST.match(name)
        if m:
            past[int(m.group(1)), m.group(2)] = arg
        elif name not in ("input_ids", "attention_mask", "position_ids"):
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
    for (i, kind), arg in past.items():
        s = list(arg.shape)
        if arg.type != first.type or len(s) != 4 or any(
                isinstance(s[a], int) and s[a] != want for a, want in ((1, heads), (3, dim))):
            raise UnsupportedModelError(
                f"{arg.name} has type {arg.type} and shape {s}, unlike past_key_values.0.key "
                f"({first.type}, [*, {heads}, *, {dim}])")

    def int_type(name: str) -> np.dtype:
        t = _INT_DTYPES.get(ins[name].type)
        if t is None:
            raise UnsupportedModelError(
                f"input {name!r} has type {ins[name].type}; expected int64 or int32")
        return t

    logits_dtype = _KV_DTYPES.get(outs["logits"].type)
    if logits_dtype is None:
        raise UnsupportedModelError(
            f"output 'logits' has type {outs['logits'].type}; supported: {sorted(_KV_DTYPES)}")
    vocab = list(outs["logits"].shape)[-1] if outs["logits"].shape else None
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
    )


# ------------------------------------------------------------------ feeding


class Runner:
    """Feeds one model family; holds the decode batch's contiguous K/V.

    Between :meth:`start_batch` calls the batch is fixed: each :meth:`decode`
    feeds one token per sequence and keeps the grown past for the next one.
    """

    def __init__(self, session: Any, io: ModelIO) -> None:
        self.session = session
        self.io = io
        self.capacity = 0
        self._outputs = [io.logits, *io.present_keys, *io.present_values]

    def _empty_past(self) -> np.ndarray:
        return np.zeros((1, self.io.num_kv_heads, 0, self.io.head_dim), dtype=self.io.dtype)

    def prefill(self, tokens: np.ndarray, num_past: int,
                past: list[tuple[np.ndarray, np.ndarray]] | None):
        """Run one sequence's new tokens after ``num_past`` cached ones.

        Parameters
        ----------
        tokens : ndarray, shape [n], dtype int64
        num_past : int
        past : list of (k, v), optional
            Per layer, shape [1, num_kv_heads, num_past, head_dim], C-contiguous;
            None when ``num_past == 0``.

        Returns
        -------
        logits : ndarray, shape [vocab_size]
            Of the last token.
        kv : list of (k, v)
            Per layer, the new tokens' K/V, shape [n, num_kv_heads, head_dim] (views).
        """
        io, n = self.io, tokens.shape[0]
        feeds = {"input_ids": tokens.astype(io.input_ids_dtype).reshape(1, n),
                 "attention_mask": np.ones((1, num_past + n), dtype=io.attention_mask_dtype)}
        if io.has_position_ids:
            feeds["position_ids"] = np.arange(num_past, num_past + n,
                                              dtype=io.position_ids_dtype).reshape(1, n)
        for layer in range(io.num_layers):
            k, v = past[layer] if past is not None else (self._empty_past(), self._empty_past())
            feeds[io.past_keys[layer]] = k
            feeds[io.past_values[layer]] = v
        outs = self.session.run(self._outputs, feeds)
        num_layers = io.num_layers
        kv = [(outs[1 + i][0, :, num_past:].transpose(1, 0, 2),
               outs[1 + num_layers + i][0, :, num_past:].transpose(1, 0, 2))
              for i in range(num_layers)]
        return outs[0][0, -1], kv

    def start_batch(self, gather: Gather, lens: np.ndarray, capacity: int) -> None:
        """Take a new decode batch.

        Parameters
        ----------
        gather : callable
            ``gather(layer, out)`` returns the batch's cached K/V of ``layer``,
            shape [B, num_kv_heads, T, head_dim] with ``T = max(lens)``, zero
            past each length; with ``out=(k, v)`` (any ``T >= max(lens)``) it
            fills those buffers.
        lens : ndarray, shape [B], dtype int64
            Cached tokens of each sequence.
        capacity : int
            Most positions any sequence will reach (a hint for preallocation).
        """
        raise NotImplementedError

    def decode(self, tokens: np.ndarray, lens: np.ndarray):
        """Feed one token per sequence of the batch.

        Parameters
        ----------
        tokens : ndarray, shape [B], dtype int64
        lens : ndarray, shape [B], dtype int64
            Tokens cached before each fed token (its position).

        Returns
        -------
        logits : ndarray, shape [B, vocab_size]
        kv : list of (k, v)
            Per layer, the fed tokens' K/V, shape [B, num_kv_heads, head_dim].
        """
        raise NotImplementedError

    def needs_gather(self, lens: np.ndarray) -> bool:
        """Whether the batch's buffers cannot take one more token at ``lens``."""
        return False

    def reset(self) -> None:
        """Forget the decode batch (its buffers are dropped)."""


class OptimumRunner(Runner):
    """present (past + new, concatenated by the model) is the next step's past."""

    def __init__(self, session, io) -> None:
        super().__init__(session, io)
        self.reset()

    def reset(self) -> None:
        self._past: list[tuple[np.ndarray, np.ndarray]] = []
        self._mask = None

    def start_batch(self, gather: Gather, lens: np.ndarray, capacity: int) -> None:
        # right padded with holes: sequence b holds positions [0, lens[b]); the
        # mask hides [lens[b], max(lens)); new tokens are appended after max(lens)
        self._past = [gather(layer, None) for layer in range(self.io.num_layers)]
        width = int(self._past[0][0].shape[2])
        self._mask = (np.arange(width)[None, :] < lens[:, None]).astype(
            self.io.attention_mask_dtype)

    def decode(self, tokens: np.ndarray, lens: np.ndarray):
        io, b = self.io, tokens.shape[0]
        mask = np.concatenate(
            [self._mask, np.ones((b, 1), dtype=io.attention_mask_dtype)], axis=1)
        feeds = {"input_ids": tokens.astype(io.input_ids_dtype).reshape(b, 1),
                 "attention_mask": mask}
        if io.has_position_ids:
            feeds["position_ids"] = lens.astype(io.position_ids_dtype).reshape(b, 1)
        for layer, (k, v) in enumerate(self._past):
            feeds[io.past_keys[layer]] = k
            feeds[io.past_values[layer]] = v
        outs = self.session.run(self._outputs, feeds)
        n = io.num_layers
        self._past = [(outs[1 + i], outs[1 + n + i]) for i in range(n)]
        self._mask = mask
        return outs[0][:, -1], [(k[:, :, -1], v[:, :, -1]) for k, v in self._past]


class GqaRunner(Runner):
    """Past and present share one preallocated buffer per layer (IOBinding)."""

    def __init__(self, session, io) -> None:
        super().__init__(session, io)
        self.reset()

    def reset(self) -> None:
        self._bufs: list[tuple[np.ndarray, np.ndarray]] = []
        self._binding = None
        self._logits = None
        self._inputs: tuple = ()
        self.capacity = 0

    def needs_gather(self, lens: np.ndarray) -> bool:
        return int(lens.max()) + 1 > self.capacity

    def start_batch(self, gather: Gather, lens: np.ndarray, capacity: int) -> None:
        io, b = self.io, lens.shape[0]
        capacity = max(int(capacity), int(lens.max()) + 1)
        shape = (b, io.num_kv_heads, capacity, io.head_dim)
        binding = self.session.io_binding()
        # logits first: with an unknown vocabulary it is get_outputs()[0]
        if io.vocab_size is not None:
            self._logits = np.empty((b, 1, io.vocab_size), dtype=io.logits_dtype)
            binding.bind_output(io.logits, "cpu", 0, self._logits.dtype, self._logits.shape,
                                self._logits.ctypes.data)
        else:
            self._logits = None
            binding.bind_output(io.logits, "cpu")
        bufs = []
        for layer in range(io.num_layers):
            k, v = np.empty(shape, io.dtype), np.empty(shape, io.dtype)
            gather(layer, (k, v))   # zero past each length: the op reads only seqlens_k
            for arr, src, dst in ((k, io.past_keys[layer], io.present_keys[layer]),
                                  (v, io.past_values[layer], io.present_values[layer])):
                value = ort.OrtValue.ortvalue_from_numpy(arr)
                binding.bind_ortvalue_input(src, value)
                binding.bind_ortvalue_output(dst, value)
            bufs.append((k, v))
        self._bufs, self._binding, self.capacity = bufs, binding, capacity

    def decode(self, tokens: np.ndarray, lens: np.ndarray):
        io, b, binding = self.io, tokens.shape[0], self._binding
        # right padding: seqlens_k = sum(mask) - 1 = lens, the new token's slot
        width = int(lens.max()) + 1
        mask = (np.arange(width)[None, :] <= lens[:, None]).astype(io.attention_mask_dtype)
        ids = tokens.astype(io.input_ids_dtype).reshape(b, 1)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        inputs = (ids, mask)
        if io.has_position_ids:
            pos = lens.astype(io.position_ids_dtype).reshape(b, 1)
            binding.bind_cpu_input("position_ids", pos)
            inputs += (pos,)
        self._inputs = inputs   # keep the bound arrays alive through the run
        self.session.run_with_iobinding(binding)
        logits = (self._logits if self._logits is not None
                  else binding.get_outputs()[0].numpy())
        rows = np.arange(b)
        kv = [(k[rows, :, lens], v[rows, :, lens]) for k, v in self._bufs]
        return logits[:, -1], kv


def make_runner(session: Any, io: ModelIO) -> Runner:
    """The runner for ``io.family``."""
    return GqaRunner(session, io) if io.family == "gqa" else OptimumRunner(session, io)
