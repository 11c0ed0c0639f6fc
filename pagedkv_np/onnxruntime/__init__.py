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

from .engine import OrtDecoder, RequestNotFound
from .model_io import ModelIO, UnsupportedModelError
from .requests import RequestStatus, StepEvents
from .sampling import SamplingParams

from .textgen import TextIterator, TextUnavailable

__all__ = ["OrtDecoder", "RequestNotFound", "RequestStatus", "StepEvents", "ModelIO",
           "UnsupportedModelError", "SamplingParams", "TextIterator", "TextUnavailable"]

# Text names need the models extra (tokenizers, jinja2), so they are imported
# on first use: the engine itself runs without them.
_TEXT_EXPORTS = {"TextCodec": "text", "ChatTemplateError": "text",
                 "ModelFolderError": "text", "MissingModelFile": "text",
                 "Detokenizer": "streaming", "StopMatcher": "streaming",
                 "TextStream": "streaming", "ModelFolder": "pretrained",
                 "ModelUnavailable": "pretrained", "from_pretrained": "pretrained"}


def __getattr__(name: str):
    module = _TEXT_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
