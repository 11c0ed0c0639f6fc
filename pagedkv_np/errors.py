"""The exception hierarchy of pagedkv_np.

Every error raised on purpose by the library derives from :class:`PagedKVError`
and also from the built-in exception a caller would expect (``ValueError`` for a
bad value, ``TypeError`` for a bad dtype, ``IndexError`` for an out-of-range
page id, ``MemoryError`` for an exhausted pool, ``ImportError`` for a missing
optional dependency), so that generic ``except`` clauses keep working.

An operation that raises one of these errors has changed nothing: the pool, the
prefix index and the K/V store are exactly as they were before the call. The
one exception is :class:`RequestFailed`, which reports a generation request
that the engine ended because a step of it failed.
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "ConfigError",
    "ShapeError",
    "DTypeError",
    "LayoutError",
    "PageIdError",
    "PageStateError",
    "OutOfPages",
    "SequenceError",
    "StalePlanError",
    "BackendUnavailable",
    "AllocationError",
    "RequestFailed",
    "UnsupportedModelError",
    "ChatTemplateError",
    "ModelFolderError",
    "MissingModelFile",
    "TextUnavailable",
    "ModelUnavailable",
    "ContextLengthExceeded",
    "InvalidTextError",
]


class PagedKVError(Exception):
    """Base class of every error that pagedkv_np raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A constructor or configuration argument is out of its valid range."""


class ShapeError(PagedKVError, ValueError):
    """An array has the wrong shape, strides or number of dimensions."""


class DTypeError(PagedKVError, TypeError):
    """An array has the wrong dtype, or a value is not of the expected type."""


class LayoutError(PagedKVError, ValueError):
    """An unknown store layout (NHD/HND) or output layout (BTHD/BHTD)."""


class PageIdError(PagedKVError, IndexError):
    """A page id, slot or index is outside the valid range."""


class PageStateError(PagedKVError, ValueError):
    """A page is not in the state the operation needs (e.g. a double free)."""


class OutOfPages(PagedKVError, MemoryError):
    """The pool cannot supply the pages asked for; nothing was allocated.

    Attributes
    ----------
    num_needed : int
        Pages the operation asked for.
    num_available : int
        Pages that could have been supplied (free plus evictable).
    """

    def __init__(self, num_needed: int, num_available: int, what: str = "pages"):
        self.num_needed = int(num_needed)
        self.num_available = int(num_available)
        super().__init__(
            f"out of pages: {what} needs {self.num_needed} page(s), "
            f"only {self.num_available} available (free + evictable)"
        )


class SequenceError(PagedKVError, ValueError):
    """A sequence is released, belongs to another cache, or is used past its
    reserved length."""


class StalePlanError(PagedKVError, ValueError):
    """A plan was built before the cache last changed its page mapping, or by
    another cache; build a new one with ``cache.plan``."""


class BackendUnavailable(PagedKVError, ImportError):
    """An array backend was asked for whose library (or device) is missing."""


class AllocationError(PagedKVError, MemoryError):
    """An array could not be allocated: the memory it needs is not available.

    Unlike :class:`OutOfPages` (the pool is exhausted), this is the host or
    device allocator refusing a store or a gather buffer.
    """


class RequestFailed(PagedKVError, RuntimeError):
    """A generation request was ended because a step of it failed (the model
    call, a page write or gather, sampling).

    The original error is ``__cause__``; the other requests were not affected.

    Attributes
    ----------
    request_id : int
    """

    def __init__(self, request_id: int, cause: BaseException):
        self.request_id = request_id
        super().__init__(f"request {request_id} failed: {type(cause).__name__}: {cause}")
        self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.request_id, self.__cause__))


# -- models and text

class UnsupportedModelError(PagedKVError, ValueError):
    """A model the engine cannot serve: an ONNX graph without the inputs and
    outputs of a supported decoder family, or a GGUF file of an unsupported
    architecture, weight type or vocabulary.

    The message names what is missing or unexpected.
    """


class ChatTemplateError(PagedKVError, ValueError):
    """A chat template is missing, does not compile, or failed while rendering
    (including a template's own ``raise_exception``)."""


class ModelFolderError(ConfigError):
    """A model folder lacks a file or a field that loading needs; the message
    names it."""


class MissingModelFile(ModelFolderError, FileNotFoundError):
    """A file that a model folder needs is not there."""


class TextUnavailable(ConfigError):
    """A text method was called on a decoder without a tokenizer."""


class ModelUnavailable(PagedKVError, ImportError):
    """The default model's package is not installed."""


class ContextLengthExceeded(ConfigError):
    """A request's prompt and new tokens do not fit the context of its decoder.

    Attributes
    ----------
    num_prompt_tokens, max_new_tokens, context_length : int
    """

    def __init__(self, message: str, *, num_prompt_tokens: int, max_new_tokens: int,
                 context_length: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length

    def __reduce__(self):
        return (_context_error, (str(self), self.num_prompt_tokens, self.max_new_tokens,
                                 self.context_length))


def _context_error(message: str, prompt: int, new: int, context: int) -> ContextLengthExceeded:
    return ContextLengthExceeded(message, num_prompt_tokens=prompt, max_new_tokens=new,
                                 context_length=context)


class InvalidTextError(PagedKVError, ValueError):
    """A string that is not valid Unicode text: it holds a lone surrogate
    (U+D800..U+DFFF), which Python strings and JSON's ``\\ud800`` escapes
    allow but no UTF-8 encodes, so no tokenizer can read it.

    Attributes
    ----------
    index : int
        Where the first lone surrogate is.
    """

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self):
        return (_invalid_text, (str(self), self.index))


def _invalid_text(message: str, index: int) -> InvalidTextError:
    return InvalidTextError(message, index=index)
