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
                                      max_batch_size=1)


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
