"""The OpenAI response and chunk shapes: whole responses, server-sent
events, usage.

The ``*_response`` functions build a whole answer, the ``*_chunk`` functions
one streamed event's object, :func:`update_events` the events of one engine
:class:`~pagedkv_np.serve.engine_loop.Update` (its text, the logprobs of its
tokens, its finish and usage). With tools, a chat answer's calls are
``message.tool_calls`` (whole) or ``delta.tool_calls`` (streamed), and its
finish reason ``"tool_calls"``.
"""

from __future__ import annotations

import json

from .engine_loop import Update
from .http_errors import api_error, shutdown_error
from .logprobs import LogprobWriter
from .protocol import GenerationRequest
from .tool_calls import ToolCall, ToolStream, call_deltas, calls_json, parse_calls
from .tools import ToolRequest

__all__ = ["best_choices", "usage_json", "choices_usage", "chat_response",
           "completion_response", "chat_chunk", "completion_chunk", "usage_chunk", "sse",
           "SSE_DONE", "update_events"]


def usage_json(num_prompt_tokens: int, num_completion_tokens: int,
               num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def choices_usage(last: list[Update]) -> dict:
    """The usage of a request from its choices' last updates (the prompt
    counted once)."""
    return usage_json(last[0].num_prompt_tokens, sum(u.num_completion_tokens for u in last),
                      last[0].num_cached_tokens)


def _message(text: str, reason: str | None, tools: ToolRequest | None) -> tuple[dict, str | None]:
    """A whole answer's message and finish reason: with tools, the calls the
    text makes go in ``tool_calls`` and the reason is ``"tool_calls"``."""
    calls: list[ToolCall] = []
    content: str | None = text
    if tools is not None and tools.parses:
        content, calls = parse_calls(text, tools.format)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    message = {"role": "assistant", "content": content, "tool_calls": calls_json(calls)}
    return message, ("tool_calls" if reason == "stop" else reason)


def best_choices(choices: list[tuple], scores: list[float], n: int) -> list[tuple]:
    """The ``n`` choices of highest ``scores`` (each candidate's cumulative
    token logprob, as vLLM ranks ``best_of`` candidates; OpenAI says "highest
    log probability per token" without saying how it is summed), best
    first; all of them, in order, when there are ``n``."""
    if len(choices) == n:
        return choices
    order = sorted(range(len(choices)), key=lambda i: -scores[i])
    return [choices[i] for i in order[:n]]


def chat_response(response_id: str, created: int, model: str, choices: list[tuple],
                  usage: dict, tools: ToolRequest | None = None) -> dict:
    """A whole chat answer; ``choices``: ``(text, finish_reason, logprobs)`` of
    each choice, in index order; ``tools``: the request's, whose calls are
    read out of each text."""
    out = []
    for i, (text, reason, logprobs) in enumerate(choices):
        message, reason = _message(text, reason, tools)
        out.append({"index": i, "message": message, "logprobs": logprobs,
                    "finish_reason": reason})
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": out, "usage": usage}


def completion_response(response_id: str, created: int, model: str, choices: list[tuple],
                        usage: dict) -> dict:
    """A whole completion; ``choices`` as for :func:`chat_response`."""
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "logprobs": logprobs,
                         "finish_reason": reason}
                        for i, (text, reason, logprobs) in enumerate(choices)],
            "usage": usage}


def chat_chunk(response_id: str, created: int, model: str, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    """A ``chat.completion.chunk``; ``delta`` is ``{"role": ...}``,
    ``{"content": ...}`` or ``{}`` (with the finish reason)."""
    return {"id": response_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}


def completion_chunk(response_id: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(kind: str, response_id: str, created: int, model: str, usage: dict) -> dict:
    """The last chunk of a stream asked for with ``stream_options.include_usage``."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def update_events(update: Update, req: GenerationRequest, response_id: str, created: int,
                  model: str, writer: LogprobWriter | None = None,
                  calls: ToolStream | None = None) -> list[bytes]:
    """The server-sent events of one update, for choice ``update.index`` (its
    tokens' logprobs ride on its text chunk, with ``writer``; its text goes
    through ``calls``, which holds back a tool call until the finish, then
    sends it as ``delta.tool_calls``). The usage chunk is the caller's: it
    follows the last choice's finish."""
    chat = req.kind == "chat"
    if update.finish_reason in ("error", "abort"):
        err = api_error(update.error) if update.error is not None else shutdown_error()
        return [sse(err.to_json())]
    out = []
    index = update.index
    logprobs = (writer.format(update.logprobs)
                if writer is not None and update.logprobs else None)
    text, found = update.text, list[ToolCall]()
    if calls is not None:
        text = calls.feed(text)
        if update.finish_reason is not None:
            rest, found = calls.finish()
            text += rest
    if text or logprobs is not None:
        out.append(sse(chat_chunk(response_id, created, model, {"content": text},
                                  logprobs=logprobs, index=index)
                       if chat else completion_chunk(response_id, created, model,
                                                     text, logprobs=logprobs,
                                                     index=index)))
    out.extend(sse(chat_chunk(response_id, created, model, delta, index=index))
               for delta in call_deltas(found))
    reason = "tool_calls" if found and update.finish_reason == "stop" else update.finish_reason
    if reason is not None:
        out.append(sse(chat_chunk(response_id, created, model, {}, reason, index=index) if chat
                       else completion_chunk(response_id, created, model, "", reason,
                                             index=index)))
    return out
