"""Tool calls on ``/v1/chat/completions``, the request side: OpenAI's
``tools``, ``tool_choice`` and ``parallel_tool_calls``, the history's calls,
and the grammar that forces a call.

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

The formats, and the calls read back out of a model's text, are
:mod:`~pagedkv_np.serve.tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .api_error import APIError, json_type
from .tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolStream

__all__ = ["ToolRequest", "MAX_TOOLS", "parse_tools", "message_fields", "call_grammar",
           "tool_stream"]

#: most tools a request may give
MAX_TOOLS = 128
_CHOICES = ("auto", "none", "required")
# OpenAI's rule for function names
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# the separators json.dumps writes, as the constraint fixes them
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _required_string(obj: dict, key: str, param: str) -> str:
    """``obj[key]``, a string that must be there (a 400 naming ``param`` if not)."""
    value = obj.get(key)
    if value is None:
        raise APIError(f"Missing required parameter: '{param}'",
                       code="missing_required_parameter", param=param)
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    return value


def _wrong_type(name: str, expected: str, value: Any) -> APIError:
    return APIError(f"Invalid type for '{name}': expected {expected}, got {json_type(value)}",
                    code="invalid_type", param=name)


def _invalid(name: str, message: str) -> APIError:
    return APIError(f"Invalid value for '{name}': {message}", code="invalid_value", param=name)


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool fields.

    ``choice`` is ``"auto"``, ``"none"``, ``"required"`` or ``"function"``
    (then ``name`` is the function). ``format`` is the served template's
    (:data:`~pagedkv_np.serve.tool_calls.TOOL_FORMATS`), set by the server
    once it knows the template.
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
    name = _required_string(fn, "name", f"{where}.function.name")
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
        out["tool_call_id"] = _required_string(msg, "tool_call_id", f"{where}.tool_call_id")
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise _wrong_type(f"{where}.name", "a string", msg["name"])
        out["name"] = msg["name"]
    return out


def _moved_refs(value: Any, prefix: str) -> Any:
    """``value`` with its local ``$ref`` s pointing to definitions renamed
    ``prefix + name`` under the root's ``$defs`` (``"#"`` to ``prefix + "root"``)."""
    if isinstance(value, list):
        return [_moved_refs(v, prefix) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _moved_refs(v, prefix) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        if ref == "#":
            out["$ref"] = f"#/$defs/{prefix}root"
        for head in ("#/$defs/", "#/definitions/"):
            if ref.startswith(head):
                out["$ref"] = f"#/$defs/{prefix}{ref[len(head):]}"
    return out


def _call_schema(tool: dict, key: str, prefix: str, defs: dict) -> dict:
    """The schema of one call of ``tool``; the definitions of its parameters
    go to ``defs`` (the root's ``$defs``: a reference resolves from the root),
    renamed with ``prefix``."""
    fn = tool["function"]
    params = {k: v for k, v in fn["parameters"].items() if k not in ("$defs", "definitions")}
    params.setdefault("type", "object")
    params = _moved_refs(params, prefix)
    for group in ("$defs", "definitions"):
        for name, schema in (fn["parameters"].get(group) or {}).items():
            defs[prefix + name] = _moved_refs(schema, prefix)
    if any(isinstance(v, dict) and v.get("$ref") == f"#/$defs/{prefix}root"
           for v in _walk(params)):
        defs[prefix + "root"] = params
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def _walk(value: Any) -> Any:
    """Every dict and list inside ``value``, itself included."""
    yield value
    children = value.values() if isinstance(value, dict) else (
        value if isinstance(value, list) else ())
    for child in children:
        yield from _walk(child)


def call_grammar(req: ToolRequest) -> tuple[str, Any]:
    """``(kind, spec)`` for ``decoder.make_constraint``: the answer a forced
    ``tool_choice`` allows (see the module's docstring)."""
    tools = [t for t in req.tools if req.choice != "function"
             or t["function"]["name"] == req.name]
    key = "parameters" if req.format == "llama3_json" else "arguments"
    defs: dict = {}
    options = [_call_schema(t, key, f"tool{i}_", defs) for i, t in enumerate(tools)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = dict(schema, **{"$defs": defs})
    if req.format == "llama3_json":
        if not req.parallel:
            return "json_schema", schema
        call = "%json " + json.dumps(dict(schema, **{"x-guidance": _SEPARATORS}))
        return "lark", f'start: call ("; " call)*\ncall: {call}'
    call = "%json " + json.dumps(dict(schema, **{"x-guidance": _SEPARATORS}))
    start = 'start: block ("\\n" block)*' if req.parallel else "start: block"
    opening, closing = json.dumps(HERMES_OPEN + "\n"), json.dumps("\n" + HERMES_CLOSE)
    return "lark", f"{start}\nblock: {opening} call {closing}\ncall: {call}"


def tool_stream(req: ToolRequest | None) -> ToolStream | None:
    """A :class:`~pagedkv_np.serve.tool_calls.ToolStream` for a streamed
    choice of a request whose calls are read (None otherwise)."""
    return ToolStream(req.format) if req is not None and req.parses else None
