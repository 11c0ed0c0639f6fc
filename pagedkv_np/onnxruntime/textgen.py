"""Text in, text out on top of :class:`~pagedkv_np.onnxruntime.OrtDecoder`.

:class:`TextGenerationMixin` gives the decoder its text methods; they use the
decoder's ``text`` attribute (a tokenizer and chat template), set by
``OrtDecoder.from_pretrained``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TextGenerationMixin"]


class TextGenerationMixin:
    """Text methods of :class:`~pagedkv_np.onnxruntime.OrtDecoder`."""

    #: the tokenizer and chat template; None for a decoder built from a bare graph
    text: Any = None
