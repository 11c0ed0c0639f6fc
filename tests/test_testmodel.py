"""The generated test decoder: its ONNX graphs compute what the NumPy forward does,
and it is sensitive enough to the context for the engine tests to mean something."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from pagedkv_np import ConfigError
from pagedkv_np.models.geometry import DecoderGeometry
from pagedkv_np.models.testmodel import DecoderConfig, build_model, main, reference_logits

CONFIG = DecoderConfig()
VARIANTS = [("optimum", True), ("optimum", False), ("gqa", True)]


def _session(family, position_ids=True, config=CONFIG):
    model = build_model(config, family=family, position_ids=position_ids)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(sess, tokens, positions=None):
    n = len(tokens)
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, n), np.int64)}
    for arg in sess.get_inputs():
        if arg.name == "position_ids":
            feeds[arg.name] = (np.arange(n) if positions is None else positions)[None]
        elif arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
        elif arg.name == "num_logits_to_keep":   # 0: every position
            feeds[arg.name] = np.zeros(1, np.int64)
    return sess.run(["logits"], feeds)[0][0]


@pytest.mark.parametrize("family, position_ids", VARIANTS)
def test_onnx_graph_matches_the_numpy_forward(family, position_ids):
    sess = _session(family, position_ids)
    tokens = np.random.default_rng(3).integers(0, CONFIG.vocab_size, 45).tolist()
    got, want = _run(sess, tokens), reference_logits(CONFIG, tokens)
    assert got.shape == (45, CONFIG.vocab_size)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_past_and_present_follow_the_io_conventions():
    """optimum: present = past ++ new K/V; gqa: the new token lands at seqlens_k."""
    tokens = np.random.default_rng(4).integers(0, CONFIG.vocab_size, 12).tolist()
    for family in ("optimum", "gqa"):
        sess = _session(family)
        h, d = CONFIG.num_kv_heads, CONFIG.head_dim
        full = sess.run(None, _feeds(sess, tokens, [np.zeros((1, h, 0, d), np.float32)] * 4, 0))
        names = [o.name for o in sess.get_outputs()]
        past = [full[names.index(f"present.{i}.{kind}")][:, :, :11]
                for i in range(2) for kind in ("key", "value")]
        step = sess.run(None, _feeds(sess, tokens[11:], [np.ascontiguousarray(p) for p in past],
                                     11))
        np.testing.assert_allclose(step[0][0, -1], full[0][0, -1], rtol=0, atol=1e-3)
        for name in ("present.0.key", "present.1.value"):
            np.testing.assert_allclose(step[names.index(name)], full[names.index(name)],
                                       rtol=0, atol=1e-4)


def _feeds(sess, tokens, past, num_past):
    n = len(tokens)
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, num_past + n), np.int64)}
    if any(a.name == "position_ids" for a in sess.get_inputs()):
        feeds["position_ids"] = np.arange(num_past, num_past + n)[None]
    if any(a.name == "num_logits_to_keep" for a in sess.get_inputs()):
        feeds["num_logits_to_keep"] = np.zeros(1, np.int64)     # 0: every position
    names = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    feeds.update(zip(names, past))
    return feeds


def test_families_list_kv_as_their_exporters_do():
    optimum = [a.name for a in _session("optimum").get_inputs()]
    gqa = [a.name for a in _session("gqa").get_inputs()]
    assert optimum[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert gqa[2:4] == ["past_key_values.0.key", "past_key_values.1.key"]
    assert "position_ids" in optimum and "position_ids" not in gqa


def test_next_token_depends_on_the_whole_context():
    """The engine tests could not notice wrong K/V if only the last token mattered,
    nor a wrong position if positions did not matter."""
    rng = np.random.default_rng(5)
    sess = _session("optimum")
    trials, changed_by_first, changed_by_gap = 40, 0, 0
    for _ in range(trials):
        tokens = rng.integers(0, CONFIG.vocab_size, 24).tolist()
        base = _run(sess, tokens)[-1]
        other = [(tokens[0] + 1) % CONFIG.vocab_size] + tokens[1:]
        changed_by_first += _run(sess, other)[-1].argmax() != base.argmax()
        gap = np.arange(24)
        gap[-1] += 1                    # the last token one position too far
        changed_by_gap += _run(sess, tokens, gap)[-1].argmax() != base.argmax()
        # RoPE is relative: shifting every position alike changes nothing
        shifted = _run(sess, tokens, np.arange(7, 31))[-1]
        assert np.abs(shifted - base).max() < 1e-3
    assert changed_by_first >= trials // 6
    assert changed_by_gap >= trials // 6


def test_logits_are_well_separated():
    """The top two logits are far apart compared with the ONNX/NumPy difference."""
    tokens = np.random.default_rng(6).integers(0, CONFIG.vocab_size, 200).tolist()
    want = reference_logits(CONFIG, tokens)
    noise = np.abs(_run(_session("gqa"), tokens) - want).max()
    top2 = np.sort(want, axis=1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    assert np.median(gaps) > 1000 * noise
    assert np.mean(gaps < 20 * noise) < 0.02


def test_cli_writes_a_loadable_model(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    assert main([str(path), "--family", "gqa", "--hidden", "32", "--layers", "1",
                 "--heads", "4", "--kv-heads", "1", "--vocab", "50"]) == 0
    assert "gqa" in capsys.readouterr().out
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {a.name: a.shape for a in sess.get_inputs()}
    assert shapes["past_key_values.0.key"][1::2] == [1, 8]
    assert sess.get_outputs()[0].shape[-1] == 50


@pytest.mark.parametrize("kw", [dict(hidden_size=30, num_heads=4), dict(num_kv_heads=3),
                                dict(hidden_size=36, num_heads=4, num_kv_heads=2),
                                dict(num_layers=0), dict(head_dim=-2),
                                dict(head_dim=15, hidden_size=60)])
def test_bad_config(kw):
    with pytest.raises(ConfigError):
        DecoderConfig(**kw)


def test_bad_family():
    with pytest.raises(ConfigError, match="family"):
        build_model(family="torch")


def test_config_is_the_one_geometry_class():
    """The test decoder's sizes are the geometry the graph builder and the GGUF
    reader use, with head_dim and intermediate_size filled in when not given."""
    assert DecoderConfig is DecoderGeometry
    c = DecoderConfig(hidden_size=48, num_heads=6, num_kv_heads=3)
    assert (c.head_dim, c.intermediate_size) == (8, 144)
    assert DecoderConfig(head_dim=32, intermediate_size=10).head_dim == 32


def test_seed_changes_the_weights_only():
    a, b = build_model(seed=0), build_model(seed=1)
    assert [i.name for i in a.graph.input] == [i.name for i in b.graph.input]
    wa = {t.name: t.raw_data for t in a.graph.initializer}
    wb = {t.name: t.raw_data for t in b.graph.initializer}
    assert wa["l0.wqkv"] != wb["l0.wqkv"]     # Q, K and V packed side by side
    assert reference_logits(CONFIG, [1, 2, 3], seed=1).shape == (3, CONFIG.vocab_size)
