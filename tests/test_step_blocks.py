"""The step file: a GGUF import at accuracy_level 0 keeps the layers' 5-8-bit
weights in their blocks beside the graph (which holds them in float32), and
the engine's own decode step reads those blocks. Checked: the file's values
are the graph's float32 weights exactly; the step's float32-activation
tokens are the NumPy forward pass's; a truncated, foreign or padded file is
refused with ModelFolderError, and the graph alone still serves."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from pagedkv_np.errors import ModelFolderError
from pagedkv_np.models.block_file import (STEP_FILE, read_step_blocks, save_step_blocks)
from pagedkv_np.models.gguf.blocks import BlockQuantized, NBits, concat_nbits
from pagedkv_np.models.gguf.importer import import_gguf
from pagedkv_np.models.graph import reference_logits
from pagedkv_np.onnxruntime import OrtDecoder

from test_gguf_import import _initializers, random_blocks, write_gguf
from test_gguf_types import K_SIZES

Q = gguf.GGMLQuantizationType
KW = {"num_pages": 64, "page_size": 4, "threads": 1}


def _values(parts: NBits) -> np.ndarray:
    """float32 [K, N]: what 8-bit parts encode, computed in NumPy."""
    n, nb, bs = parts.B.shape
    zero = (np.full((n, nb), 128, np.uint8) if parts.zero_points is None
            else parts.zero_points.reshape(n, nb))
    w = (parts.B.astype(np.float32) - zero[..., None].astype(np.float32)) \
        * parts.scales.reshape(n, nb)[..., None]
    if parts.offsets is not None:
        w += parts.offsets.T[..., None]
    return w.reshape(n, nb * bs).T


def _mix(tmp_path, seed=7, sizes=K_SIZES):
    """Q4_K_M's mix: Q4_K, Q6_K V and down, Q5_0 K; Q8_0 V in layer 1."""
    types = {"token_embd.weight": Q.Q8_0}
    for i in range(2):
        types.update({f"blk.{i}.attn_v.weight": Q.Q6_K if i == 0 else Q.Q8_0,
                      f"blk.{i}.ffn_down.weight": Q.Q6_K,
                      f"blk.{i}.attn_k.weight": Q.Q5_0, f"blk.{i}.attn_q.weight": Q.Q5_0})
    return write_gguf(tmp_path / f"m{seed}.gguf", "llama", Q.Q4_K, tied=True, seed=seed,
                      sizes=sizes, tensor_types=types)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step")
    spec = _mix(tmp)
    return spec, import_gguf(spec.path, cache_dir=tmp / "cache")


def test_the_step_file_holds_the_graphs_float_weights_exactly(mixed):
    spec, folder = mixed
    step = read_step_blocks(folder / STEP_FILE)
    inits = _initializers(folder)
    # layer 1's Q (Q5_0), K (Q5_0) and V (Q8_0) share one 8-bit weight; layer 0's
    # V is Q6_K (blocks of 16), so its Q/K/V stay apart
    assert sorted(step) == ["l0.w_down", "l0.wk", "l0.wq", "l0.wv", "l1.w_down", "l1.wqkv"]
    assert (step["l0.wv"].block_size, step["l1.wqkv"].block_size) == (16, 32)
    for name, parts in step.items():
        assert parts.bits == 8
        want = inits[name]
        assert want.dtype == np.float32 and np.array_equal(_values(parts), want), name


def test_the_float_step_on_the_step_file_gives_the_reference_tokens(mixed):
    spec, folder = mixed
    dec = OrtDecoder.from_pretrained(str(folder), native_decode=True, int8_activations=False,
                                     **KW)
    assert dec.native is not None and not dec.native.int8
    assert dec.native.float_linears() == 0
    c = spec.geometry
    for prompt in ([5, 60, 70, 80, 90], [7, 8, 9]):
        out = dec.generate([prompt], max_new_tokens=8)[0]
        seq = list(prompt)
        for _ in range(8):
            seq.append(int(reference_logits(c, spec.reference, seq)[-1].argmax()))
        assert out == seq[len(prompt):]


def test_int8_steps_on_the_step_file_are_deterministic(mixed):
    """Alone or in a batch, its prompt cached or not: the same greedy tokens."""
    spec, folder = mixed
    dec = OrtDecoder.from_pretrained(str(folder), **KW)
    assert dec.native is not None and dec.native.int8
    prompts = [[5, 60, 70, 80, 90], [7, 8, 9], [11, 12, 13, 14]]
    batch = dec.generate(prompts, max_new_tokens=8)
    alone = [dec.generate([p], max_new_tokens=8)[0] for p in prompts]
    again = [dec.generate([p], max_new_tokens=8)[0] for p in prompts]
    assert batch == alone == again


