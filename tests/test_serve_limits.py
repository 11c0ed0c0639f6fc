"""``pagedkv serve`` under hostile or careless clients: large bodies, slow
clients, text that is not Unicode, deep JSON, clients that leave mid-upload.

Each test runs the real server (``tests/test_serve.py``'s small model folder)
in a subprocess on 127.0.0.1 and asserts behaviour, not timings: which
response arrives first, which connections the server closes, what a metric
counted.
"""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402

from pagedkv_np.errors import InvalidTextError, PagedKVError  # noqa: E402
from pagedkv_np.text.codec import TextCodec  # noqa: E402
from test_serve import (CONTEXT, NUM_PAGES, PAGE_SIZE, Server, assert_error,  # noqa: E402
                        build_folder)

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident memory (VmHWM) in MiB; None off Linux."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or
    ``timeout`` seconds of silence: then the test fails)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(
                f"the server kept the connection open; got {data[:200]!r}") from None
        if not chunk:
            return data
        data += chunk


def raw_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("limits") / "tiny-chat"
    build_folder(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE))
    yield s
    assert s.stop() == 0


# ------------------------------------------------------------ large bodies
class TestLargeBodies:
    def test_body_over_the_cap_is_413(self, server):
        big = json.dumps({"messages": [{"role": "user", "content": "Paris " * 900_000}]})
        assert len(big) > 4 * 1024 * 1024   # the default --max-body-size
        with server.http() as http:
            r = http.post(CHAT, content=big, headers={"Content-Type": "application/json"},
                          timeout=60)
            assert_error(r, 413, code="request_too_large")

            def chunked():   # no Content-Length: the cap applies as the body arrives
                for i in range(0, len(big), 1 << 20):
                    yield big[i:i + (1 << 20)].encode()

            r = http.post(CHAT, content=chunked(), headers={"Content-Type": "application/json"},
                          timeout=60)
            assert_error(r, 413, code="request_too_large")
            assert http.get("/health").status_code == 200

    def test_text_too_long_for_the_context_is_refused_untokenized(self, server):
        before = peak_rss_mib(server.proc.pid)
        prompt = "Paris " * 500_000   # 3 MB: tokenizing it took a minute and 0.6 GiB
        with server.http() as http:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=60)
            assert_error(r, 400, param="prompt", code="context_length_exceeded")
            r = http.post(CHAT, json={"messages": [{"role": "user", "content": prompt}]},
                          timeout=60)
            assert_error(r, 400, param="messages", code="context_length_exceeded")
        after = peak_rss_mib(server.proc.pid)
        if before is not None:
            print(f"\npeak RSS {before:.0f} MiB -> {after:.0f} MiB over two 3 MB prompts")
            assert after - before < 256

    def test_the_length_check_never_refuses_a_prompt_that_fits(self, server, folder):
        """The longest token, ``CONTEXT - 1`` times: as many characters per
        token as this tokenizer allows, and the prompt still fits."""
        codec = TextCodec.from_folder(folder)
        longest = max(codec.tokenizer.get_vocab(with_added_tokens=True), key=len)
        prompt = longest * (CONTEXT - 1)
        assert len(codec.encode(prompt)) == CONTEXT - 1
        with server.http() as http:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == CONTEXT - 1


@pytest.fixture(scope="module")
def unbounded_folder(tmp_path_factory) -> pathlib.Path:
    """The model folder with a tokenizer that drops whitespace: the server
    can bound nothing before tokenizing, so a long prompt is tokenized in
    full."""
    path = tmp_path_factory.mktemp("limits") / "split-chat"
    build_folder(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.save(str(path / "tokenizer.json"))
    return path


def test_health_answers_while_a_long_prompt_is_tokenized(unbounded_folder):
    s = Server(str(unbounded_folder), "--num-pages", str(NUM_PAGES))
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Paris " * 600_000}],
                           "max_tokens": 1}).encode()
        before = peak_rss_mib(s.proc.pid)
        done: dict = {}

        def big() -> None:
            with socket.create_connection(("127.0.0.1", s.port), timeout=600) as sock:
                sock.sendall(raw_head(CHAT, len(body)) + body)
                done["sent"] = time.monotonic()
                done["reply"] = read_until_closed_or_answered(sock)
                done["answered"] = time.monotonic()

        thread = threading.Thread(target=big)
        thread.start()
        while "sent" not in done and thread.is_alive():
            time.sleep(0.01)
        time.sleep(0.5)   # the server now parses and tokenizes 3.6 MB
        with s.http() as http:
            health = http.get("/health", timeout=600)
        health_answered = time.monotonic()
        thread.join(600)
        assert health.status_code == 200
        assert done["reply"].startswith(b"HTTP/1.1 400"), done["reply"][:200]
        assert b"context_length_exceeded" in done["reply"]
        # the event loop answered /health while the prompt was being tokenized
        assert health_answered < done["answered"]
        after = peak_rss_mib(s.proc.pid)
        print(f"\ntokenizing 3.6 MB took {done['answered'] - done['sent']:.1f} s; /health "
              f"answered after {health_answered - done['sent']:.2f} s; peak RSS "
              f"{before} -> {after} MiB")
    finally:
        assert s.stop() == 0


