"""The tool calls in a model's text: the formats, the parser, the streamed
hold-back and the OpenAI shapes of the calls found.

:func:`parse_calls` reads the calls out of a whole answer; :class:`ToolStream`
holds back a streamed answer's text from where a call may begin, and gives
the calls at its end. Text that is not a well-formed call (malformed JSON,
no ``name``, text after the calls) stays plain content. The request side
(the fields, the history, the grammar that forces a call) is
:mod:`~pagedkv_np.serve.tools`.

The format is the chat template's (:func:`detect_format`):

- ``"hermes"`` (Hermes 2 Pro, Qwen 2.5 / 3, SmolLM3 and most templates that
  take tools): each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``; chosen when the template mentions ``<tool_call>``, and
  for templates that use ``tools`` without a format this module knows;
- ``"llama3_json"`` (Llama 3.1 - 3.3): the answer is the JSON object
  ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``), several separated by ``;``; chosen when the template
  writes ``"parameters"``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "ToolStream", "TOOL_FORMATS", "HERMES_OPEN", "HERMES_CLOSE",
           "detect_format", "parse_calls", "calls_json", "call_deltas"]

#: the call formats this server writes and reads
TOOL_FORMATS = ("hermes", "llama3_json")
#: the tags around a Hermes call
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_OPEN, _CLOSE = HERMES_OPEN, HERMES_CLOSE
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a function name and its arguments as JSON
    text of an object (``json.dumps``'s separators)."""

    name: str
    arguments: str


def detect_format(template: str) -> str:
    """The call format (:data:`TOOL_FORMATS`) of a chat template's source."""
    if _OPEN in template:
        return "hermes"
    if '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def _call(obj: Any) -> ToolCall | None:
    """The call a decoded JSON value states, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _hermes_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    rest = text[start:]
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(_OPEN):
            return text, []   # text after a call: none of it is read as calls
        body = rest[len(_OPEN):]
        end = body.find(_CLOSE)
        # the closing tag may be missing at the very end (a stop string ate it)
        inner, rest = (body, "") if end < 0 else (body[:end], body[end + len(_CLOSE):])
        try:
            call = _call(json.loads(inner))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].strip() or None, calls


def _json_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return text, []
        call = _call(obj)
        if call is None or "name" not in obj or not ("parameters" in obj or "arguments" in obj):
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole answer in format ``fmt``: the calls
    it makes and the text before them (None when there is none), or
    ``(text, [])`` when it makes none or is not well formed."""
    if fmt == "llama3_json":
        return _json_calls(text)
    return _hermes_calls(text)


def _held_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolStream:
    """One streamed choice's text, held back from where a call may begin.

    :meth:`feed` returns the content that can go out now; :meth:`finish`
    the held rest and the calls. Invariant: the text fed is the content
    returned so far plus the held text, so nothing is lost when the held
    text turns out not to be a call.
    """

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self._held = ""
        self._calling = False
        self._plain = False   # llama3_json: the answer began with text, not a call

    def feed(self, text: str) -> str:
        """The content of ``text`` (and of what was held) that can go out now."""
        if self._calling:
            self._held += text
            return ""
        held, self._held = self._held + text, ""
        if self.format == "llama3_json":
            if self._plain:
                return held
            head = held.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                self._held = held
                return ""
            if head.startswith(("{", _PYTHON_TAG)):
                self._calling, self._held = True, held
                return ""
            self._plain = True
            return held
        start = held.find(_OPEN)
        if start >= 0:
            self._calling, self._held = True, held[start:]
            return held[:start]
        keep = _held_tail(held, _OPEN)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the held text as content when it is no call."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        _, calls = parse_calls(held, self.format)
        return ("", calls) if calls else (held, [])


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def calls_json(calls: list[ToolCall]) -> list[dict]:
    """A message's ``tool_calls``."""
    return [{"id": _call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """The stream deltas of ``calls``: for each, one with its index, id, type
    and name (empty arguments), then one with its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": _call_id(), "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    return out
