"""Feeding a decoder: prefill and batched decode steps for each I/O family.

A :class:`Runner` feeds one family: a prefill of one sequence after its
cached past, and decode steps of a batch whose contiguous past it keeps
between steps (:class:`OptimumRunner`: ``present`` becomes the next
``past``; :class:`GqaRunner`: one past/present buffer per layer, shared
through IOBinding). It knows nothing of pages: the engine hands it a
``gather`` callback when the batch changes, and takes the K/V of the
latest decode steps (:meth:`Runner.recent_kv`) to write into the cache.

A prompt's K/V stays with the runner until the engine takes it
(:meth:`Runner.prompt_kv`), layer by layer, handing each layer's memory
back once it is in the pages (:meth:`Runner.drop_prompt_layer`); or the
prompt's buffers become a batch of one's decode buffers
(:meth:`Runner.adopt_prompt`), so that a long prompt's K/V is never held
twice while it is fed and decoded alone.

See :mod:`pagedkv_np.onnxruntime.model_io` for the two families.

Longer than this package's modules usually are, on purpose: both families'
runners go through one life cycle of the prompt and decode buffers (kept
across chunks, adopted as decode buffers, written and released layer by
layer) that the base class defines and the batcher drives; the two
subclasses are its two halves.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from ..errors import ConfigError
from ..memory import lazy_zeros, release
from .model_io import ModelIO

__all__ = ["Runner", "OptimumRunner", "GqaRunner", "make_runner", "Gather", "Head", "Step",
           "LOGITS_TO_KEEP"]

#: The input of graphs that compute logits for only their last ``n`` positions
#: (0: every position), as onnxruntime-genai names (and feeds) it.
LOGITS_TO_KEEP = "num_logits_to_keep"
#: Its name in GGUF imports before format 4: an overridable initializer, default 0
_OLD_LOGITS_TO_KEEP = "logits_to_keep"

# gather(layer, out) -> (k, v): one layer's past K/V of the batch, [B, H, T, D]
Gather = Callable[[int, "tuple[np.ndarray, np.ndarray] | None"],
                  "tuple[np.ndarray, np.ndarray]"]
# head(rows [n, hidden]) -> logits [n, vocab] (pagedkv_np.onnxruntime.head.BlockHead)
Head = Callable[[np.ndarray], np.ndarray]
# step(tokens [B], lens [B], buffers) -> rows [B, width]: a decode step of its own
Step = Callable[[np.ndarray, np.ndarray, "list[tuple[np.ndarray, np.ndarray]]"], np.ndarray]


class Runner:
    """Feeds one model family; holds the decode batch's contiguous K/V.

    Between :meth:`start_batch` calls the batch is fixed: each :meth:`decode`
    feeds one token per sequence and keeps the grown past for the next one.
    """

    def __init__(self, session: Any, io: ModelIO, head: Head | None = None) -> None:
        self.session = session
        self.io = io
        self.head = head
        self.capacity = 0
        self._outputs = [io.logits, *io.present_keys, *io.present_values]
        # a graph that can skip the logits of all but the last position
        # (pagedkv_np.models.graph): a prompt needs only its last token's
        # (fed on every run: a plain input must be, an old graph's initializer may be)
        names = {arg.name for arg in session.get_inputs()}
        names |= {arg.name for arg in session.get_overridable_initializers()}
        self._keep_name = next((n for n in (LOGITS_TO_KEEP, _OLD_LOGITS_TO_KEEP) if n in names),
                               None)
        self._last_logits = None if self._keep_name is None else np.ones(1, np.int64)
        self._prompt: Any = None          # what a prompt's next chunk continues from
        self._prompt_positions = 0
        self._prompt_capacity = 0

    def _logits(self, rows: np.ndarray) -> np.ndarray:
        """Logits [n, vocab] of the output's rows [n, width]: the rows
        themselves, or the engine-side head's product of hidden states."""
        return rows if self.head is None else self.head(rows)

    def _empty_past(self) -> np.ndarray:
        return np.zeros((1, self.io.num_kv_heads, 0, self.io.head_dim), dtype=self.io.dtype)

    def prefill(self, tokens: np.ndarray, num_past: int, past: Gather | None = None,
                capacity: int | None = None):
        """Run one sequence's new tokens after ``num_past`` cached ones: a
        whole prompt, or one chunk of it.

        Parameters
        ----------
        tokens : ndarray, shape [n], dtype int64
        num_past : int
        past : callable, optional
            ``gather(layer, out)`` of the cached past, as for
            :meth:`start_batch` (``T >= num_past``). None when ``num_past``
            is 0, or to continue the prompt of the previous call, whose K/V
            the runner kept because that call's ``capacity`` went further.
        capacity : int, optional
            Positions the prompt may reach with the chunks still to come
            and the decode steps after it (default ``num_past + n``); a
            GroupQueryAttention model fills one buffer of this size in
            place, chunk after chunk. The runner keeps the prompt's K/V
            (for the next chunk, :meth:`prompt_kv` and :meth:`adopt_prompt`)
            until :meth:`forget_prompt`, :meth:`adopt_prompt` or the next
            prompt; a failed continuation keeps what the earlier calls left.

        Returns
        -------
        logits : ndarray, shape [vocab_size]
            Of the last token.
        kv : list of (k, v)
            Per layer, the new tokens' K/V, shape [n, num_kv_heads, head_dim] (views).

        Raises
        ------
        ConfigError
            ``past`` is None with ``num_past > 0`` and the runner holds no
            prompt of ``num_past`` positions to continue, or the tokens go
            past the capacity of the prompt it holds.
        """
        n = tokens.shape[0]
        total = num_past + n
        capacity = total if capacity is None else max(int(capacity), total)
        kept, positions = self._prompt, self._prompt_positions
        continues = past is None and num_past > 0
        if continues and positions != num_past:
            raise ConfigError(f"Invalid prefill: no prompt of {num_past} positions to "
                              f"continue (the runner holds {positions})")
        if continues and total > self._prompt_capacity:
            raise ConfigError(f"Invalid prefill: {n} tokens after {num_past} go past the "
                              f"{self._prompt_capacity} positions of the prompt's buffers")
        if not continues:
            self.forget_prompt()      # before the new buffers: never two prompts at once
        logits, kv, state = self._run_prompt(tokens, num_past, past, capacity,
                                             kept if continues else None)
        self._prompt, self._prompt_positions = state, total
        if not continues:
            self._prompt_capacity = capacity
        return logits, kv

    def _run_prompt(self, tokens: np.ndarray, num_past: int, past: Gather | None,
                    capacity: int, kept: Any):
        """(logits, kv, state to continue from): see :meth:`prefill`; ``kept``
        is the state of the previous call to continue, else None."""
        raise NotImplementedError

    @property
    def prompt_positions(self) -> int:
        """Positions of the kept prompt (0: none is kept)."""
        return self._prompt_positions if self._prompt is not None else 0

    def forget_prompt(self) -> None:
        """Drop the K/V kept for a prompt's next chunk."""
        self._prompt = None
        self._prompt_positions = 0
        self._prompt_capacity = 0

    def _prompt_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept prompt's K/V arrays of ``layer``, [1, H, T, D]."""
        raise NotImplementedError

    def prompt_kv(self, layer: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept prompt's K/V of ``layer`` at positions ``[start, end)``.

        Returns
        -------
        k, v : ndarray, shape [end - start, num_kv_heads, head_dim] (views)

        Raises
        ------
        ConfigError
            No prompt is kept, or the range is not within its positions.
        """
        if self._prompt is None or not 0 <= start <= end <= self._prompt_positions:
            raise ConfigError(f"Invalid prompt_kv: positions [{start}, {end}) of a kept "
                              f"prompt of {self._prompt_positions}")
        k, v = self._prompt_layer(layer)
        return k[0, :, start:end].transpose(1, 0, 2), v[0, :, start:end].transpose(1, 0, 2)

    def drop_prompt_layer(self, layer: int) -> None:
        """Hand back the memory of the kept prompt's ``layer`` (its K/V is in
        the pages): the prompt reads zero there, so forget it before the next
        prefill."""

    def adopt_prompt(self) -> None:
        """Make the kept prompt the decode batch: one sequence of the
        prompt's positions, in the prompt's own buffers (no gather); the
        prompt is forgotten.

        Raises
        ------
        ConfigError
            No prompt is kept.
        """
        if self._prompt is None:
            raise ConfigError("Invalid adopt_prompt: the runner keeps no prompt")
        self.reset()
        self._adopt(self._prompt, self._prompt_positions, self._prompt_capacity)
        self._prompt = None      # the batch holds the buffers now
        self.forget_prompt()

    def _adopt(self, state: Any, positions: int, capacity: int) -> None:
        raise NotImplementedError

    def _batch_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The decode batch's K/V arrays of ``layer``, [B, H, T, D]."""
        raise NotImplementedError

    def solo_kv(self, layer: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K/V of ``layer`` at positions ``[start, end)`` of a decode batch of
        one sequence (such as an adopted prompt), shape
        [end - start, num_kv_heads, head_dim] (views).

        Raises
        ------
        ConfigError
            The batch is not one sequence, or the range is outside its buffers.
        """
        k, v = self._batch_layer(layer)
        if k.shape[0] != 1 or not 0 <= start <= end <= k.shape[2]:
            raise ConfigError(f"Invalid solo_kv: positions [{start}, {end}) of a batch of "
                              f"{k.shape[0]} over {k.shape[2]} positions")
        return k[0, :, start:end].transpose(1, 0, 2), v[0, :, start:end].transpose(1, 0, 2)

    def drop_batch_layer(self, layer: int) -> None:
        """Hand back the memory of the decode batch's ``layer`` (its K/V is in
        the pages): reset the batch before the next decode step."""

    def _prompt_feeds(self, tokens: np.ndarray, num_past: int) -> dict[str, np.ndarray]:
        io, n = self.io, tokens.shape[0]
        feeds = {"input_ids": tokens.astype(io.input_ids_dtype).reshape(1, n),
                 "attention_mask": np.ones((1, num_past + n), dtype=io.attention_mask_dtype)}
        if io.has_position_ids:
            feeds["position_ids"] = np.arange(num_past, num_past + n,
                                              dtype=io.position_ids_dtype).reshape(1, n)
        if self._keep_name is not None and self._last_logits is not None:
            feeds[self._keep_name] = self._last_logits
        return feeds

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

    def decode(self, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence of the batch.

        Parameters
        ----------
        tokens : ndarray, shape [B], dtype int64
        lens : ndarray, shape [B], dtype int64
            Tokens cached before each fed token (its position).

        Returns
        -------
        logits : ndarray, shape [B, vocab_size]

        All or nothing: when it raises, the buffers still hold the K/V of
        every earlier decode step (:meth:`recent_kv` gives them), so that the
        engine can write them and run the batch's requests again apart.
        Positions from ``lens`` on may have been overwritten: they hold
        nothing yet.
        """
        raise NotImplementedError

    def recent_kv(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The K/V of the tokens fed by the last ``n`` :meth:`decode` calls
        (all since :meth:`start_batch`, at most).

        Returns
        -------
        list of (k, v)
            Per layer, shape [B * n, num_kv_heads, head_dim]: sequence 0's
            ``n`` tokens in order, then sequence 1's, and so on.
        """
        raise NotImplementedError

    def needs_gather(self, longest: int) -> bool:
        """Whether the batch's buffers cannot take one more token after
        ``longest`` cached ones."""
        return False

    #: whether a row's buffer index is its position (:meth:`rows_kv` works, and
    #: a prompt's K/V may be copied into a batch's row before it is in the pages)
    positional = False

    def rows_kv(self, layer: int, rows: list[int], starts: np.ndarray,
                ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K/V of ``layer`` at positions ``[starts[i], ends[i])`` of the
        decode batch's row ``rows[i]``, concatenated in that order.

        Returns
        -------
        k, v : ndarray, shape [sum(ends - starts), num_kv_heads, head_dim]

        Raises
        ------
        ConfigError
            The runner is not :attr:`positional`, or a range lies outside a
            row's buffer.
        """
        if not self.positional:
            raise ConfigError(f"Invalid rows_kv: {type(self).__name__} does not keep "
                              f"a row's positions at their index")
        k, v = self._batch_layer(layer)
        parts_k, parts_v = [], []
        for b, start, end in zip(rows, starts.tolist(), ends.tolist()):
            if not (0 <= b < k.shape[0] and 0 <= start <= end <= k.shape[2]):
                raise ConfigError(f"Invalid rows_kv: positions [{start}, {end}) of row {b} "
                                  f"of a batch of {k.shape[0]} over {k.shape[2]} positions")
            parts_k.append(k[b, :, start:end].transpose(1, 0, 2))
            parts_v.append(v[b, :, start:end].transpose(1, 0, 2))
        if not parts_k:
            empty = np.zeros((0, k.shape[1], k.shape[3]), k.dtype)
            return empty, empty.copy()
        return np.concatenate(parts_k), np.concatenate(parts_v)

    def reset(self) -> None:
        """Forget the decode batch (its buffers are dropped)."""


class OptimumRunner(Runner):
    """present (past + new, concatenated by the model) is the next step's past."""

    def __init__(self, session, io, head=None) -> None:
        super().__init__(session, io, head)
        self.reset()

    def reset(self) -> None:
        self._past: list[Any] = []
        self._mask: np.ndarray | None = None

    def _prompt_layer(self, layer):
        return self._prompt[layer]

    def drop_prompt_layer(self, layer: int) -> None:
        if self._prompt is not None:
            self._prompt[layer] = None    # freed with the caller's last view

    def _adopt(self, state, positions, capacity):
        self._past = list(state)
        self._mask = np.ones((1, positions), dtype=self.io.attention_mask_dtype)

    def _batch_layer(self, layer):
        return self._past[layer]

    def drop_batch_layer(self, layer: int) -> None:
        if self._past:
            self._past[layer] = None

    def _run_prompt(self, tokens, num_past, past, capacity, kept):
        io = self.io
        feeds = self._prompt_feeds(tokens, num_past)
        for layer in range(io.num_layers):
            if past is not None:
                k, v = past(layer, None)
            elif kept is not None:
                k, v = kept[layer]
            else:
                k, v = self._empty_past(), self._empty_past()
            feeds[io.past_keys[layer]] = k
            feeds[io.past_values[layer]] = v
        outs = self.session.run(self._outputs, feeds)
        n = io.num_layers
        present = [(outs[1 + i], outs[1 + n + i]) for i in range(n)]   # [1, H, T, D]
        kv = [(k[0, :, num_past:].transpose(1, 0, 2), v[0, :, num_past:].transpose(1, 0, 2))
              for k, v in present]
        return self._logits(outs[0][0, -1:])[0], kv, present

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
        if self._keep_name is not None and self._last_logits is not None:
            feeds[self._keep_name] = self._last_logits   # one position: the same as all
        for layer, (k, v) in enumerate(self._past):
            feeds[io.past_keys[layer]] = k
            feeds[io.past_values[layer]] = v
        outs = self.session.run(self._outputs, feeds)
        n = io.num_layers
        logits = self._logits(outs[0][:, -1])
        self._past = [(outs[1 + i], outs[1 + n + i]) for i in range(n)]
        self._mask = mask
        return logits

    def recent_kv(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # the fed tokens are the last n columns of every row
        return [(_rows_of(k[:, :, -n:]), _rows_of(v[:, :, -n:])) for k, v in self._past]


class GqaRunner(Runner):
    """Past and present share one preallocated buffer per layer (IOBinding).

    ``step``, when given, computes decode steps instead of the session:
    ``step(tokens, lens, buffers)`` writes each new token's K/V into the
    per-layer ``buffers`` at ``lens`` and returns the rows the graph would
    output (logits, or hidden states for ``head``), e.g.
    :class:`~pagedkv_np.onnxruntime.native.NativeDecode`; one with a
    ``takes(rows)`` method computes only the batches it says yes to.
    """

    def __init__(self, session, io, head=None, step: Step | None = None) -> None:
        super().__init__(session, io, head)
        self.step = step
        self.reset()

    def reset(self) -> None:
        self._bufs: list[tuple[np.ndarray, np.ndarray]] = []
        self._binding: Any = None   # an onnxruntime IOBinding (untyped) once a batch starts
        self._out: np.ndarray | None = None
        self._inputs: tuple = ()
        self._next: np.ndarray | None = None
        self.capacity = 0

    positional = True

    def needs_gather(self, longest: int) -> bool:
        return longest + 1 > self.capacity

    def _prompt_layer(self, layer):
        return self._prompt[0][layer]

    def drop_prompt_layer(self, layer: int) -> None:
        if self._prompt is not None:
            for arr in self._prompt[0][layer]:
                release(arr)

    def _batch_layer(self, layer):
        return self._bufs[layer]

    def drop_batch_layer(self, layer: int) -> None:
        if self._bufs:
            for arr in self._bufs[layer]:
                release(arr)

    def _adopt(self, state, positions, capacity):
        bufs = state[0]
        self._bind_batch(bufs, 1)
        self.capacity = int(bufs[0][0].shape[2])

    def _run_prompt(self, tokens, num_past, past, capacity, kept):
        io, n = self.io, tokens.shape[0]
        if kept is not None:
            bufs, binding = kept          # the previous chunk's, filled in place
        else:
            # past and present share one buffer per layer, as in decode steps
            shape = (1, io.num_kv_heads, capacity, io.head_dim)
            binding = self.session.io_binding()
            binding.bind_output(io.logits, "cpu")     # first: get_outputs()[0]
            bufs = []
            for layer in range(io.num_layers):
                k, v = lazy_zeros(shape, io.dtype), lazy_zeros(shape, io.dtype)
                if past is not None:
                    past(layer, (k, v))
                for arr, src, dst in ((k, io.past_keys[layer], io.present_keys[layer]),
                                      (v, io.past_values[layer], io.present_values[layer])):
                    value = ort.OrtValue.ortvalue_from_numpy(arr)
                    binding.bind_ortvalue_input(src, value)
                    binding.bind_ortvalue_output(dst, value)
                bufs.append((k, v))
        # as OrtValues: bind_cpu_input refuses an input with a default (logits_to_keep)
        feeds = self._prompt_feeds(tokens, num_past)     # alive until the run ends
        values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in feeds.items()}
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(io.logits, "cpu")   # a fresh array of this chunk's shape
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        end = num_past + n
        kv = [(k[0, :, num_past:end].transpose(1, 0, 2), v[0, :, num_past:end].transpose(1, 0, 2))
              for k, v in bufs]
        return self._logits(logits[0, -1:])[0], kv, (bufs, binding)

    def start_batch(self, gather: Gather, lens: np.ndarray, capacity: int) -> None:
        io, b = self.io, lens.shape[0]
        capacity = max(int(capacity), int(lens.max()) + 1)
        shape = (b, io.num_kv_heads, capacity, io.head_dim)
        bufs = []
        for layer in range(io.num_layers):
            k, v = lazy_zeros(shape, io.dtype), lazy_zeros(shape, io.dtype)
            gather(layer, (k, v))   # zero past each length: the op reads only seqlens_k
            bufs.append((k, v))
        self._bind_batch(bufs, b)
        self.capacity = capacity

    def _bind_batch(self, bufs: list[tuple[np.ndarray, np.ndarray]], b: int) -> None:
        """Bind ``bufs`` (per layer, [b, H, T, D]) as a decode batch's past and present."""
        io = self.io
        binding = self.session.io_binding()
        # logits first: with an unknown vocabulary it is get_outputs()[0]
        if io.vocab_size is not None and self.head is None:
            self._out = np.empty((b, 1, io.vocab_size), dtype=io.logits_dtype)
            binding.bind_output(io.logits, "cpu", 0, self._out.dtype, self._out.shape,
                                self._out.ctypes.data)
        else:
            self._out = None
            binding.bind_output(io.logits, "cpu")
        for layer, (k, v) in enumerate(bufs):
            for arr, src, dst in ((k, io.past_keys[layer], io.present_keys[layer]),
                                  (v, io.past_values[layer], io.present_values[layer])):
                value = ort.OrtValue.ortvalue_from_numpy(arr)
                binding.bind_ortvalue_input(src, value)
                binding.bind_ortvalue_output(dst, value)
        if self._keep_name is not None and self._last_logits is not None:
            # an OrtValue: bind_cpu_input refuses an old graph's input with a default
            self._keep = ort.OrtValue.ortvalue_from_numpy(self._last_logits)
            binding.bind_ortvalue_input(self._keep_name, self._keep)
        self._bufs, self._binding = bufs, binding

    def decode(self, tokens: np.ndarray, lens: np.ndarray):
        takes = getattr(self.step, "takes", None)    # a step may leave some batches to the graph
        if self.step is not None and (takes is None or takes(tokens.shape[0])):
            rows = self.step(tokens, lens, self._bufs)
            self._next = lens + 1
            return self._logits(rows)
        io, b, binding = self.io, tokens.shape[0], self._binding
        # right padding: seqlens_k = sum(mask) - 1 = lens, the new token's slot
        width = int(lens.max()) + 1
        mask = (np.arange(width)[None, :] <= lens[:, None]).astype(io.attention_mask_dtype)
        ids = tokens.astype(io.input_ids_dtype).reshape(b, 1)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        inputs: tuple[np.ndarray, ...] = (ids, mask)
        if io.has_position_ids:
            pos = lens.astype(io.position_ids_dtype).reshape(b, 1)
            binding.bind_cpu_input("position_ids", pos)
            inputs += (pos,)
        self._inputs = inputs   # keep the bound arrays alive through the run
        self.session.run_with_iobinding(binding)
        out = self._out if self._out is not None else binding.get_outputs()[0].numpy()
        self._next = lens + 1
        return self._logits(out[:, -1])

    def recent_kv(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # sequence b's fed tokens sit at its positions: [next[b] - n, next[b])
        # (_next is None only before the batch's first decode, which comes first)
        cols = self._next[:, None] + np.arange(-n, 0)  # type: ignore[index]
        rows = np.arange(cols.shape[0])[:, None]
        # advanced indices around a slice: the result is [B, n, H, D]
        return [(_flat(k[rows, :, cols]), _flat(v[rows, :, cols])) for k, v in self._bufs]


def _flat(x: np.ndarray) -> np.ndarray:
    """[B, n, H, D] -> [B * n, H, D]."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


def _rows_of(x: np.ndarray) -> np.ndarray:
    """[B, H, n, D] -> [B * n, H, D], sequence-major (a copy unless n == 1)."""
    return _flat(x.transpose(0, 2, 1, 3))


def make_runner(session: Any, io: ModelIO, head: Head | None = None,
                step: Step | None = None) -> Runner:
    """The runner for ``io.family``; ``head`` turns the graph's ``hidden``
    output into logits when the graph has no head of its own; ``step``: a
    ``"gqa"`` runner's own decode step (see :class:`GqaRunner`)."""
    if step is not None and io.family != "gqa":
        raise ConfigError(f"Invalid step: a decode step of its own needs the gqa family, "
                          f"not {io.family!r}")
    return (GqaRunner(session, io, head, step) if io.family == "gqa"
            else OptimumRunner(session, io, head))
