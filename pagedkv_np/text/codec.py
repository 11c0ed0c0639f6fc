"""Text in and out of a decoder: tokenizer, chat template, streaming decode, stop strings.

:class:`TextCodec` holds a Hugging Face ``tokenizers.Tokenizer``, its special
tokens and the chat templates of a model folder. Templates are rendered as
``transformers`` renders them: a sandboxed jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``, the functions
``raise_exception`` and ``strftime_now`` and a ``tojson`` filter that keeps
non-ASCII text as it is.

Streaming decode and stop strings live in
:mod:`pagedkv_np.text.streaming`.

Needs the ``models`` extra: ``pip install 'pagedkv-np[models]'``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any
from collections.abc import Iterable

import numpy as np

from ..errors import (ChatTemplateError, ConfigError, DTypeError, InvalidTextError,
                      MissingModelFile, ModelFolderError)

try:
    import jinja2
    import jinja2.ext
    import jinja2.meta
    import jinja2.nodes
    import jinja2.sandbox
    import tokenizers
except ImportError as exc:
    raise ImportError("pagedkv_np.text.codec needs tokenizers and jinja2: "
                      "pip install 'pagedkv-np[models]'") from exc

__all__ = ["TextCodec", "check_messages", "read_json_object"]

_LONE_SURROGATE = re.compile("[\\ud800-\\udfff]")


def read_json_object(path: str, required: bool = True) -> dict:
    """The JSON object in a model folder's file ``path``; {} when the file is
    absent and not ``required``.

    Raises
    ------
    MissingModelFile
        The file is absent and ``required``.
    ModelFolderError
        It cannot be read, or holds something other than a JSON object.
    """
    if not os.path.isfile(path):
        if required:
            raise MissingModelFile(f"Invalid model folder: no {os.path.basename(path)} in "
                                   f"{os.path.dirname(path) or '.'!r}")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"Invalid model folder: cannot read {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"Invalid model folder: {path!r} holds a "
                               f"{type(data).__name__}, not a JSON object")
    return data


def _token_content(entry: Any, field: str) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ModelFolderError(f"Invalid tokenizer_config.json: {field} is {entry!r}; expected a "
                           "string or an object with a string 'content'")


def _raise_from_template(message: Any = "") -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for
    training masks; rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> Any:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    return env


def check_messages(messages: Any) -> list[dict]:
    """Check a conversation: a non-empty list of ``{"role": str, "content": str}``.

    Other keys of a message are passed to the template as they are.

    Raises
    ------
    DTypeError
        ``messages`` is not a list, a message is not a dict, or a role or
        content is not a string.
    ConfigError
        The list is empty, or a message lacks ``role`` or ``content``.
    """
    if not isinstance(messages, (list, tuple)):
        raise DTypeError(f"Invalid messages: expected a list of dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ConfigError("Invalid messages: the conversation is empty")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DTypeError(f"Invalid messages[{i}]: expected a dict with 'role' and "
                             f"'content', got {type(msg).__name__}")
        for key in ("role", "content"):
            if key not in msg:
                raise ConfigError(f"Invalid messages[{i}]: no {key!r} key")
            if not isinstance(msg[key], str):
                raise DTypeError(f"Invalid messages[{i}][{key!r}]: expected a string, "
                                 f"got {type(msg[key]).__name__}")
    return list(messages)


class TextCodec:
    """A tokenizer, its special tokens and its chat templates.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
    bos_token, eos_token : str, optional
        Special tokens as text (given to chat templates).
    add_bos_token : bool
        Whether :meth:`encode` starts a plain text with ``bos_token``.
    chat_template : str, list or dict, optional
        One template, or named ones (a list of ``{"name", "template"}`` as in
        tokenizer_config.json, or a dict name -> template); ``"default"`` is
        used unless :meth:`apply_chat_template` names another.

    Attributes
    ----------
    bos_token_id, eos_token_id : int or None
        The ids of ``bos_token`` and ``eos_token`` in the vocabulary.
    chat_templates : dict of str to str
    """

    def __init__(self, tokenizer: Any, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False,
                 chat_template: Any = None) -> None:
        if not isinstance(tokenizer, tokenizers.Tokenizer):
            raise DTypeError(f"Invalid tokenizer: expected a tokenizers.Tokenizer, "
                             f"got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        self.add_bos_token = bool(add_bos_token)
        self.chat_templates = self._parse_templates(chat_template)
        self._env = _environment()
        self._compiled: dict[str, Any] = {}
        self._variables: dict[str, frozenset[str]] = {}

    @staticmethod
    def _parse_templates(template: Any) -> dict[str, str]:
        if template is None:
            return {}
        if isinstance(template, str):
            return {"default": template}
        if isinstance(template, dict):
            items = list(template.items())
        elif isinstance(template, (list, tuple)):
            try:
                items = [(t["name"], t["template"]) for t in template]
            except (TypeError, KeyError):
                raise ChatTemplateError("Invalid chat_template: a list of templates must hold "
                                        "objects with 'name' and 'template'") from None
        else:
            raise ChatTemplateError(f"Invalid chat_template: expected a string or named "
                                    f"templates, got {type(template).__name__}")
        if not all(isinstance(n, str) and isinstance(t, str) for n, t in items):
            raise ChatTemplateError("Invalid chat_template: names and templates must be strings")
        return dict(items)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> TextCodec:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a model folder.

        A ``chat_template.jinja`` file, as newer exports write it, is used when
        tokenizer_config.json has no ``chat_template``; special tokens missing
        from tokenizer_config.json are looked up in ``special_tokens_map.json``.

        Raises
        ------
        MissingModelFile
            ``tokenizer.json`` or ``tokenizer_config.json`` is absent.
        ModelFolderError
            A file cannot be read or holds entries of the wrong type.
        """
        folder = os.fspath(path)
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise MissingModelFile(f"Invalid model folder: no tokenizer.json in {folder!r}")
        config = read_json_object(os.path.join(folder, "tokenizer_config.json"))
        special = read_json_object(os.path.join(folder, "special_tokens_map.json"), required=False)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as exc:   # the Rust side raises plain Exception
            raise ModelFolderError(f"Invalid model folder: cannot load {tok_path!r}: "
                                   f"{exc}") from None
        tokens = {}
        for name in ("bos_token", "eos_token"):
            entry = config.get(name, special.get(name))
            tokens[name] = _token_content(entry, name)
        template = config.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        return cls(tokenizer, bos_token=tokens["bos_token"], eos_token=tokens["eos_token"],
                   add_bos_token=bool(config.get("add_bos_token", False)),
                   chat_template=template)

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of ``text``, shape [n], int64.

        With ``add_special_tokens`` the tokenizer's post-processor runs and,
        when ``add_bos_token`` is set, the ids start with ``bos_token_id``.

        Raises
        ------
        DTypeError
            ``text`` is not a string.
        InvalidTextError
            ``text`` holds a lone surrogate (no UTF-8 encodes it).
        """
        if not isinstance(text, str):
            raise DTypeError(f"Invalid text: expected a string, got {type(text).__name__}")
        found = None if text.isascii() else _LONE_SURROGATE.search(text)
        if found is not None:
            raise InvalidTextError(f"Invalid text: a lone surrogate (U+{ord(found.group()):04X}) "
                                   f"at index {found.start()} is not valid Unicode text",
                                   index=found.start())
        # encode_batch lets go of the GIL while it works (encode holds it: a
        # long text would stop every other thread, a server's event loop too)
        ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens left out unless asked for)."""
        return self.tokenizer.decode([int(i) for i in ids],
                                     skip_special_tokens=skip_special_tokens)

    def _template_key(self, name: str | None) -> str:
        if not self.chat_templates:
            raise ChatTemplateError("the tokenizer has no chat template (tokenizer_config.json "
                                    "has no chat_template)")
        key = name if name is not None else (
            "default" if "default" in self.chat_templates else next(iter(self.chat_templates)))
        if key not in self.chat_templates:
            raise ChatTemplateError(f"Invalid template_name: no template {key!r}; the "
                                    f"tokenizer has {sorted(self.chat_templates)}")
        return key

    def template_variables(self, template_name: str | None = None) -> frozenset[str]:
        """The variables a chat template reads from its context (``messages``,
        ``tools``, ...), as jinja2 finds them in its source.

        Raises
        ------
        ChatTemplateError
            No template, or it does not compile.
        """
        key = self._template_key(template_name)
        if key not in self._variables:
            self._template(key)
            ast = self._env.parse(self.chat_templates[key])
            self._variables[key] = frozenset(jinja2.meta.find_undeclared_variables(ast))
        return self._variables[key]

    def template_source(self, template_name: str | None = None) -> str:
        """The text of a chat template (the one :meth:`apply_chat_template`
        would use).

        Raises
        ------
        ChatTemplateError
            No template of that name.
        """
        return self.chat_templates[self._template_key(template_name)]

    def _template(self, name: str | None) -> Any:
        key = self._template_key(name)
        if key not in self._compiled:
            try:
                self._compiled[key] = self._env.from_string(self.chat_templates[key])
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the chat template {key!r} does not compile: "
                                        f"{exc}") from None
        return self._compiled[key]

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, *,
                            template_name: str | None = None, **variables: Any) -> str:
        """Render a conversation as the model's prompt text.

        Parameters
        ----------
        messages : list of dict
            ``{"role": str, "content": str}`` each (see :func:`check_messages`).
        add_generation_prompt : bool
            End with the opening of an assistant turn.
        template_name : str, optional
            One of ``chat_templates`` (default ``"default"``).
        **variables
            More template variables (e.g. ``tools``).

        Raises
        ------
        DTypeError, ConfigError
            Malformed messages.
        ChatTemplateError
            No template, or the template failed or raised.
        """
        messages = check_messages(messages)
        template = self._template(template_name)
        # tools and documents are None unless given, as templates test them
        # with ``is not none``
        context = dict({"tools": None, "documents": None}, **variables, messages=messages,
                       add_generation_prompt=bool(add_generation_prompt),
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:   # jinja2's errors and whatever the template's code hit
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: "
                                    f"{exc}") from None

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True,
                    **variables: Any) -> np.ndarray:
        """Token ids of the rendered conversation, shape [n], int64.

        The template writes its own special tokens, so the post-processor and
        ``add_bos_token`` are not applied again.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)
