"""GGUF files (llama.cpp's format) read and converted into ONNX model folders.

- :mod:`.header`: the metadata and tensor table, read and bounds-checked
  without the tensor data;
- :mod:`.reader`: the geometry and tensors of a GGUF file;
- :mod:`.blocks`: ggml's quantized blocks as ``MatMulNBits`` inputs;
- :mod:`.tokenizer`: the GGUF vocabulary as a ``tokenizers`` object;
- :mod:`.importer`: the conversion (``import_gguf``), memoised by content.

Needs the ``models`` extra (``gguf``).
"""
