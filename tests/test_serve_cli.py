"""``pagedkv serve``'s options and protocol points on a real server.

Few server starts (each costs seconds), many checks per start. The model is
the small folder of ``test_serve`` with its rotary tables hidden behind a
``Mul`` (so the graph sets no position limit the engine can read) and a
configuration context smaller than the pool: the limit is the engine's
(``OrtDecoder.limits``), and the server must give the same one.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from test_serve import Server, assert_error, build_folder  # noqa: E402

SMALL_CONTEXT = 200


def hide_position_tables(path: pathlib.Path) -> int:
    """Route every 2-D initializer that a Gather or GroupQueryAttention reads
    through ``Mul(table, 1)``: its rows are no longer a constant the engine
    reads. Returns the number of tables hidden."""
    model = onnx.load(str(path))
    graph = model.graph
    tables = {i.name for i in graph.initializer if len(i.dims) == 2}
    used = set()
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            used.update(n for n in node.input[7:9] if n in tables)
        elif node.op_type == "Gather" and node.input[0] in tables \
                and not node.input[0].startswith("embed"):
            used.add(node.input[0])
    graph.initializer.append(numpy_helper.from_array(np.ones((), np.float32), "one_"))
    for name in used:
        for node in graph.node:
            node.input[:] = [name + "_hidden" if n == name else n for n in node.input]
        graph.node.insert(0, helper.make_node("Mul", [name, "one_"], [name + "_hidden"]))
    onnx.save(model, str(path))
    return len(used)


@pytest.fixture(scope="module")
def small_context(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("symbolic") / "tiny-symbolic"
    build_folder(folder)
    assert hide_position_tables(folder / "model.onnx") > 0
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = SMALL_CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class TestEngineLimits:
    def test_server_and_engine_agree(self, small_context):
        dec = OrtDecoder.from_pretrained(str(small_context), num_pages=64, page_size=16)
        assert dec.io.max_positions is None          # the graph sets no limit
        assert dec.context_length == SMALL_CONTEXT   # the configuration does
        assert dec.limits.pool_tokens > SMALL_CONTEXT
        prompt = [5] * 20
        server = Server(str(small_context), "--num-pages", "64", "--page-size", "16")
        try:
            with server.http() as http:
                models = http.get("/v1/models").json()
                assert models["data"][0]["max_model_len"] == SMALL_CONTEXT
                # the default budget is limits.room(n): the whole context is used
                room = dec.limits.room(len(prompt))
                assert room == SMALL_CONTEXT - len(prompt) + 1
                r = http.post("/v1/completions", json={"prompt": prompt})
                assert r.status_code == 200, r.text
                num_new = r.json()["usage"]["completion_tokens"]
                assert num_new <= room
                if r.json()["choices"][0]["finish_reason"] == "length":
                    assert num_new == room
                # exactly the room fits, one more does not: the engine's rule
                dec.check_request(len(prompt), room)
                ok = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": room})
                assert ok.status_code == 200, ok.text
                err = assert_error(http.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": room + 1}), 400, param="prompt",
                    code="context_length_exceeded")
                assert f"maximum context length is {SMALL_CONTEXT} tokens" in err["message"]
                assert "page" not in err["message"]
                err = assert_error(http.post("/v1/completions", json={
                    "prompt": [5] * (SMALL_CONTEXT + 1)}), 400, param="prompt",
                    code="context_length_exceeded")
                assert f"{SMALL_CONTEXT} tokens" in err["message"]
        finally:
            assert server.stop() == 0
