"""``pagedkv serve --chat-template``: a chat template given on the command
line in place of the model's own.

As llama-server's ``--chat-template-file`` and vLLM's ``--chat-template``:
the value is a file holding a Jinja template, or, when no such file exists
and the value looks like a template (it holds ``{{`` or ``{%``), the
template itself. The template is compiled at start-up, so a template that
does not read or compile stops the server there, with a message naming the
file, not at the first chat request. It serves chat requests and
``/tokenize``'s ``messages``, tools included when it reads ``tools`` (the
call format follows it, as for a model's own template:
:func:`~pagedkv_np.serve.tool_calls.detect_format`).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ChatTemplateError, ConfigError

__all__ = ["read_chat_template", "use_chat_template", "describe_template"]

# the most bytes a template file may hold (real templates are under 20 KiB)
_MAX_BYTES = 1 << 20


def describe_template(value: str | None) -> str:
    """How the start-up summary names the template in use."""
    if value is None:
        return "the model's"
    return value if os.path.isfile(value) else "inline"


def read_chat_template(value: str) -> str:
    """The template's source: the file ``value``, or ``value`` itself when it
    is a template and no such file exists.

    Raises
    ------
    ConfigError
        The file cannot be read, is too large or not UTF-8 text, or ``value``
        is neither a file nor a template.
    """
    if os.path.isfile(value):
        try:
            with open(value, "rb") as f:
                data = f.read(_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"--chat-template {value}: cannot read the file: "
                              f"{exc.strerror}") from None
        if len(data) > _MAX_BYTES:
            raise ConfigError(f"--chat-template {value}: the file holds more than "
                              f"{_MAX_BYTES} bytes")
        try:
            source = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--chat-template {value}: not UTF-8 text ({exc.reason} at "
                              f"byte {exc.start})") from None
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ConfigError(f"--chat-template {value}: no such file (an inline template holds "
                          "'{{' or '{%')")
    if not source.strip():
        raise ConfigError(f"--chat-template {describe_template(value)}: the template is empty")
    return source


def use_chat_template(decoder: Any, source: str, name: str) -> None:
    """Make ``source`` the chat template of ``decoder``'s tokenizer
    (``decoder.text``), compiled now; ``name`` (the file, or ``inline``)
    is what an error names.

    Raises
    ------
    ConfigError
        The decoder has no tokenizer, or the template does not compile.
    """
    codec = getattr(decoder, "text", None)
    if codec is None:
        raise ConfigError("--chat-template: the model has no tokenizer")
    fresh = type(codec)(codec.tokenizer, bos_token=codec.bos_token, eos_token=codec.eos_token,
                        add_bos_token=codec.add_bos_token, chat_template=source)
    try:
        fresh.template_variables()
    except ChatTemplateError as exc:
        raise ConfigError(f"--chat-template {name}: {exc}") from None
    decoder.text = fresh
