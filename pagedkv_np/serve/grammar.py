"""``response_format``: a request's JSON mode or JSON schema as an engine
constraint (and a forced tool choice's call, built in :mod:`.tools`).

:func:`parse_response_format` checks OpenAI's field (``text``,
``json_object``, or ``json_schema`` with ``{"name", "schema", "strict"}``);
:func:`constraint_for` turns it into a
:class:`~pagedkv_np.constrain.Constraint` (``decoder.make_constraint``), or
a 400 naming ``response_format`` when the ``constrain`` extra is missing or
the schema does not compile. The decoder's grammar vocabulary takes about
2 s to build for 49K tokens, so :func:`warm_grammar` builds it at server
start, in a thread of its own, when the extra is installed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import PagedKVError
from ..memory import trim_heap
from .protocol import APIError
from .tools import ToolRequest, call_grammar

__all__ = ["parse_response_format", "constraint_for", "warm_grammar"]

_log = logging.getLogger("pagedkv_np.serve")


def _invalid(message: str) -> APIError:
    return APIError(f"Invalid value for 'response_format': {message}", param="response_format",
                    code="invalid_value")


def parse_response_format(body: dict) -> tuple[str, dict | None] | None:
    """``("json_object", None)``, ``("json_schema", schema)``, or None for
    text (or no field); a 400 naming ``response_format`` for anything else."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _invalid("expected an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind != "json_schema":
        raise _invalid(f"type must be text, json_object or json_schema, got {str(kind)[:32]!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("json_schema must be an object")
    if not isinstance(spec.get("name"), str):
        raise _invalid("json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid("json_schema.strict must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _invalid("json_schema.schema must be an object")
    return ("json_schema", schema)


def constraint_for(decoder: Any, body: dict, tools: ToolRequest | None = None) -> Any:
    """The engine constraint of a request body's ``response_format``, or of
    its forced ``tool_choice`` (``tools``, :func:`~pagedkv_np.serve.tools.call_grammar`);
    None for neither.

    Raises
    ------
    APIError
        400 naming ``response_format`` (a malformed field, a refused schema,
        or one beside a forced tool choice) or ``tools`` (a ``parameters``
        schema the grammar refuses); either when the extra is missing.
    """
    fmt = parse_response_format(body)
    forced = tools is not None and tools.forced
    if fmt is None and not forced:
        return None
    if fmt is not None and forced:
        raise _invalid("a JSON format cannot be combined with a required or named tool_choice")
    name = "tools" if forced else "response_format"
    if tools is not None and forced:
        kind, schema = call_grammar(tools)
    elif fmt is not None:
        kind, schema = fmt
    try:
        return decoder.make_constraint(kind, schema)
    except ImportError:
        raise APIError(f"'{name}' needs the constrain extra, which this server lacks: "
                       "pip install 'pagedkv-np[constrain]'", param=name,
                       code="unsupported_parameter") from None
    except PagedKVError as exc:
        if forced:
            raise APIError(f"Invalid value for 'tools': the grammar of the call refuses a "
                           f"parameters schema: {exc}", param="tools",
                           code="invalid_value") from None
        raise _invalid(str(exc)) from None


def warm_grammar(decoder: Any) -> threading.Thread | None:
    """Build ``decoder.grammar_tokenizer`` in a daemon thread when the
    ``constrain`` extra is installed; returns the thread (None without the
    extra)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None

    def build() -> None:
        try:
            _ = decoder.grammar_tokenizer
        except Exception as exc:   # requests then meet the same error, as a 400
            _log.warning("the grammar vocabulary could not be built: %s", exc)
        # parsing the tokenizer's JSON left freed memory in the heap (SmolLM2:
        # 18 of the 53 MiB the vocabulary took)
        trim_heap()

    thread = threading.Thread(target=build, name="pagedkv-grammar", daemon=True)
    thread.start()
    return thread
