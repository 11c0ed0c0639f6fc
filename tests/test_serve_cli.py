"""``pagedkv serve``'s options and protocol points on a real server.

Few server starts (each costs seconds), many checks per start. The model is
the small folder of ``test_serve`` with its rotary tables hidden behind a
``Mul`` (so the graph sets no position limit the engine can read) and a
configuration context smaller than the pool: the limit is the engine's
(``OrtDecoder.limits``), and the server must give the same one.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.text.codec import TextCodec  # noqa: E402
from test_serve import ROOT, Server, assert_error, build_folder, free_port  # noqa: E402

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


# ------------------------------------------------------------ checked early
@pytest.mark.parametrize("args, says", [
    (["--num-pages", "8", "--kv-cache-memory", "1GiB"], "not both"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory"),
    (["--kv-cache-memory", "3XB"], "--kv-cache-memory"),
    (["--disk-cache-size", "1GiB"], "--disk-cache-size needs --disk-cache"),
    (["--disk-cache", "/tmp", "--disk-cache-size", "-5"], "--disk-cache-size"),
    (["--disk-cache", "/etc/hostname"], "not a directory"),
    (["--redis-url", "http://127.0.0.1:6379"], "--redis-url must start"),
    (["--redis-url", "redis://127.0.0.1:1"], "PAGEDKV_HASH_SECRET"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-context", "0"], "--max-context"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    (["--kv-dtype", "int4"], "--kv-dtype"),
    (["--accuracy-level", "3"], "--accuracy-level"),
    (["--weights", "q2"], "--weights"),
    (["--int8-activations", "--no-native-decode"],
     "--int8-activations needs the engine's own decode step: drop --no-native-decode"),
    (["--native-decode", "--no-native-decode"], "not allowed with argument --native-decode"),
])
def test_bad_options_exit_2_before_loading(args, says):
    """The model does not exist: only the option can be reported."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_HASH_SECRET"}
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", "/no/such/model.gguf",
                           "--port", str(free_port()), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "cannot load the model" not in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flag", ["--weights", "--accuracy-level", "--max-context"])
def test_gguf_options_refused_for_a_folder(tmp_path, flag):
    value = {"--weights": "q4", "--accuracy-level": "4", "--max-context": "64"}[flag]
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", str(tmp_path),
                           "--port", str(free_port()), flag, value], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and f"{flag} applies to .gguf models only" in done.stderr


def test_help_shows_defaults():
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    text = " ".join(done.stdout.split())
    for flag in ("--kv-dtype", "--kv-cache-memory", "--disk-cache", "--disk-cache-size",
                 "--redis-url", "--max-model-len", "--weights", "--accuracy-level",
                 "--max-context", "--access-log", "--served-model-name",
                 "--int8-activations", "--native-decode", "--no-native-decode"):
        assert flag in text
    for default in ("default 512", "default 4GiB", "default q4", "default 8192",
                    "default 0", "default: the model's K/V dtype"):
        assert default in text, default


