"""HTTP fuzzing of ``pagedkv serve``: a bounded run of random requests
against the real server on 127.0.0.1 (the small model of
``tests/test_serve.py``).

Hypothesis draws each request: a valid chat or completion body with a few
fields replaced by random JSON (wrong types, out of range, huge numbers,
lone surrogates, deep nesting), raw bodies (invalid UTF-8, truncated JSON,
nesting past the parser's limit), bodies around the size cap, other routes
and methods, and clients that leave mid-upload, mid-stream or while a whole
answer is computed. Every response is checked as it comes (never a 5xx, an
error in OpenAI's shape, a stream that ends cleanly); at the end the server
must still answer, hold no page, no queued and no running request, have
counted no 5xx and logged no traceback, and give the same greedy answers as
before the run.
"""

from __future__ import annotations

import collections
import json
import re
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import PAGE_SIZE, Server, build_folder  # noqa: E402

MAX_EXAMPLES = 240          # about that many requests, and a few more
MAX_BODY = 64 * 1024        # the server's --max-body-size here
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# greedy requests sent before and after the run: the answers must not change
PROBES = [(CHAT, {"messages": [{"role": "user", "content": "Where is Paris?"}],
                  "max_tokens": 12, "temperature": 0}),
          (COMPLETIONS, {"prompt": "The capital of Japan is", "max_tokens": 12,
                         "temperature": 0}),
          (COMPLETIONS, {"prompt": "The capital of Japan is", "max_tokens": 12,
                         "temperature": 5e-324}),   # too small to differ from greedy
          (COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 12, "top_k": 1,
                         "temperature": 1.5, "stream": True})]

SURROGATES = ["\ud800", "a\udfffb", "\udbff\udc00\udc00", "\ud83d"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(SURROGATES + ["", " " * 64, "😀", "<|im_end|>", 10 ** 40, -1, 0, 1e-320,
                                  -0.0, 2.0000001, 1e308]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
# never None or absent: without max_tokens a request runs to the context's end
max_tokens_values = st.one_of(st.integers(1, 6), st.sampled_from(
    [0, -1, 4097, 10 ** 6, 10 ** 30, "5", 2.5, 3.0, True, [], {}, -(2 ** 70)]))
texts = st.one_of(st.text(max_size=60), st.sampled_from(
    SURROGATES + ["", "Hello world!", "Paris " * 300, "<|im_start|>user\n<|im_end|>"]))
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool",
                                                    "developer"]), "content": texts}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "robot", ""]),
                           "content": st.one_of(json_values, st.lists(st.one_of(
                               st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                               json_values), max_size=3))}),
    json_values), min_size=0, max_size=6)
FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "n", "logprobs", "top_logprobs", "cache_salt", "user", "response_format", "tools",
          "logit_bias", "presence_penalty", "frequency_penalty", "echo", "suffix", "best_of",
          "unknown_field"]


@st.composite
def json_requests(draw):
    """A valid request of either route, then up to four fields replaced."""
    route = draw(st.sampled_from([CHAT, COMPLETIONS]))
    if route == CHAT:
        body = {"messages": [{"role": "user", "content": draw(texts)}]}
    else:
        body = {"prompt": draw(st.one_of(texts, st.lists(st.integers(0, 400), min_size=1,
                                                         max_size=20)))}
    body["max_tokens"] = draw(st.integers(1, 6))
    body["temperature"] = 0
    for _ in range(draw(st.integers(0, 4))):
        field = draw(st.sampled_from(FIELDS + ["max_tokens", "max_completion_tokens",
                                               "messages", "prompt"]))
        if field in ("max_tokens", "max_completion_tokens"):
            body[field] = draw(max_tokens_values)
        elif field == "messages":
            body[field] = draw(st.one_of(messages, json_values))
        elif field == "prompt":
            body[field] = draw(st.one_of(texts, json_values, st.lists(st.integers(-5, 10 ** 12),
                                                                      max_size=5)))
        else:
            body[field] = draw(json_values)
    return ("json", route, body)


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"{bad", b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"null", b"[]",
                     b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 2}',
                     b'{"prompt": "a", "max_tokens": 1e999}', b'{"prompt": "a", "max_tokens": '
                     + b"9" * 5000 + b"}", b'{"prompt": "x", "prompt": 5, "max_tokens": 2}']),
    st.integers(1_000, 200_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1_000, 60_000).map(
        lambda depth: b'{"messages": [{"role": "user", "content": ' + b"[" * depth
        + b"]" * depth + b'}], "max_tokens": 2}'))


@st.composite
def raw_requests(draw):
    route = draw(st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/nope"]))
    ctype = draw(st.sampled_from(["application/json", "text/plain", "application/json; "
                                  "charset=latin-1"]))
    return ("raw", route, draw(raw_bodies), ctype)


@st.composite
def sized_requests(draw):
    """A valid body padded with whitespace to about the size cap."""
    size = draw(st.integers(MAX_BODY - 64, MAX_BODY + 64))
    text = json.dumps({"prompt": "Hello world", "max_tokens": 2, "temperature": 0})
    return ("raw", COMPLETIONS, (text + " " * max(0, size - len(text))).encode(),
            "application/json")


other_routes = st.tuples(st.just("route"), st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
                         st.sampled_from([CHAT, "/v1/models", "/health", "/metrics", "/",
                                          "/v1/%ED%A0%80", "/v1/models/../health"]))
disconnects = st.tuples(st.just("leave"), st.sampled_from(
    ["mid-upload", "mid-stream", "waiting", "silent"]), st.integers(50, 300))
cases = st.one_of(json_requests(), json_requests(), json_requests(), raw_requests(),
                  sized_requests(), other_routes, disconnects)


# --------------------------------------------------------------- the server
class Run:
    """The server under fuzz and what the run saw."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.base, timeout=120, trust_env=False)
        self.num_requests = 0
        self.statuses: collections.Counter = collections.Counter()
        self.greedy: dict[str, str] = {}
        self.num_repeats = 0
        self.kinds: collections.Counter = collections.Counter()
        self.before: list[str] = []
        self.started = time.monotonic()

    def send(self, method: str, route: str, content: bytes | None = None,
             ctype: str = "application/json") -> httpx.Response:
        self.num_requests += 1
        headers = {"Content-Type": ctype} if content is not None else {}
        req = self.http.build_request(method, route, content=content, headers=headers)
        resp = self.http.send(req, stream=True)
        try:
            resp.read()
        finally:
            resp.close()
        self.statuses[resp.status_code] += 1
        return resp

    def raw(self, data: bytes, then: str = "close") -> bytes:
        """Send ``data`` on a new connection; ``then`` "close" at once, or
        "read" the answer's head and its first event, then close."""
        self.num_requests += 1
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=60) as sock:
            if data:
                sock.sendall(data)
            got = b""
            while then == "read" and b"data: " not in got:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
            return got


