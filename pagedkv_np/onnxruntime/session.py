"""Loading a decoder: the model's bytes or path, its graph, its onnxruntime session.

Every failure is a typed error naming what was wrong: a missing file, bytes
that hold no ONNX graph, options or providers of the wrong kind, a graph
onnxruntime refuses.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, DTypeError
from ..errors import UnsupportedModelError

try:
    import onnx
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover - __init__ reports this first
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime and onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

__all__ = ["load_model", "make_session"]


def load_model(model: Any) -> tuple[Any, Any]:
    """(bytes or path for onnxruntime, ModelProto without weights for inspection).

    Raises
    ------
    DTypeError
        ``model`` is not a path, bytes or ModelProto.
    ConfigError
        No such file.
    UnsupportedModelError
        The bytes or file hold no ONNX graph.
    """
    if isinstance(model, onnx.ModelProto):
        source: bytes | str = model.SerializeToString()
        proto, what = model, "the model"
    else:
        if isinstance(model, (bytes, bytearray, memoryview)):
            source, what = bytes(model), "the model bytes"
            parse = lambda: onnx.load_from_string(source)  # noqa: E731
        elif isinstance(model, str) or hasattr(model, "__fspath__"):
            source = str(model.__fspath__() if hasattr(model, "__fspath__") else model)
            what = repr(source)
            parse = lambda: onnx.load(source, load_external_data=False)  # noqa: E731
        else:
            raise DTypeError(f"Invalid model: expected a path, bytes or onnx.ModelProto, "
                             f"got {type(model).__name__}")
        try:
            proto = parse()
        except FileNotFoundError:
            raise ConfigError(f"Invalid model: no file {source!r}") from None
        except IsADirectoryError:
            raise ConfigError(f"Invalid model: {source!r} is a directory") from None
        except Exception as exc:   # protobuf's DecodeError and kin
            raise UnsupportedModelError(f"Invalid model: {what} is not an ONNX model: "
                                        f"{exc}") from exc
    # an empty message parses: it is a ModelProto with no graph
    if not proto.HasField("graph") or not proto.graph.node:
        raise UnsupportedModelError(f"Invalid model: {what} holds no ONNX graph")
    return source, proto


def make_session(source: Any, session_options: Any, providers: Any) -> Any:
    """An ``onnxruntime.InferenceSession`` of ``source``, its arguments checked.

    Raises
    ------
    DTypeError
        ``session_options`` is not an ``onnxruntime.SessionOptions``, or
        ``providers`` not a list of names (or ``(name, options)`` pairs).
    ConfigError
        A provider that this onnxruntime does not have.
    UnsupportedModelError
        onnxruntime refuses the graph (the message is its own).
    """
    if session_options is not None and not isinstance(session_options, ort.SessionOptions):
        raise DTypeError(f"Invalid session_options: expected an onnxruntime.SessionOptions, "
                         f"got {type(session_options).__name__}")
    if providers is None:
        providers = ["CPUExecutionProvider"]
    if isinstance(providers, (str, bytes)) or not isinstance(providers, (list, tuple)):
        raise DTypeError(f"Invalid providers: expected a list of provider names, "
                         f"got {type(providers).__name__}")
    available = ort.get_available_providers()
    for entry in providers:
        name = entry[0] if isinstance(entry, tuple) and len(entry) == 2 else entry
        if not isinstance(name, str) or (isinstance(entry, tuple) and
                                         not isinstance(entry[1], dict)):
            raise DTypeError(f"Invalid providers: expected names or (name, options dict) "
                             f"pairs, got {entry!r}")
        if name not in available:
            raise ConfigError(f"Invalid providers: {name!r} is not available "
                              f"(available: {available})")
    try:
        return ort.InferenceSession(source, sess_options=session_options,
                                    providers=list(providers))
    except Exception as exc:   # onnxruntime's InvalidGraph, InvalidArgument, Fail, ...
        raise UnsupportedModelError(f"Invalid model: onnxruntime cannot load it: "
                                    f"{exc}") from exc