# ------------------------------------------------------- one server, many flags
def parse_metrics(text: str) -> dict:
    """{(name, frozenset(labels)): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


SERVED = "tiny"
MAX_MODEL_LEN = 300
POOL_BYTES = 3 * 2 ** 20


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    """A server started with most options at once; yields (server, disk dir)."""
    folder = tmp_path_factory.mktemp("flags") / "tiny-chat"
    build_folder(folder)
    disk = tmp_path_factory.mktemp("disk") / "tier"
    s = Server(str(folder), "--served-model-name", SERVED, "--kv-dtype", "int8",
               "--kv-cache-memory", "3MiB", "--page-size", "16", "--disk-cache", str(disk),
               "--disk-cache-size", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
               "--access-log", "--max-batch-size", "2", "--no-spin", log_level="info")
    yield s, folder, disk
    if not s.proc.stdout.closed:
        s.stop()


class TestFlags:
    def test_pool_sized_by_bytes_in_int8(self, flagged):
        server, folder, _ = flagged
        # bytes per page from the engine itself: a one-page int8 pool of the model
        dec = OrtDecoder.from_pretrained(str(folder), num_pages=1, page_size=16,
                                         kv_dtype="int8")
        expected_pages = POOL_BYTES // dec.cache.nbytes
        assert expected_pages >= 2
        metrics = parse_metrics(httpx.get(server.base + "/metrics", trust_env=False).text)
        assert metrics["pagedkv_pages", frozenset()] == expected_pages
        info = {k: v for k, v in metrics if k == "vllm:cache_config_info"}
        labels = dict(next(iter(info.values())))
        assert labels["block_size"] == "16" and labels["cache_dtype"] == "int8"
        assert labels["num_gpu_blocks"] == str(expected_pages)
        model = frozenset({("model_name", SERVED)})
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            assert metrics[name, model] == 0.0
        used = metrics["pagedkv_pages_used", frozenset()]
        assert metrics["vllm:kv_cache_usage_perc", model] == used / expected_pages

    def test_served_name_and_models_routes(self, flagged):
        server = flagged[0]
        with server.http() as http:
            listed = http.get("/v1/models").json()["data"]
            assert [m["id"] for m in listed] == [SERVED]
            assert listed[0]["max_model_len"] == MAX_MODEL_LEN
            one = http.get(f"/v1/models/{SERVED}")
            assert one.status_code == 200 and one.json()["id"] == SERVED
            assert_error(http.get("/v1/models/tiny-chat"), 404, code="model_not_found")
            assert_error(http.get("/v1/models/a/b"), 404)
            hello = [{"role": "user", "content": "Hello"}]
            for name in (SERVED, None):
                body = {"messages": hello, "max_tokens": 2}
                if name:
                    body["model"] = name
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.json()["model"] == SERVED, r.text
            for other in ("tiny-chat", "gpt-4o"):
                assert_error(http.post("/v1/chat/completions", json={
                    "model": other, "messages": hello}), 404, param="model",
                    code="model_not_found")
                assert_error(http.post("/v1/completions", json={
                    "model": other, "prompt": "Hi"}), 404, code="model_not_found")

    def test_max_model_len(self, flagged):
        server = flagged[0]
        with server.http() as http:
            ok = http.post("/v1/completions", json={"prompt": [5] * 10,
                                                    "max_tokens": MAX_MODEL_LEN - 9})
            assert ok.status_code == 200, ok.text
            err = assert_error(http.post("/v1/completions", json={
                "prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN - 8}), 400,
                code="context_length_exceeded")
            assert f"{MAX_MODEL_LEN} tokens" in err["message"]

    def test_tokenize_and_detokenize(self, flagged):
        server, folder, _ = flagged
        codec = TextCodec.from_folder(str(folder))
        text = "The capital of France is Paris. 😀"
        plain = codec.encode(text, add_special_tokens=False).tolist()
        with server.http() as http:
            # llama.cpp's shape
            r = http.post("/tokenize", json={"content": text})
            assert r.status_code == 200 and r.json() == {"tokens": plain}
            # vLLM's shapes
            r = http.post("/tokenize", json={"prompt": text}).json()
            assert r["tokens"] == codec.encode(text).tolist()
            assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
            msgs = [{"role": "user", "content": text}]
            r = http.post("/tokenize", json={"messages": msgs}).json()
            assert r["tokens"] == codec.encode_chat(msgs).tolist()
            back = http.post("/detokenize", json={"tokens": plain}).json()
            assert back == {"content": text, "prompt": text}
            assert_error(http.post("/tokenize", json={}), 400,
                         code="missing_required_parameter")
            assert_error(http.post("/tokenize", json={"content": 5}), 400, param="content")
            assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400,
                         param="tokens")
            assert_error(http.post("/detokenize", json={"tokens": [10 ** 9]}), 400,
                         param="tokens", code="invalid_value")

    def test_disk_tier_directory_is_used(self, flagged):
        disk = flagged[2]
        assert disk.is_dir() and any(disk.iterdir())

    def test_summary_access_log_and_unknown_fields(self, flagged):
        server = flagged[0]
        with server.http() as http:
            for _ in range(2):
                r = http.post("/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 3, "mystery_field": 1})
                assert r.status_code == 200
            usage = r.json()["usage"]
        assert server.stop() == 0
        log = server.output
        summary = [line for line in log.splitlines() if "serving tiny" in line]
        assert len(summary) == 1, log
        line = summary[0]
        for part in ("llama", "2 layers", f"context {MAX_MODEL_LEN} tokens", "K/V int8",
                     "tiers: disk", "batch 2", "spin off", "decode graph",
                     f"127.0.0.1:{server.port}"):
            assert part in line, (part, line)
        assert len(re.findall(r"unknown request field 'mystery_field'", log)) == 1, log
        access = [ln for ln in log.splitlines() if "POST /v1/completions 200" in ln]
        assert len(access) >= 2, log
        assert f"prompt_tokens={usage['prompt_tokens']} " \
               f"completion_tokens={usage['completion_tokens']}" in access[-1]
        assert re.search(r"GET /v1/models 200 \d+\.\d ms", log)


def test_gguf_import_options(tmp_path, monkeypatch):
    """--weights, --accuracy-level and --max-context reach the import: the
    served context is --max-context and the imported folder records them;
    --int8-activations reaches the engine's decode step (the summary says so)."""
    from test_gguf_import import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    server = Server(str(path), "--weights", "q4", "--accuracy-level", "4", "--max-context",
                    "48", "--num-pages", "16", "--int8-activations", log_level="info")
    try:
        with server.http() as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["id"] == "tiny" and card["max_model_len"] == 48
            r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code == 200, r.text
    finally:
        assert server.stop() == 0
    summary = [line for line in server.output.splitlines() if "serving tiny" in line]
    assert len(summary) == 1 and "decode native int8 |" in summary[0], server.output
    configs = list((tmp_path / "cache").rglob("config.json"))
    assert len(configs) == 1
    recorded = json.loads(configs[0].read_text())["pagedkv_np"]
    assert recorded["weights"] == "q4" and recorded["accuracy_level"] == 4
    assert recorded["max_context"] == 48