def read_until_closed_or_answered(sock: socket.socket) -> bytes:
    """The first response on ``sock`` (head and Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


# ------------------------------------------------------------ slow clients
def test_slow_clients_are_cut_off(folder):
    s = Server(str(folder), "--num-pages", "64", "--header-timeout", "1", "--body-timeout", "1",
               "--max-connections", "64")
    try:
        socks = []
        for _ in range(8):   # half a request head
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            socks.append(("head", sock))
        for _ in range(8):   # a head, then half the body
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(raw_head("/v1/completions", 100) + b'{"prompt": "Paris')
            socks.append(("body", sock))
        for _ in range(2):   # connected, silent
            socks.append(("idle", socket.create_connection(("127.0.0.1", s.port))))
        trickle = socket.create_connection(("127.0.0.1", s.port))
        trickle.sendall(raw_head("/v1/completions", 1000))
        with s.http() as http:   # the server answers while they hold their connections
            assert http.get("/health").status_code == 200
        for _ in range(40):      # one byte every 0.1 s: alive, but past the body deadline
            try:
                trickle.sendall(b" ")
            except OSError:
                break
            time.sleep(0.1)
        replies = {"head": [], "body": [], "idle": []}
        for kind, sock in socks:
            with sock:
                replies[kind].append(read_until_closed(sock, timeout=30))
        with trickle:
            trickled = read_until_closed(trickle, timeout=30)
        for reply in replies["head"]:
            assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        for reply in replies["body"] + [trickled]:
            assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert replies["idle"] == [b"", b""]
        with s.http() as http:
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"prompt": "Paris", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        assert s.stop() == 0


def test_connection_limit(folder):
    s = Server(str(folder), "--num-pages", "64", "--max-connections", "4",
               "--header-timeout", "2")
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        time.sleep(0.2)   # the server has accepted them
        with httpx.Client(base_url=s.base, timeout=30, trust_env=False) as http:
            assert http.get("/health").status_code == 503   # over the limit, not queued
        for sock in idle:   # the header deadline closes them ...
            with sock:
                read_until_closed(sock, timeout=30)
        for _ in range(100):   # ... and the server answers again
            with httpx.Client(base_url=s.base, timeout=30, trust_env=False) as http:
                if http.get("/health").status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("/health stayed 503 after the idle connections closed")
    finally:
        assert s.stop() == 0


# ------------------------------------------------------- text, JSON, leaving
class TestLoneSurrogates:
    @pytest.mark.parametrize("route, body, param", [
        (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]},
         "messages[0].content[1].text"),
        (CHAT, {"messages": HELLO, "model": "m\ud800"}, "model"),
        (CHAT, {"messages": HELLO, "cache_salt": "\ud800"}, "cache_salt"),
        (CHAT, {"messages": HELLO, "stop": ["x", "\udc00"]}, "stop"),
        ("/v1/completions", {"prompt": "The capital \ud83d is"}, "prompt"),
        ("/v1/completions", {"prompt": ["\ud800"]}, "prompt"),
    ])
    @pytest.mark.parametrize("stream", [False, True])
    def test_is_a_400_naming_the_field(self, server, route, body, param, stream):
        raw = json.dumps(dict(body, max_tokens=4, stream=stream))   # \ud800 escapes: valid JSON
        assert "\\ud" in raw
        with server.http() as http:
            r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        err = assert_error(r, 400, param=param, code="invalid_value")
        assert "surrogate" in err["message"]

    def test_a_valid_pair_is_text(self, server):
        with server.http() as http:
            r = http.post("/v1/completions", json={"prompt": "Emoji: \U0001F600",
                                                   "max_tokens": 2})
        assert r.status_code == 200

    def test_codec_raises_a_typed_error(self, folder):
        codec = TextCodec.from_folder(folder)
        with pytest.raises(InvalidTextError, match="U\\+D800") as info:
            codec.encode("ab\ud800")
        assert isinstance(info.value, PagedKVError) and isinstance(info.value, ValueError)
        assert info.value.index == 2
        with pytest.raises(InvalidTextError):
            codec.encode_chat([{"role": "user", "content": "\udbff!"}])


def test_deeply_nested_json_is_a_400(server):
    with server.http() as http:
        for raw in ("[" * 100_000 + "]" * 100_000,
                    '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
                    '{"prompt": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001):
            r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
            assert_error(r, 400, code="invalid_json")
        assert http.get("/health").status_code == 200


def test_a_client_leaving_mid_upload_is_no_server_error(folder):
    s = Server(str(folder), "--num-pages", "64", log_level="info")
    try:
        left = 'pagedkv_http_requests_total{route="/v1/chat/completions",status="499"}'
        failed = 'pagedkv_http_requests_total{route="/v1/chat/completions",status="500"}'
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall(raw_head(CHAT, 1000) + b'{"messages": [')
        for _ in range(200):
            if s.metric(left, default=0.0) == 2:
                break
            time.sleep(0.05)
        assert s.metric(left, default=0.0) == 2
        assert s.metric(failed, default=0.0) == 0
        with s.http() as http:
            assert http.get("/health").status_code == 200
    finally:
        assert s.stop() == 0
    log = s.output
    lines = [x for x in log.splitlines() if "left before sending its whole request" in x]
    assert len(lines) == 2, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log
