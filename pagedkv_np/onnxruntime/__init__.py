"""Generation with ONNX Runtime decoders over the paged K/V cache.

``OrtDecoder`` runs any ONNX decoder with the standard I/O (optimum/torch
exports, or onnxruntime-genai GroupQueryAttention models) with continuous
batching and prefix reuse::

    from pagedkv_np.onnxruntime import OrtDecoder
    dec = OrtDecoder("model.onnx", num_pages=512, page_size=16, max_batch_size=8)
    outs = dec.generate(prompts, max_new_tokens=64)

Needs the ``onnx`` extra: ``pip install 'pagedkv-np[onnx]'``.
"""

try:
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime and onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

from ..errors import (ChatTemplateError, MissingModelFile, ModelFolderError, ModelUnavailable,
                      TextUnavailable, UnsupportedModelError)
from .engine import OrtDecoder, RequestNotFound
from .model_io import ModelIO
from .requests import RequestStatus, StepEvents
from .sampling import SamplingParams
from .textgen import TextIterator

__all__ = ["OrtDecoder", "RequestNotFound", "RequestStatus", "StepEvents", "ModelIO",
           "UnsupportedModelError", "SamplingParams", "TextIterator", "TextUnavailable",
           "ChatTemplateError", "ModelFolderError", "MissingModelFile", "ModelUnavailable",
           "from_pretrained"]

#: ``OrtDecoder.from_pretrained``: a decoder with its tokenizer, from a model
#: folder or a GGUF file.
from_pretrained = OrtDecoder.from_pretrained

# Text names need the models extra (tokenizers, jinja2), so they are imported
# on first use: the engine itself runs without them.
_LAZY_EXPORTS = {"TextCodec": "pagedkv_np.text.codec",
                 "Detokenizer": "pagedkv_np.text.streaming",
                 "StopMatcher": "pagedkv_np.text.streaming",
                 "TextStream": "pagedkv_np.text.streaming",
                 "ModelFolder": "pagedkv_np.models.folder"}


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