def test_kv_dtype_other_than_the_models_exits_2(tmp_path):
    folder = tmp_path / "tiny-chat"
    build_folder(folder)
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", str(folder),
                           "--port", str(free_port()), "--kv-dtype", "float16"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "--kv-dtype float16: the model's K/V are float32" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, int8", [([], True), (["--native-decode"], True),
                                         (["--int8-activations"], True),
                                         (["--no-int8-activations"], None),
                                         (["--native-decode", "--no-int8-activations"], False),
                                         (["--no-native-decode"], None)])
def test_decode_flags_reach_the_engine(tmp_path, monkeypatch, flags, int8):
    """A GGUF import is a graph the engine can decode itself: by default its
    own step does, with int8 activations; --no-int8-activations leaves float32
    ones to onnxruntime's graph, --native-decode with it makes the engine's
    step decode them, and --no-native-decode keeps the graph."""
    from test_gguf_import import write_gguf

    from pagedkv_np.onnxruntime.native import NativeDecode
    from pagedkv_np.serve.command import describe_decode, load_decoder, parse_args

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    decoder = load_decoder(parse_args([str(path), "--num-pages", "16", "--threads", "1",
                                       *flags]))
    step = decoder.native
    if int8 is None:
        assert step is None and describe_decode(decoder) == "graph"
    else:
        assert isinstance(step, NativeDecode) and step.int8 is int8
        assert describe_decode(decoder) == ("native int8" if int8 else "native")
    assert len(decoder.generate([[1, 2, 3]], max_new_tokens=4)[0]) == 4


def test_prefill_chunk_reaches_the_engine(tmp_path, monkeypatch):
    """--prefill-chunk: a prompt fed beside a decoding request takes as many
    steps as chunks of that size."""
    from test_gguf_import import write_gguf

    from pagedkv_np.serve.command import load_decoder, parse_args

    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    chunks = {}
    for size in (8, 20):
        decoder = load_decoder(parse_args([str(path), "--num-pages", "16", "--threads", "1",
                                           "--prefill-chunk", str(size)]))
        decoder.add_request([1, 2, 3], max_new_tokens=60, ignore_eos=True)
        decoder.step()
        before = decoder.stats["num_prefill_chunks"]
        rid = decoder.add_request(list(range(1, 41)), max_new_tokens=2, ignore_eos=True)
        while not decoder.get_output(rid):
            decoder.step()
        chunks[size] = decoder.stats["num_prefill_chunks"] - before
    assert chunks == {8: 5, 20: 2}


def test_int8_activations_on_a_graph_the_engine_cannot_decode_exit_2(tmp_path):
    """The small folder's graph is of the optimum family, which the engine's
    decode step does not run: the load refuses the flag in one line, and says
    why."""
    folder = tmp_path / "tiny-chat"
    build_folder(folder)
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", str(folder),
                           "--port", str(free_port()), "--int8-activations"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "int8_activations" in done.stderr and "gqa family" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
