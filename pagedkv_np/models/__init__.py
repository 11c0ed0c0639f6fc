"""Building and finding decoder models.

- :mod:`.geometry`: a decoder's shape (layers, heads, sizes) and its weights;
- :mod:`.graph` and :mod:`.onnx_data`: the ONNX graph builder and its
  external-data writer; :mod:`.reference`: the same decoder in NumPy;
- :mod:`.testmodel`: small random-weight decoders for tests and benchmarks;
- :mod:`.folder`: model folders as export tools write them (find, read,
  validate) and the default model;
- :mod:`.gguf`: GGUF files converted into such folders.

Needs the ``onnx`` extra. Nothing here imports the cache, the engine or the
server: :mod:`pagedkv_np.onnxruntime` joins a folder to a decoder.
"""
