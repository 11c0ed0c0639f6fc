"""The GGUF header read on its own: it agrees with gguf.GGUFReader (the independent
reference) on metadata, tensor table and tensor data; headers that lie about
lengths, counts or extents, and metadata that its tensors contradict, are
typed errors raised before anything is allocated for them, leaving nothing in
the model cache; the RoPE tables follow the served context, not the file's."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import onnx
import pytest

from pagedkv_np import ConfigError
from pagedkv_np.models.gguf.header import EAGER_ELEMENTS, GGUFFormatError, read_header
from pagedkv_np.models.gguf.importer import DEFAULT_MAX_CONTEXT, import_gguf
from pagedkv_np.models.graph import reference_logits
from pagedkv_np.onnxruntime import UnsupportedModelError
from pagedkv_np.onnxruntime.model_io import graph_facts

from test_gguf_import import _logits, _session, write_gguf

Q = gguf.GGMLQuantizationType


def test_header_agrees_with_gguf_reader(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf", "qwen2", Q.Q4_1,
                      tensor_types={"blk.0.ffn_down.weight": Q.Q8_0,
                                    "blk.1.attn_q.weight": Q.F16})
    ref = gguf.GGUFReader(spec.path)
    header = read_header(spec.path)
    want = {name: field.contents() for name, field in ref.fields.items()
            if not name.startswith("GGUF.")}
    assert dict(header.metadata) == want
    assert header.metadata.length("tokenizer.ggml.tokens") > EAGER_ELEMENTS   # read lazily
    assert list(header.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = header.tensors[t.name]
        assert (mine.tensor_type, mine.shape, mine.n_bytes) == (
            t.tensor_type, tuple(int(n) for n in t.shape), int(t.n_bytes))
        np.testing.assert_array_equal(mine.data, np.array(t.data), err_msg=t.name)


def _header(kv: list[tuple[str, int, bytes]], tensors=(), version=3) -> bytes:
    """A GGUF header from raw pieces: pairs of (key, value type, value bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, vtype, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + value
    for name, dims, qtype, offset in tensors:
        out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", qtype, offset)
    return out


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


LIES = {
    "a string of 2**62 bytes": (_header([("general.name", 8, struct.pack("<Q", 2**62))]),
                                GGUFFormatError, "general.name.*past the end"),
    "an array of 2**60 strings": (
        _header([("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**60))]),
        GGUFFormatError, "tokenizer.ggml.tokens.*past the end"),
    "2**40 metadata pairs": (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40), GGUFFormatError,
                             "counts.*past the end"),
    "a tensor of 2**40 rows": (
        _header([("general.architecture", 8, _string("llama"))],
                [("token_embd.weight", (64, 2**40), 0, 0)]) + bytes(64),
        GGUFFormatError, "token_embd.weight.*does not fit"),
    "five dimensions": (_header([], [("t", (1, 1, 1, 1, 1), 0, 0)]), GGUFFormatError,
                        "5 dimensions"),
    "a key twice": (_header([("a", 4, struct.pack("<I", 1)), ("a", 4, struct.pack("<I", 2))]),
                    GGUFFormatError, "a appears twice"),
    "an unknown value type": (_header([("a", 77, b"")]), GGUFFormatError, "value type 77"),
    "rows not whole blocks": (_header([], [("t", (33, 2), int(Q.Q4_0), 0)]) + bytes(64),
                              GGUFFormatError, "not whole Q4_0 blocks"),
    "version 4": (_header([], version=4), UnsupportedModelError, "version 4"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), UnsupportedModelError,
                   "big-endian"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_lying_headers_are_refused_before_allocating(tmp_path, case):
    data, error, match = LIES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(data + bytes(max(0, 32 - len(data))))
    with pytest.raises(error, match=match):
        read_header(path)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(error, match=match):
        import_gguf(path, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_an_unknown_tensor_type_is_named(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    raw = bytearray((tmp_path / "m.gguf").read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8          # past n_dims and two dims
    raw[at:at + 4] = struct.pack("<I", 99)
    (tmp_path / "m.gguf").write_bytes(bytes(raw))
    with pytest.raises(UnsupportedModelError, match="blk.1.ffn_up.weight.*unknown type 99"):
        import_gguf(tmp_path / "m.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("lie, match", [
    (dict(block_count=10**7), "block_count is 10,000,000 but the file has tensors for 2"),
    (dict(block_count=1), "block_count is 1 but the file has tensors for 2"),
    (dict(extra_tokens=5), "tokens but an embedding of"),
])
def test_metadata_its_tensors_contradict_is_refused(tmp_path, lie, match):
    spec = write_gguf(tmp_path / "m.gguf", **lie)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(GGUFFormatError, match=match):
        import_gguf(spec.path, cache_dir=cache)
    assert list(cache.iterdir()) == []


def _rope_rows(folder) -> int:
    """The positions the graph's tables encode, as the engine reads them."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return graph_facts(model).max_positions


@pytest.mark.parametrize("context_length", [2**31 - 1, 2**24])
def test_rope_tables_follow_the_served_context(tmp_path, context_length):
    spec = write_gguf(tmp_path / "m.gguf", context_length=context_length)
    cache = tmp_path / "cache"
    folder = import_gguf(spec.path, cache_dir=cache)
    assert _rope_rows(folder) == DEFAULT_MAX_CONTEXT
    assert (folder / "model.onnx.data").stat().st_size < 2 << 20
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == DEFAULT_MAX_CONTEXT
    assert config["pagedkv_np"]["file_context_length"] == context_length
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == DEFAULT_MAX_CONTEXT
    small = import_gguf(spec.path, cache_dir=cache, max_context=64)
    assert small != folder and _rope_rows(small) == 64
    assert json.loads((small / "config.json").read_text())["max_position_embeddings"] == 64
    tokens = np.random.default_rng(1).integers(0, spec.geometry.vocab_size, 30).tolist()
    want = reference_logits(spec.geometry, spec.reference, tokens)
    got = _logits(_session(small), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_a_file_shorter_than_max_context_keeps_its_own(tmp_path):
    spec = write_gguf(tmp_path / "m.gguf")                   # context_length 128
    folder = import_gguf(spec.path, cache_dir=tmp_path / "cache")
    assert _rope_rows(folder) == 128
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 128
    assert config["pagedkv_np"]["max_context"] == 128


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8192"])
def test_bad_max_context(tmp_path, bad):
    spec = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ConfigError, match="max_context"):
        import_gguf(spec.path, cache_dir=cache, max_context=bad)
    assert list(cache.iterdir()) == []


def _bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("lie", [dict(arch="falcon"), dict(block_count=10**7),
                                 dict(tensor_types={"blk.1.ffn_up.weight": Q.IQ4_NL})])
def test_a_refused_file_is_neither_hashed_nor_read(tmp_path, lie):
    """Refusals come from the header: the file's 2.4 MB of tensors are not read
    (not even to hash it) and its vocabulary is not decoded."""
    spec = write_gguf(tmp_path / "m.gguf", sizes=dict(intermediate_size=2048), **lie)
    before = _bytes_read()
    with pytest.raises(UnsupportedModelError):
        import_gguf(spec.path, cache_dir=tmp_path / "cache")
    assert _bytes_read() - before < 256 << 10
