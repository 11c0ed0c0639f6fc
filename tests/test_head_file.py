"""An LM head kept in blocks beside the graph (pagedkv_np.models.head_file) and
run by the engine (pagedkv_np.onnxruntime.head): the file round-trips every
block type exactly, a damaged or foreign file is refused with a typed error
and nothing is served from it, and the engine's logits equal an independent
NumPy forward pass and stay the same for a row alone or in a batch."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import onnx
import pytest

from pagedkv_np.errors import ModelFolderError, ShapeError, UnsupportedModelError
from pagedkv_np.models.gguf.blocks import BLOCK_KINDS, BlockQuantized
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.models.graph import reference_logits
from pagedkv_np.models.head_file import HEAD_FILE, read_head, save_head
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.onnxruntime.head import BlockHead
from test_gguf_import import random_blocks, write_gguf

Q = gguf.GGMLQuantizationType
KINDS = sorted(BLOCK_KINDS)


def _blocks(kind: str, rows: int = 24, cols: int = 256, seed: int = 0) -> BlockQuantized:
    rng = np.random.default_rng(seed)
    return BlockQuantized(kind, random_blocks(rng, (rows, cols), Q[kind.upper()], 0.1)
                          .reshape(rows, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_the_file_round_trips_every_block_type(tmp_path, kind):
    w = _blocks(kind)
    parts = w.matmul_nbits()
    save_head(tmp_path / HEAD_FILE, parts, softcap=30.0)
    got, softcap = read_head(tmp_path / HEAD_FILE)
    assert softcap == 30.0 and (got.bits, got.block_size) == (parts.bits, parts.block_size)
    for name in ("B", "scales", "zero_points", "offsets"):
        a, b = getattr(parts, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
    # the head's logits are x @ the blocks' values (float64 reference, float32 bound)
    x = np.random.default_rng(1).standard_normal((3, w.shape[0])).astype(np.float32)
    values = w.dequantize_rows().astype(np.float64)          # [out, in]
    want = x.astype(np.float64) @ values.T
    head = BlockHead(tmp_path / HEAD_FILE)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(values).T) + 1e-30
    raw = np.tanh(want / 30.0) * 30.0
    assert np.all(np.abs(head(x) - raw) <= bound + 1e-6 * np.abs(raw))


def test_a_row_gets_the_same_logits_alone_and_in_a_batch(tmp_path):
    save_head(tmp_path / HEAD_FILE, _blocks("q8_0", rows=200).matmul_nbits())
    head = BlockHead(tmp_path / HEAD_FILE, threads=2)
    x = np.random.default_rng(2).standard_normal((7, 256)).astype(np.float32)
    batch = head(x)
    for m in range(7):
        np.testing.assert_array_equal(head(x[m:m + 1])[0], batch[m])
    assert head(x[None]).shape == (1, 7, 200)
    with pytest.raises(ShapeError, match="hidden states"):
        head(x[:, :100])


@pytest.mark.parametrize("kind", ["q8_0", "q6_k"])
def test_an_int8_head_multiplies_as_its_kernel_alone_and_in_a_batch(tmp_path, kind):
    """Q8_0 and Q6_K (8 bits in blocks of 16) pack in tiles of 16 outputs."""
    from pagedkv_np.backends.block_gemv import BlockWeight
    from pagedkv_np.backends.block_q8 import q8_matmul
    from pagedkv_np.backends.block_q8_tiles import packs, q8_tiled_matmul

    parts = _blocks(kind, rows=200).matmul_nbits()
    save_head(tmp_path / HEAD_FILE, parts)
    head = BlockHead(tmp_path / HEAD_FILE, threads=2, int8=True)
    x = np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32)
    weight = BlockWeight.from_nbits(parts)
    assert packs(weight)
    want = q8_tiled_matmul(x, weight)
    assert np.abs(want - q8_matmul(x, weight)).max() < 1e-4 * np.abs(want).max()
    np.testing.assert_array_equal(head(x), want)
    np.testing.assert_array_equal(head(x[3:4])[0], want[3])


def test_a_head_that_follows_a_thread_count_asks_it_each_call_same_logits(tmp_path):
    import numba

    save_head(tmp_path / HEAD_FILE, _blocks("q8_0", rows=200).matmul_nbits())
    head = BlockHead(tmp_path / HEAD_FILE, threads=2)
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    want = head(x)
    asked: list[int] = []

    def count() -> int:                        # 1, 2, 1, 2, ...
        asked.append(1 + len(asked) % 2)
        return asked[-1]

    head.follow(count)
    before = numba.get_num_threads()
    for calls in range(1, 5):
        np.testing.assert_array_equal(head(x), want)     # same bits on 1 or 2 threads
        assert len(asked) == calls                       # asked once a call
        assert numba.get_num_threads() == before          # and the caller's count restored


def _damage(path, how: str) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return
    if how == "not a zip":
        path.write_bytes(b"\x93NUMPY not what it should be")
        return
    if how == "format":
        arrays["format"] = np.array(99)
    elif how == "scales":
        arrays["scales"] = arrays["scales"][:-1]
    elif how == "dtype":
        arrays["codes"] = arrays["codes"].astype(np.int16)
    elif how == "missing":
        del arrays["codes"]
    elif how == "offsets":
        arrays["offsets"] = np.zeros((1, 1), np.float32)
    elif how == "softcap":
        arrays["softcap"] = np.array(np.nan)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


DAMAGE = ["truncated", "not a zip", "format", "scales", "dtype", "missing", "offsets",
          "softcap"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_file_is_refused_by_name(tmp_path, how):
    save_head(tmp_path / HEAD_FILE, _blocks("q4_k" if how == "offsets" else "q8_0")
              .matmul_nbits())
    _damage(tmp_path / HEAD_FILE, how)
    with pytest.raises(ModelFolderError, match="LM head file"):
        read_head(tmp_path / HEAD_FILE)


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory):
    """A tiny tied Q8_0 llama imported at the default level: an engine head."""
    tmp = tmp_path_factory.mktemp("q8")
    spec = write_gguf(tmp / "m.gguf", "llama", Q.Q8_0, tied=True, seed=3)
    return spec, import_gguf(spec.path, cache_dir=tmp / "cache")


def test_the_engine_decodes_as_the_numpy_forward_alone_and_batched(q8_folder):
    spec, folder = q8_folder
    assert (folder / HEAD_FILE).is_file()
    prompts = [[5, 60, 70, 80, 90], [7, 8, 9], [11, 12, 13, 14]]
    dec = OrtDecoder.from_pretrained(str(folder), num_pages=64, page_size=4,
                                     max_batch_size=3)
    assert dec.io.vocab_size == spec.geometry.vocab_size
    batched = dec.generate(prompts, max_new_tokens=8, eos_token_id=[])
    alone = [dec.generate([p], max_new_tokens=8, eos_token_id=[])[0] for p in prompts]
    assert batched == alone
    for prompt, out in zip(prompts, batched):
        seq = list(prompt)
        for _ in range(8):
            seq.append(int(reference_logits(spec.geometry, spec.reference, seq)[-1].argmax()))
        assert out == seq[len(prompt):]


def test_a_damaged_head_file_stops_the_engine_before_it_serves(q8_folder, tmp_path):
    _, folder = q8_folder
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    _damage(copy / HEAD_FILE, "truncated")
    with pytest.raises(ModelFolderError, match="LM head file"):
        OrtDecoder.from_pretrained(str(copy), num_pages=16, page_size=4)
    (copy / HEAD_FILE).unlink()
    with pytest.raises(ModelFolderError, match="LM head file"):
        OrtDecoder.from_pretrained(str(copy), num_pages=16, page_size=4)


def test_a_graph_without_its_folder_or_naming_a_file_outside_it_is_refused(q8_folder,
                                                                          tmp_path):
    _, folder = q8_folder
    model = onnx.load(str(folder / "model.onnx"), load_external_data=True)
    with pytest.raises(UnsupportedModelError, match="from its path"):
        OrtDecoder(model.SerializeToString(), num_pages=16, page_size=4)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    proto = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    for prop in proto.metadata_props:
        if prop.key == "pagedkv_np.lm_head":
            prop.value = "../elsewhere.npz"
    onnx.save(proto, str(copy / "model.onnx"))
    with pytest.raises(UnsupportedModelError, match="outside"):
        OrtDecoder(str(copy / "model.onnx"), num_pages=16, page_size=4)