def head(route: str, length: int, method: str = "POST") -> bytes:
    return (f"{method} {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {length}\r\n\r\n").encode()


def check_response(run: Run, resp: httpx.Response, body: object | None) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    ctype = resp.headers.get("content-type", "")
    if resp.status_code >= 400 and ctype.startswith("application/json"):
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "code", "param"} and err["message"], err
    if resp.status_code != 200 or not isinstance(body, dict):
        return
    answer = answer_of(resp)
    if body.get("temperature") == 0 and "seed" not in body:
        key = json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)
        if key in run.greedy:
            assert run.greedy[key] == answer, (key, run.greedy[key], answer)
            run.num_repeats += 1
        run.greedy[key] = answer


def answer_of(resp: httpx.Response) -> str:
    """The text of a 200 answer, whole or streamed (a stream must end with
    ``[DONE]``, or with an error that is not the server's)."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        choice = resp.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    events = [x for x in resp.text.split("\n\n") if x]
    assert events[-1] == "data: [DONE]" or "error" in events[-1], events[-3:]
    text = []
    for line in events:
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event or event["error"]["type"] != "server_error", event
        for choice in event.get("choices", ()):
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def probe_answers(run: Run) -> list[str]:
    out = []
    for route, body in PROBES:
        resp = run.send("POST", route, json.dumps(body).encode())
        assert resp.status_code == 200, resp.text
        out.append(answer_of(resp))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny-chat"
    build_folder(folder)
    s = Server(str(folder), "--num-pages", "512", "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "4", "--max-queue", "64", "--max-body-size", str(MAX_BODY),
               "--header-timeout", "2", "--body-timeout", "2")
    r = Run(s)
    r.before = probe_answers(r)
    assert r.before[1] == r.before[2]   # a 5e-324 temperature is greedy
    r.started = time.monotonic()
    yield r
    r.http.close()
    if s.proc.poll() is None:
        s.stop()


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=cases)
def test_fuzz_requests(run, case):
    kind = case[0]
    run.kinds[kind if kind != "leave" else f"leave {case[1]}"] += 1
    if kind == "json":
        _, route, body = case
        try:
            content = json.dumps(body).encode()
        except (ValueError, OverflowError):
            return
        check_response(run, run.send("POST", route, content), body)
    elif kind == "raw":
        _, route, content, ctype = case
        check_response(run, run.send("POST", route, content, ctype), None)
    elif kind == "route":
        _, method, route = case
        check_response(run, run.send(method, route), None)
    else:
        _, how, max_tokens = case
        body = json.dumps({"prompt": "Hello world! I am fine", "max_tokens": max_tokens,
                           "temperature": 0, "stream": how == "mid-stream"}).encode()
        if how == "mid-upload":
            run.raw(head(COMPLETIONS, len(body)) + body[: len(body) // 2])
        elif how == "mid-stream":
            got = run.raw(head(COMPLETIONS, len(body)) + body, then="read")
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
        elif how == "waiting":
            run.raw(head(COMPLETIONS, len(body)) + body)
        else:
            run.raw(b"")


def test_after_the_fuzz_the_server_is_whole(run):
    s = run.server
    elapsed = time.monotonic() - run.started
    assert run.http.get("/health").status_code == 200
    # every page back, nothing queued or running (cancellations take a step)
    for _ in range(400):
        used = s.metric("pagedkv_pages_used")
        if used == 0 and s.metric("pagedkv_running_requests") == 0:
            break
        time.sleep(0.05)
    assert s.metric("pagedkv_pages_used") == 0
    assert s.metric("pagedkv_queue_length") == 0
    assert s.metric("pagedkv_running_requests") == 0
    assert s.metric("pagedkv_pages_free") + s.metric("pagedkv_pages_evictable") == 512
    text = run.http.get("/metrics").text
    server_errors = re.findall(r'^pagedkv_http_requests_total\{.*status="5\d\d".*\} (\S+)$',
                               text, flags=re.M)
    assert sum(float(x) for x in server_errors) == 0, server_errors
    assert probe_answers(run) == run.before
    print(f"\nfuzz: {run.num_requests} requests in {elapsed:.0f} s, statuses "
          f"{dict(sorted(run.statuses.items()))}, 5xx: 0, pages used after: 0; cases "
          f"{dict(sorted(run.kinds.items()))}; {run.num_repeats} repeated greedy requests "
          "answered identically")
    assert run.num_requests <= 2 * MAX_EXAMPLES + 2 * len(PROBES) + 10
    assert s.stop() == 0
    assert "Traceback" not in s.output and "Exception in ASGI" not in s.output, s.output[-3000:]