def _copy(folder, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def test_a_truncated_step_file_is_refused(mixed, tmp_path):
    _, folder = mixed
    copy = _copy(folder, tmp_path)
    data = (copy / STEP_FILE).read_bytes()
    (copy / STEP_FILE).write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFolderError, match="step file"):
        OrtDecoder.from_pretrained(str(copy), **KW)
    graph = OrtDecoder.from_pretrained(str(copy), native_decode=False,
                                       int8_activations=False, **KW)
    assert len(graph.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2


def test_a_foreign_step_file_is_refused(mixed, tmp_path):
    """Another model's file (other shapes), or one with a weight the graph lacks."""
    _, folder = mixed
    other = _mix(tmp_path, seed=9, sizes=dict(K_SIZES, intermediate_size=768))
    foreign = import_gguf(other.path, cache_dir=tmp_path / "cache")
    copy = _copy(folder, tmp_path)
    shutil.copy(foreign / STEP_FILE, copy / STEP_FILE)
    with pytest.raises(ModelFolderError, match="w_down"):
        OrtDecoder.from_pretrained(str(copy), **KW)
    step = read_step_blocks(folder / STEP_FILE)
    save_step_blocks(copy / STEP_FILE, {**step, "l7.wo": step["l0.w_down"]})
    with pytest.raises(ModelFolderError, match="l7.wo"):
        OrtDecoder.from_pretrained(str(copy), **KW)


@pytest.mark.parametrize("how", ["format", "stray", "scales", "name"])
def test_read_step_blocks_refuses_what_does_not_fit(tmp_path, how):
    rng = np.random.default_rng(0)
    parts = BlockQuantized("q8_0", random_blocks(rng, (8, 64), Q.Q8_0, 0.1)).matmul_nbits()
    path = tmp_path / STEP_FILE
    if how == "name":
        with pytest.raises(ModelFolderError, match="name"):
            save_step_blocks(path, {"a/b": parts})
        return
    save_step_blocks(path, {"l0.wq": parts})
    assert set(read_step_blocks(path)) == {"l0.wq"}
    arrays = dict(np.load(path))
    if how == "format":
        arrays["format"] = np.array(99, np.int64)
    elif how == "stray":
        arrays["l0.wq/extra"] = np.zeros(3)
    else:
        arrays["l0.wq/scales"] = arrays["l0.wq/scales"][:-1]
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ModelFolderError, match="step file"):
        read_step_blocks(path)


def test_concat_nbits_writes_out_default_zero_points():
    rng = np.random.default_rng(1)
    q8 = BlockQuantized("q8_0", random_blocks(rng, (4, 64), Q.Q8_0, 0.1)).matmul_nbits()
    q5 = BlockQuantized("q5_0", random_blocks(rng, (6, 64), Q.Q5_0, 0.1)).matmul_nbits()
    assert q8.zero_points is None and q5.zero_points is not None
    joined = concat_nbits([q5, q8])
    assert joined is not None
    assert np.array_equal(_values(joined), np.concatenate([_values(q5), _values(q8)], axis=1))
    q6 = BlockQuantized("q6_k", random_blocks(rng, (4, 256), Q.Q6_K, 0.1)).matmul_nbits()
    q5k = BlockQuantized("q5_0", random_blocks(rng, (4, 256), Q.Q5_0, 0.1)).matmul_nbits()
    assert concat_nbits([q5k, q6]) is None        # blocks of 32 and 16


def test_a_step_file_without_its_folder_or_outside_it_is_refused(mixed, tmp_path):
    import onnx

    from pagedkv_np.onnxruntime import UnsupportedModelError

    _, folder = mixed
    model = onnx.load(str(folder / "model.onnx"), load_external_data=True)
    with pytest.raises(UnsupportedModelError, match="from its path"):
        OrtDecoder(model.SerializeToString(), num_pages=16, page_size=4)
    copy = _copy(folder, tmp_path)
    proto = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    for prop in proto.metadata_props:
        if prop.key == "pagedkv_np.step_blocks":
            prop.value = "../" + STEP_FILE
    onnx.save(proto, str(copy / "model.onnx"))
    with pytest.raises(UnsupportedModelError, match="step file.*outside"):
        OrtDecoder.from_pretrained(str(copy), **KW)
