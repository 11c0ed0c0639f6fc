"""Tool calls on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice``
and ``parallel_tool_calls``, the grammar that forces a call, and the calls
read back out of a model's text.

Three steps, one per part of a request's life:

- :func:`parse_tools` checks the request's fields (a 400 naming the field for
  anything wrong) into a :class:`ToolRequest`; :func:`message_fields` checks
  the ``tool_calls`` of assistant messages and the ``tool_call_id`` of tool
  messages in the history. The tools go to the chat template as its
  ``tools`` variable, as ``transformers``' ``apply_chat_template`` passes
  them (the ``{"type": "function", "function": {...}}`` objects), and the
  arguments of earlier calls as objects (parsed from OpenAI's JSON text), as
  the templates index them.
- :func:`call_grammar` builds the constraint of ``tool_choice`` ``"required"``
  or a named function: the format's wrapper text around a JSON object whose
  ``name`` is one of the tools (or the named one) and whose arguments
  validate against that tool's ``parameters``. One call, or one or more with
  ``parallel_tool_calls: true``. ``"auto"`` is not constrained.
- :func:`parse_calls` reads the calls out of a whole answer;
  :class:`ToolStream` holds back a streamed answer's text from where a call
  may begin, and gives the calls at its end. Text that is not a well-formed
  call (malformed JSON, no ``name``, text after the calls) stays plain
  content.

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
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .api_error import APIError, json_type

__all__ = ["ToolCall", "ToolRequest", "ToolStream", "TOOL_FORMATS", "MAX_TOOLS", "parse_tools",
           "message_fields", "detect_format", "call_grammar", "parse_calls", "calls_json",
           "call_deltas"]

#: the call formats this server writes and reads
TOOL_FORMATS = ("hermes", "llama3_json")
#: most tools a request may give
MAX_TOOLS = 128
_CHOICES = ("auto", "none", "required")
# OpenAI's rule for function names
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# the separators json.dumps writes, as the constraint fixes them
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _wrong_type(name: str, expected: str, value: Any) -> APIError:
    return APIError(f"Invalid type for '{name}': expected {expected}, got {json_type(value)}",
                    code="invalid_type", param=name)


def _invalid(name: str, message: str) -> APIError:
    return APIError(f"Invalid value for '{name}': {message}", code="invalid_value", param=name)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a function name and its arguments as JSON
    text of an object (``json.dumps``'s separators)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool fields.

    ``choice`` is ``"auto"``, ``"none"``, ``"required"`` or ``"function"``
    (then ``name`` is the function). ``format`` is the served template's
    (:data:`TOOL_FORMATS`), set by the server once it knows the template.
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = False
    format: str = "hermes"

    @property
    def forced(self) -> bool:
        """The answer must be a call (the output is constrained)."""
        return self.choice in ("required", "function")

    @property
    def parses(self) -> bool:
        """Calls are read out of the answer (any choice but ``"none"``)."""
        return self.choice != "none"


def _tool(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _wrong_type(where, "an object", tool)
    if tool.get("type", "function") != "function":
        raise _invalid(f"{where}.type", f"only function tools are supported, got "
                                        f"{str(tool.get('type'))[:32]!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _wrong_type(f"{where}.function", "an object", fn)
    name = fn.get("name")
    if name is None:
        raise APIError(f"Missing required parameter: '{where}.function.name'",
                       code="missing_required_parameter", param=f"{where}.function.name")
    if not isinstance(name, str):
        raise _wrong_type(f"{where}.function.name", "a string", name)
    if not _NAME.fullmatch(name):
        raise _invalid(f"{where}.function.name", f"1 to 64 letters, digits, '_' or '-', "
                                                 f"got {name[:70]!r}")
    out: dict = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise _wrong_type(f"{where}.function.description", "a string", fn["description"])
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise _wrong_type(f"{where}.function.parameters", "a JSON schema object", params)
    if params.get("type", "object") != "object":
        raise _invalid(f"{where}.function.parameters", f"the arguments are an object: expected "
                                                       f"type 'object', got "
                                                       f"{str(params.get('type'))[:32]!r}")
    out["parameters"] = params
    if fn.get("strict") is not None:
        if not isinstance(fn["strict"], bool):
            raise _wrong_type(f"{where}.function.strict", "a boolean", fn["strict"])
        out["strict"] = fn["strict"]
    return {"type": "function", "function": out}


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in _CHOICES:
            raise _invalid("tool_choice", f"expected one of {', '.join(_CHOICES)} or "
                                          f"{{\"type\": \"function\", \"function\": {{\"name\": "
                                          f"...}}}}, got {value[:32]!r}")
        return value, None
    if not isinstance(value, dict):
        raise _wrong_type("tool_choice", "a string or an object", value)
    fn = value.get("function")
    if value.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise _invalid("tool_choice", "an object must be {\"type\": \"function\", "
                                      "\"function\": {\"name\": NAME}}")
    if fn["name"] not in names:
        raise _invalid("tool_choice", f"no tool named {fn['name'][:70]!r} among 'tools' "
                                      f"({', '.join(names) or 'none given'})")
    return "function", fn["name"]


def parse_tools(body: dict) -> ToolRequest | None:
    """The checked ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a
    chat body; None when it gives no tools.

    ``tool_choice`` defaults to ``"auto"`` with tools; ``"required"`` and a
    named function need tools. ``parallel_tool_calls`` (default false, as
    llama.cpp's server) lets a forced answer hold more than one call.

    Raises
    ------
    APIError
        400 naming the field: ``tools`` not an array of function tools, a
        tool without ``function.name`` or with a name twice, ``parameters``
        not an object schema, an unknown ``tool_choice`` or one naming no
        tool, ``parallel_tool_calls`` not a boolean.
    """
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array", tools)
    if len(tools) > MAX_TOOLS:
        raise _invalid("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _invalid("tools", f"each function name once, got {twice[0]!r} twice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _wrong_type("parallel_tool_calls", "a boolean", parallel)
    choice, name = _choice(body.get("tool_choice"), names)
    if not checked:
        if choice == "required":
            raise _invalid("tool_choice", "'required' needs 'tools'")
        return None
    return ToolRequest(tuple(checked), choice, name, bool(parallel))


def _history_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict):
        raise _wrong_type(where, "an object", call)
    if call.get("type", "function") != "function":
        raise _invalid(f"{where}.type", "only function calls are supported")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _wrong_type(f"{where}.function", "an object", fn)
    if not isinstance(fn.get("name"), str):
        raise _wrong_type(f"{where}.function.name", "a string", fn.get("name"))
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except (ValueError, RecursionError):
            raise _invalid(f"{where}.function.arguments", "not JSON text (or nested too "
                                                          "deeply)") from None
    if not isinstance(args, dict):
        raise _wrong_type(f"{where}.function.arguments", "JSON text of an object", args)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise _wrong_type(f"{where}.id", "a string", call["id"])
        out["id"] = call["id"]
    return out


def message_fields(where: str, role: str, msg: dict) -> dict:
    """The tool fields of a history message ``msg`` (at ``where``, such as
    ``messages[2]``), checked, as the chat template reads them: an
    assistant's ``tool_calls`` (arguments as objects), a tool message's
    ``tool_call_id`` (required) and ``name``.

    Raises
    ------
    APIError
        400 naming the field.
    """
    out: dict = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _invalid(f"{where}.tool_calls", f"only assistant messages make calls, "
                                                  f"not {role}")
        if not isinstance(calls, list):
            raise _wrong_type(f"{where}.tool_calls", "an array", calls)
        if calls:
            out["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", c)
                                 for j, c in enumerate(calls)]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is None:
            raise APIError(f"Missing required parameter: '{where}.tool_call_id'",
                           code="missing_required_parameter", param=f"{where}.tool_call_id")
        if not isinstance(call_id, str):
            raise _wrong_type(f"{where}.tool_call_id", "a string", call_id)
        out["tool_call_id"] = call_id
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise _wrong_type(f"{where}.name", "a string", msg["name"])
        out["name"] = msg["name"]
    return out


def detect_format(template: str) -> str:
    """The call format (:data:`TOOL_FORMATS`) of a chat template's source."""
    if _OPEN in template:
        return "hermes"
    if '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def _call_schema(tool: dict, key: str) -> dict:
    fn = tool["function"]
    params = fn["parameters"]
    if "type" not in params:
        params = dict(params, type="object")
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(req: ToolRequest) -> tuple[str, Any]:
    """``(kind, spec)`` for ``decoder.make_constraint``: the answer a forced
    ``tool_choice`` allows (see the module's docstring)."""
    tools = [t for t in req.tools if req.choice != "function"
             or t["function"]["name"] == req.name]
    key = "parameters" if req.format == "llama3_json" else "arguments"
    options = [_call_schema(t, key) for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if req.format == "llama3_json":
        if not req.parallel:
            return "json_schema", schema
        call = "%json " + json.dumps(dict(schema, **{"x-guidance": _SEPARATORS}))
        return "lark", f'start: call ("; " call)*\ncall: {call}'
    call = "%json " + json.dumps(dict(schema, **{"x-guidance": _SEPARATORS}))
    start = 'start: block ("\\n" block)*' if req.parallel else "start: block"
    return "lark", f'{start}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}'


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

    @classmethod
    def for_request(cls, req: ToolRequest | None) -> ToolStream | None:
        """A stream for a request whose calls are read (None otherwise)."""
        return cls(req.format) if req is not None and req.parses else None

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
