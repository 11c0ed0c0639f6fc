"""``pagedkv serve``'s generation options (penalties, ``min_p``, ``logit_bias``,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``): one real server in a
subprocess, driven by the official ``openai`` client, each answer compared
with the same request run alone through an in-process ``OrtDecoder``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import json  # noqa: E402

from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from test_serve import MODEL, NUM_PAGES, PAGE_SIZE, Server, assert_error, build_folder  # noqa: E402

PROMPT = "The capital of France is"
NEW = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_sampling") / MODEL
    build_folder(path)
    return path


@pytest.fixture(scope="module")
def dec(folder) -> OrtDecoder:
    return OrtDecoder.from_pretrained(str(folder), num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                      max_batch_size=4)


@pytest.fixture(scope="module")
def server(folder):
    s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "4", "--max-queue", "64")
    yield s
    assert s.stop() == 0


def in_process(dec: OrtDecoder, **options) -> tuple[str, list[int]]:
    """(text, tokens) of the greedy request run alone in-process."""
    tokens = dec.generate([dec.text.encode(PROMPT)], max_new_tokens=NEW, **options)[0]
    return dec.text.decode(tokens), list(tokens)


def test_options_change_greedy_output_as_in_process(server, dec):
    plain, plain_tokens = in_process(dec)
    cases = [
        (dict(presence_penalty=1.5, frequency_penalty=2.0), {}),
        (dict(logit_bias={str(plain_tokens[0]): -100, "7": 5.0}), {}),
        ({}, dict(repetition_penalty=1.8, min_p=0.05)),
        ({}, dict(stop_token_ids=[plain_tokens[3]])),
        ({}, dict(ignore_eos=True, min_tokens=NEW)),
    ]
    client = server.client()
    changed = 0
    for openai_fields, extra in cases:
        options = dict(openai_fields, **extra)
        if "logit_bias" in options:
            options["logit_bias"] = {int(k): float(v) for k, v in options["logit_bias"].items()}
        want, _ = in_process(dec, **options)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                         temperature=0, extra_body=extra, **openai_fields)
        assert got.choices[0].text == want, options
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
            temperature=0, extra_body=extra, **openai_fields)
        assert chat.choices[0].message.content is not None
        changed += want != plain
    # penalties, biases and stop ids do move this model's greedy answer
    assert changed >= 3


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0), ("repetition_penalty", True), ("min_p", 1.5), ("min_p", -0.1),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1": 101}), ("logit_bias", {"1": "a"}), ("logit_bias", {"99999": 1}),
    ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("stop_token_ids", 5), ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [99999]), ("ignore_eos", 1), ("min_tokens", -1),
    ("min_tokens", 1.5), ("min_tokens", 100), ("seed", -1), ("seed", "x"),
])
def test_bad_values_are_400_naming_the_field(server, field, value):
    with server.http() as http:
        for route, body in (("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]})):
            body = dict(body, max_tokens=8, **{field: value})
            assert_error(http.post(route, json=body), 400, param=field)


def engine_logprobs(dec: OrtDecoder, ids, k: int, max_tokens: int = NEW) -> tuple[list, list]:
    """(tokens, TokenLogprob entries) of a greedy request run alone in-process."""
    rid = dec.add_request(ids, max_tokens, logprobs=k)
    while dec.has_unfinished_requests():
        dec.step()
    entries = dec.get_logprobs(rid)
    return list(dec.pop_output(rid)), entries


def piece(dec: OrtDecoder, token_id: int) -> str:
    return dec.text.decode([token_id], skip_special_tokens=False)


def test_chat_logprobs_equal_the_engines(server, dec):
    messages = [{"role": "user", "content": "Hello world"}]
    tokens, entries = engine_logprobs(dec, dec.text.encode_chat(messages), 3)
    client = server.client()
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in entries]
    assert [c.token for c in content] == [piece(dec, t) for t in tokens]
    for c, e in zip(content, entries):
        assert c.bytes == list(c.token.encode("utf-8"))
        assert [(a.token, a.logprob) for a in c.top_logprobs] == \
            [(piece(dec, t), lp) for t, lp in e.top]
        assert len(c.top_logprobs) == 3
    # streamed: each chunk carries its own tokens' entries, together the same
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True)
    chunks = [c for c in stream if c.choices and c.choices[0].logprobs is not None]
    streamed = [x for c in chunks for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    # logprobs false: none
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_legacy_shape(server, dec):
    tokens, entries = engine_logprobs(dec, dec.text.encode(PROMPT), 2)
    client = server.client()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in entries]
    assert lp.tokens == [piece(dec, t) for t in tokens]
    assert lp.top_logprobs == [{piece(dec, t): v for t, v in e.top} for e in entries]
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(tokens))]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                       temperature=0, logprobs=2, stream=True)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
    assert [x for p in parts for x in p.text_offset] == lp.text_offset


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
])
def test_bad_logprobs_are_400(server, route, body, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route
            else {"prompt": PROMPT})
    with server.http() as http:
        assert_error(http.post(route, json=dict(base, max_tokens=4, **body)), 400, param=param)


def engine_parallel(dec: OrtDecoder, ids, n: int, seed: int, **options) -> list[str]:
    rids = dec.add_parallel_requests(ids, n, NEW, seed=seed, **options)
    while dec.has_unfinished_requests():
        dec.step()
    return [dec.text.decode(dec.pop_output(rid)) for rid in rids]


def test_n_choices_equal_the_engines_parallel_continuations(server, dec):
    client = server.client()
    messages = [{"role": "user", "content": "Hello world"}]
    want = engine_parallel(dec, dec.text.encode_chat(messages), 4, 7, temperature=2.0)
    assert len(set(want)) > 1   # sampled: the choices differ
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                         temperature=2, seed=7, n=4)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in got.choices] == want
    assert got.usage.completion_tokens >= 4
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                            temperature=2, seed=7, n=4, stream=True,
                                            stream_options={"include_usage": True})
    texts = [""] * 4
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == got.usage.completion_tokens
    assert texts == want and finished == {0, 1, 2, 3}
    want = engine_parallel(dec, dec.text.encode(PROMPT), 3, 11, temperature=2.0)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                    temperature=2, seed=11, n=3)
    assert [c.text for c in got.choices] == want
    assert [c.index for c in got.choices] == [0, 1, 2]


@pytest.mark.parametrize("n", [0, -1, 5, "2", 1.5])
def test_bad_n_is_400(server, n):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "n": n}), 400,
                     param="n")


ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 50},
        "extras": {"type": "array", "maxItems": 3,
                   "items": {"type": "object",
                             "properties": {"kind": {"enum": ["milk", "sugar"]},
                                            "double": {"type": "boolean"}},
                             "required": ["kind", "double"], "additionalProperties": False}},
        "ship": {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 8},
                                "days": {"type": "array", "minItems": 1, "maxItems": 2,
                                         "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}},
                 "required": ["city", "days"], "additionalProperties": False},
    },
    "required": ["item", "size", "count", "extras", "ship"],
    "additionalProperties": False,
}


def valid(value, schema) -> bool:
    """The subset of JSON Schema ORDER uses: type, enum, bounds, lengths,
    properties, required, additionalProperties, items."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and all(k in value for k in schema["required"])
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value)
                <= schema.get("maxItems", len(value))
                and all(valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"the validator does not know {kind}")


def test_response_format_json_schema_and_json_object(server, dec):
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    assert not valid({"item": "x"}, ORDER)   # the validator refuses what it should
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER,
                                                  "strict": True}}
    answers = []
    for i in range(18):                 # with the n=2 below: 20 answers, 2 greedy
        sampling = {"temperature": 0} if i < 2 else {"temperature": 1, "seed": i}
        got = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Order number {i}"}],
            max_tokens=300, response_format=fmt, **sampling)
        answers.append(got.choices[0].message.content)
        assert got.choices[0].finish_reason == "stop", answers[-1]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, n=2,
                                    temperature=1, seed=3, extra_body={"response_format": fmt})
    answers += [c.text for c in got.choices]
    for text in answers:
        assert valid(json.loads(text), ORDER), text
    # a plain request beside them is unchanged
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                     temperature=0).choices[0].text == in_process(dec)[0]
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=300,
        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt", [
    "json", {"type": "xml"}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": ORDER}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes", "schema": ORDER}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "no-such-type"}}},
])
def test_bad_response_format_is_400(server, fmt):
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    with server.http() as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        assert_error(http.post("/v1/chat/completions", json=body), 400, param="response_format")
