"""An OpenAI-compatible HTTP server over :class:`~pagedkv_np.onnxruntime.OrtDecoder`.

``pagedkv serve [MODEL]`` (see :mod:`pagedkv_np.serve.command`) serves
``/v1/chat/completions``, ``/v1/completions`` (streamed as server-sent
events, or whole), ``/v1/models``, ``/health`` and ``/metrics``. The engine
runs in one thread of its own (:mod:`~pagedkv_np.serve.engine_loop`); the
wire format is in :mod:`~pagedkv_np.serve.protocol`, the metrics in
:mod:`~pagedkv_np.serve.metrics`, the ASGI app in :mod:`~pagedkv_np.serve.app`.

Needs the ``serve`` extra: ``pip install 'pagedkv-np[serve]'``.
"""

__all__ = ["create_app", "run_server", "EngineLoop", "EngineStopped", "Job", "QueueFull",
           "Update", "ServerMetrics", "APIError", "GenerationRequest"]

# Names load on first use, so that ``pagedkv serve --help`` (which imports
# only :mod:`.command`) answers without importing the ASGI stack or NumPy.
_EXPORTS = {"create_app": "app", "run_server": "app", "EngineLoop": "engine_loop",
            "EngineStopped": "engine_loop", "Job": "engine_loop", "QueueFull": "engine_loop",
            "Update": "engine_loop", "ServerMetrics": "metrics", "APIError": "protocol",
            "GenerationRequest": "protocol"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
