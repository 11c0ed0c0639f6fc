"""ONNX initializers whose bytes go to an external-data file as they are made.

A model built in memory holds every weight twice (the NumPy array and its
``TensorProto`` copy) and a third time while it is serialized; past 2 GiB
protobuf cannot serialize it at all. :class:`ExternalData` appends each
large array to ``model.onnx.data`` the moment the graph takes it and gives
back a ``TensorProto`` that only points there (location, offset, length), so
the model proto stays small and the weights are held once, by the caller.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.models.onnx_data needs onnx: pip install 'pagedkv-np[onnx]'") from exc

__all__ = ["ExternalData", "INLINE_BYTES", "save_decoder"]

#: arrays smaller than this stay inside the model file
INLINE_BYTES = 1024
# start offsets of tensors in the data file are multiples of this
_ALIGN = 64


class ExternalData:
    """An external-data file being written, and the tensors that point into it.

    Parameters
    ----------
    path : str or path
        The data file (created or truncated). The model must be saved in the
        same folder: tensors name the file by its base name.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.location = os.path.basename(self.path)
        self._file: Any = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._offset = 0

    def tensor(self, value: np.ndarray, name: str) -> onnx.TensorProto:
        """``value`` as an initializer: inline when small, else appended to the file."""
        value = np.ascontiguousarray(value)
        if value.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(value, name)
        pad = -self._offset % _ALIGN
        self._file.write(b"\0" * pad)
        self._offset += pad
        self._file.write(value.reshape(-1).view(np.uint8).data)
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
        t.dims.extend(value.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, text in (("location", self.location), ("offset", str(self._offset)),
                          ("length", str(value.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, text
        self._offset += value.nbytes
        return t

    def close(self) -> None:
        self._file.close()


def save_decoder(model: onnx.ModelProto, folder: str | os.PathLike,
                 filename: str = "model.onnx") -> None:
    """Write ``folder/filename`` with its weights in ``folder/filename + '.data'``.

    A model built with ``external_data=folder/filename + '.data'`` (see
    :func:`~pagedkv_np.models.graph.build_decoder`) has its weights
    there already and only the graph is written; otherwise tensors of
    :data:`INLINE_BYTES` or more are moved to that file now.
    """
    path = os.path.join(os.fspath(folder), filename)
    if any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
        onnx.save_model(model, path)
        return
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=filename + ".data", size_threshold=INLINE_BYTES)
