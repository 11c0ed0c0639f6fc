"""An OpenAI-compatible HTTP server over :class:`~pagedkv_np.onnxruntime.OrtDecoder`.

``pagedkv serve [MODEL]`` (see :mod:`pagedkv_np.serve.command`) serves
``/v1/chat/completions``, ``/v1/completions`` (streamed as server-sent
events, or whole), ``/v1/models``, ``/health`` and ``/metrics``. The engine
runs in one thread of its own (:mod:`~pagedkv_np.serve.engine_loop`); the
wire format is in :mod:`~pagedkv_np.serve.protocol`, the metrics in
:mod:`~pagedkv_np.serve.metrics`, the ASGI app in :mod:`~pagedkv_np.serve.app`.

Needs the ``serve`` extra: ``pip install 'pagedkv-np[serve]'``.
"""

from .app import create_app, run_server
from .engine_loop import EngineLoop, EngineStopped, Job, QueueFull, Update
from .metrics import ServerMetrics
from .protocol import APIError, GenerationRequest

__all__ = ["create_app", "run_server", "EngineLoop", "EngineStopped", "Job", "QueueFull",
           "Update", "ServerMetrics", "APIError", "GenerationRequest"]
