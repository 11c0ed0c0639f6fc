"""A griffe extension for the API reference: the docstrings' reStructuredText
inline markup as Markdown.

The package's docstrings are numpydoc, whose inline markup is
reStructuredText: ````code````, ``:class:`~pagedkv_np.cache.PagedKVCache` ``
and a paragraph ending in ``::`` before a literal block. mkdocstrings reads
the sections (Parameters, Returns, Raises, ...) and renders the rest as
Markdown, where that markup would show as it is written. This extension turns
it into Markdown code spans before mkdocstrings parses the docstring: a role
becomes its target's name (the last component under ``~``), ````x```` becomes
``x`` in single backticks, and ``text::`` becomes ``text:`` (the indented
block after it is a Markdown code block already).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]*?)(?:\s*<([^`>]+)>)?`")
_DOUBLE = re.compile(r"``(.+?)``", flags=re.S)
_LITERAL = re.compile(r"(\S)?[ \t]*::$", flags=re.M)


def _role(m: re.Match) -> str:
    tilde, text, target = m.group(1), m.group(2).strip(), m.group(3)
    if target is not None:        # :ref:`words <target>`
        return f"`{text}`"
    return f"`{text.rsplit('.', 1)[-1] if tilde else text}`"


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText inline markup as Markdown."""
    text = _ROLE.sub(_role, text)
    text = _DOUBLE.sub(lambda m: "`" + m.group(1).replace("\n", " ") + "`", text)
    return _LITERAL.sub(lambda m: (m.group(1) or "") + ":", text)


class RstInlineMarkup(griffe.Extension):
    """Rewrite every docstring once, when griffe loads the object."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
