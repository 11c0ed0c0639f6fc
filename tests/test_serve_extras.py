"""``pagedkv serve``'s further request features: ``--chat-template``,
completions' ``echo``, ``best_of`` and ``suffix`` (fill-in-the-middle),
logprobs of an answer cut by a stop string, and ``/tokenize`` with
``messages`` and ``tools``: real servers in subprocesses, driven by the
official ``openai`` client, each answer compared with the same request run
alone through an in-process ``OrtDecoder``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

from pagedkv_np.models.testmodel import DecoderConfig, build_model, save_model  # noqa: E402
from pagedkv_np.errors import ConfigError  # noqa: E402
from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.serve.chat_template import (describe_template, read_chat_template,  # noqa: E402
                                            use_chat_template)
from pagedkv_np.serve.infill import gguf_fim_token_ids  # noqa: E402
from test_serve import (CONTEXT, MODEL, NUM_PAGES, PAGE_SIZE, ROOT, Server,  # noqa: E402
                        assert_error, build_folder)
from test_serve_sampling import engine_logprobs, piece  # noqa: E402
from test_serve_tools import ASK, HERMES, TOOLS, check_call, render  # noqa: E402

PROMPT = "The capital of France is"
NEW = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_extras") / MODEL
    build_folder(path)
    return path


@pytest.fixture(scope="module")
def dec(folder) -> OrtDecoder:
    return OrtDecoder.from_pretrained(str(folder), num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                      max_batch_size=4)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_extras_template") / "hermes.jinja"
    path.write_text(HERMES, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(folder, template_file):
    """The plain ChatML folder served with a Hermes-style template file (for
    a user's messages without tools it renders as ChatML does)."""
    s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "4", "--max-queue", "64", "--chat-template",
               str(template_file), log_level="info")
    yield s
    assert s.stop() == 0
    summary = [line for line in s.output.splitlines() if "serving tiny" in line]
    assert len(summary) == 1 and f"chat template {template_file} |" in summary[0], s.output


# ----------------------------------------------------------------- --chat-template
def test_chat_template_file_gives_plain_chatml_model_tools(server):
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    client = server.client()
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=200,
                                         temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    check_call(calls[0].function.name, calls[0].function.arguments)
    # the prompt is the template file's rendering of the messages and tools
    want = len(server_tokens(server, render(ASK, TOOLS)))
    assert got.usage.prompt_tokens == want


def server_tokens(server: Server, text: str) -> list[int]:
    with server.http() as http:
        return http.post("/tokenize", json={"content": text}).json()["tokens"]


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("missing.jinja", "no such file"),
])
def test_bad_chat_template_stops_the_server_naming_it(folder, tmp_path, template, message):
    if template.endswith(".jinja"):
        value = str(tmp_path / template)
    else:
        (tmp_path / "bad.jinja").write_text(template, encoding="utf-8")
        value = str(tmp_path / "bad.jinja")
    done = subprocess.run([sys.executable, "-m", "pagedkv_np", "serve", str(folder),
                           "--num-pages", "16", "--chat-template", value],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert f"--chat-template {value}" in line and message in line, done.stderr


def test_read_chat_template_file_inline_or_refused(tmp_path, folder):
    path = tmp_path / "t.jinja"
    path.write_text(HERMES, encoding="utf-8")
    assert read_chat_template(str(path)) == HERMES
    assert describe_template(str(path)) == str(path)
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert read_chat_template(inline) == inline and describe_template(inline) == "inline"
    assert describe_template(None) == "the model's"
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "big.jinja").write_text("{{ x }}" + " " * (1 << 20))
    for value, message in ((str(tmp_path / "nope.jinja"), "no such file"),
                           (str(tmp_path / "latin1.jinja"), "not UTF-8"),
                           (str(tmp_path / "empty.jinja"), "empty"),
                           (str(tmp_path / "big.jinja"), "more than")):
        with pytest.raises(ConfigError, match=message) as info:
            read_chat_template(value)
        assert value in str(info.value)
    # compiled when it is put in place; a failure leaves the model's template
    fresh = OrtDecoder.from_pretrained(str(folder), num_pages=16, page_size=PAGE_SIZE)
    own = fresh.text.template_source()
    with pytest.raises(ConfigError, match="--chat-template bad.jinja: .*does not compile"):
        use_chat_template(fresh, "{% if %}", "bad.jinja")
    assert fresh.text.template_source() == own
    use_chat_template(fresh, inline, "inline")
    assert fresh.text.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert fresh.text.encode("hi").tolist() == OrtDecoder.from_pretrained(
        str(folder), num_pages=16, page_size=PAGE_SIZE).text.encode("hi").tolist()


# --------------------------------------------------------------------- /tokenize
def test_tokenize_messages_with_tools_renders_as_chat(server, dec):
    with server.http() as http:
        got = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
        assert got["tokens"] == [int(t) for t in dec.text.encode(render(ASK, TOOLS),
                                                                 add_special_tokens=False)]
        assert got["count"] == len(got["tokens"])
        bare = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS,
                                            "add_generation_prompt": False}).json()
        tail = dec.text.encode("<|im_start|>assistant\n", add_special_tokens=False)
        assert bare["tokens"] + [int(t) for t in tail] == got["tokens"]
        assert_error(http.post("/tokenize", json={"messages": ASK, "tools": [{"type": "x"}]}),
                     400, param="tools[0].type")
        assert_error(http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": 1}),
                     400, param="add_generation_prompt")


@pytest.mark.parametrize("messages, param", [
    ("hello", "messages"), ([], "messages"), ([5], "messages[0]"),
    ([{"content": "hi"}], "messages[0].role"), ([{"role": "user"}], "messages[0].content"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]"),
])
def test_tokenize_refuses_malformed_messages_by_name(server, messages, param):
    """/tokenize reads ``messages`` as chat does: each malformed shape is a 400
    naming the field, and the server answers the next request as before."""
    with server.http() as http:
        assert_error(http.post("/tokenize", json={"messages": messages}), 400, param=param)
        good = http.post("/tokenize", json={"messages": ASK})
        assert good.status_code == 200 and good.json()["count"] > 0


# ------------------------------------------------- logprobs cut by a stop string
def starts(dec: OrtDecoder, tokens: list[int]) -> list[int]:
    """Where each token's text begins in the decode of ``tokens`` (a token
    that ends inside a character decodes to U+FFFD there, which is not
    counted: the character begins where its first byte's token does)."""
    return [len(dec.text.decode(tokens[:i]).rstrip("\ufffd")) for i in range(len(tokens))]


def stop_case(dec: OrtDecoder) -> tuple[str, str, list[int], list]:
    """(stop string, the text before it, the tokens whose text begins before
    it, their engine entries) of the greedy answer to PROMPT."""
    tokens, entries = engine_logprobs(dec, dec.text.encode(PROMPT), 2, NEW)
    full = dec.text.decode(tokens)
    # a stop string that starts in the middle of the answer, on a token's
    # second character or later when there is one
    begin = starts(dec, tokens)
    at = next((s + 1 for s, e in zip(begin[len(begin) // 2:], begin[len(begin) // 2 + 1:])
               if e - s >= 2), begin[len(begin) // 2])
    stop = full[at:at + 2]
    cut = full.find(stop)
    kept = [i for i, s in enumerate(begin) if s < cut]
    return stop, full[:cut], [tokens[i] for i in kept], [entries[i] for i in kept]


def test_logprobs_cover_the_text_before_a_stop_string(server, dec):
    stop, text, tokens, entries = stop_case(dec)
    assert 0 < len(tokens) < NEW - 1     # the stop cut tokens off
    client = server.client()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                    temperature=0, logprobs=2, stop=[stop])
    choice = got.choices[0]
    assert choice.text == text and choice.finish_reason == "stop"
    assert choice.logprobs.tokens == [piece(dec, t) for t in tokens]
    assert choice.logprobs.token_logprobs == [e.logprob for e in entries]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                       temperature=0, logprobs=2, stop=[stop], stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == text
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for p in parts for t in p.tokens] == choice.logprobs.tokens
    assert [x for p in parts for x in p.token_logprobs] == choice.logprobs.token_logprobs
    # chat: the same rule
    messages = [{"role": "user", "content": "Hello world"}]
    tokens, entries = engine_logprobs(dec, dec.text.encode_chat(messages), 1, NEW)
    full = dec.text.decode(tokens)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = full.find(stop)
    want = [piece(dec, t) for t, s in zip(tokens, starts(dec, tokens)) if s < cut]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW,
                                         temperature=0, logprobs=True, top_logprobs=1,
                                         stop=[stop])
    assert got.choices[0].message.content == full[:cut]
    assert [c.token for c in got.choices[0].logprobs.content] == want


# -------------------------------------------------------------------------- echo
def greedy(dec: OrtDecoder, ids, max_tokens: int = NEW) -> str:
    return dec.text.decode(dec.generate([ids], max_new_tokens=max_tokens)[0])


def test_echo_puts_the_prompt_before_the_completion(server, dec):
    ids = dec.text.encode(PROMPT)
    answer = greedy(dec, ids)
    client = server.client()
    # a stop string in the prompt does not cut the echo
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    echo=True, stop=["capital"])
    assert got.choices[0].text == PROMPT + answer.split("capital")[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                       temperature=0, echo=True, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(PROMPT) and "".join(chunks) == PROMPT + answer
    # token ids: their text; every choice of n carries it
    got = client.completions.create(model=MODEL, prompt=[int(t) for t in ids], max_tokens=NEW,
                                    temperature=0, echo=True, n=2)
    assert [c.text for c in got.choices] == [dec.text.decode(ids) + answer] * 2
    assert got.usage.completion_tokens == 2 * NEW or got.choices[0].finish_reason == "stop"


def test_echo_refusals_name_the_fields(server):
    with server.http() as http:
        err = assert_error(http.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1}), 400, param="echo")
        assert "logprobs" in err["message"]
        assert_error(http.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 4, "echo": True}), 400, param="echo")
        assert_error(http.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "echo": "yes"}), 400, param="echo")


# ----------------------------------------------------------------------- best_of
def engine_best_of(dec: OrtDecoder, ids, best_of: int, n: int | None, seed: int,
                   logprobs: int = 0) -> list[tuple[str, list[float]]]:
    """(text, token logprobs) of the n of best_of parallel continuations with
    the highest sum of token logprobs, best first, run in-process (n None:
    every candidate, in the engine's order)."""
    rids = dec.add_parallel_requests(ids, best_of, NEW, seed=seed, temperature=2.0,
                                     logprobs=logprobs)
    while dec.has_unfinished_requests():
        dec.step()
    out = []
    for rid in rids:
        entries = dec.get_logprobs(rid)
        out.append((dec.text.decode(dec.pop_output(rid)), [e.logprob for e in entries]))
    return out if n is None else sorted(out, key=lambda c: -sum(c[1]))[:n]


def test_best_of_returns_the_n_most_likely_candidates(server, dec):
    ids = dec.text.encode(PROMPT)
    want = engine_best_of(dec, ids, 4, 2, seed=7)
    everything = engine_best_of(dec, ids, 4, None, seed=7)
    assert len({text for text, _ in everything}) == 4   # sampled: the candidates differ
    assert want != everything[:2]   # the ranking matters here
    client = server.client()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=2,
                                    seed=7, n=2, best_of=4)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [text for text, _ in want]
    assert all(c.logprobs is None for c in got.choices)   # not asked for
    # every candidate's tokens are billed
    assert got.usage.completion_tokens == sum(len(lp) for _, lp in everything)
    # with logprobs: the chosen candidates' own
    want = engine_best_of(dec, ids, 3, 1, seed=11, logprobs=1)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=2,
                                    seed=11, best_of=3, logprobs=1)
    assert got.choices[0].text == want[0][0]
    assert got.choices[0].logprobs.token_logprobs == want[0][1]


@pytest.mark.parametrize("extra", [
    {"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}, {"best_of": 5}, {"best_of": 0},
    {"best_of": "2"},
])
def test_bad_best_of_is_400(server, extra):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=4,
                                                            **extra)), 400, param="best_of")
        assert_error(http.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 4, "best_of": 2}), 400, param="best_of")


# -------------------------------------------------------- suffix (fill-in-the-middle)
FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]


@pytest.fixture(scope="module")
def fim_folder(tmp_path_factory):
    """The test folder with StarCoder's three infilling tokens added to its
    vocabulary (and a decoder whose vocabulary covers them)."""
    path = tmp_path_factory.mktemp("serve_fim") / MODEL
    build_folder(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(FIM)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    save_model(build_model(DecoderConfig(vocab_size=vocab, max_positions=CONTEXT)),
               str(path / "model.onnx"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, vocab_size=vocab)))
    return path


@pytest.fixture(scope="module")
def fim_server(fim_folder):
    s = Server(str(fim_folder), "--num-pages", "64", "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "2", "--max-queue", "8")
    yield s
    assert s.stop() == 0


def test_suffix_builds_the_prefix_suffix_middle_prompt(fim_server, fim_folder):
    fim_dec = OrtDecoder.from_pretrained(str(fim_folder), num_pages=64, page_size=PAGE_SIZE)
    tok = fim_dec.text.tokenizer
    pre, suf, mid = (tok.token_to_id(name) for name in FIM)
    suffix = " is the capital."
    by_hand = ([pre] + [int(t) for t in fim_dec.text.encode("Paris", add_special_tokens=False)]
               + [suf] + [int(t) for t in fim_dec.text.encode(suffix, add_special_tokens=False)]
               + [mid])
    want = fim_dec.generate([by_hand], max_new_tokens=8)[0]
    client = fim_server.client()
    got = client.completions.create(model=MODEL, prompt="Paris", suffix=suffix, max_tokens=8,
                                    temperature=0)
    assert got.usage.prompt_tokens == len(by_hand)
    assert got.choices[0].text == fim_dec.text.decode(want)
    # a prompt of token ids is the prefix as given
    ids = [int(t) for t in fim_dec.text.encode("Paris", add_special_tokens=False)]
    again = client.completions.create(model=MODEL, prompt=ids, suffix=suffix, max_tokens=8,
                                      temperature=0)
    assert again.choices[0].text == got.choices[0].text
    # no suffix: a plain prompt
    plain = client.completions.create(model=MODEL, prompt="Paris", max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens == len(ids)
    with fim_server.http() as http:
        assert_error(http.post("/v1/completions", json={"prompt": "x", "suffix": 3}), 400,
                     param="suffix")
        assert_error(http.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 4, "suffix": "x"}), 400, param="suffix")


def test_suffix_without_fim_tokens_is_400(server):
    with server.http() as http:
        err = assert_error(http.post("/v1/completions", json={
            "prompt": PROMPT, "suffix": "end", "max_tokens": 4}), 400, param="suffix",
            code="unsupported_parameter")
        assert "fim_prefix" in err["message"]


def test_suffix_uses_a_gguf_files_fim_token_ids(tmp_path, monkeypatch):
    """A GGUF file's tokenizer.ggml.fim_*_token_id name the infilling tokens,
    whatever they are called (here three tokens not named fim at all)."""
    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from pagedkv_np.models.gguf.importer import import_gguf
    from test_gguf_import import vocab, write_gguf

    plain, path = tmp_path / "plain.gguf", tmp_path / "tiny.gguf"
    write_gguf(plain)
    assert gguf_fim_token_ids(str(plain)) is None
    tokens, _ = vocab()
    fim = [tokens.index(name) for name in ("<|im_start|>", "<|im_end|>", "<tool>")]
    keys = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.fim_mid_token_id")
    copy_with_new_metadata(
        gguf.GGUFReader(str(plain)), gguf.GGUFWriter(str(path), "llama"),
        {k: MetadataDetails(gguf.GGUFValueType.UINT32, i) for k, i in zip(keys, fim)}, [])
    assert gguf_fim_token_ids(str(path)) == tuple(fim)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    tiny = OrtDecoder.from_pretrained(import_gguf(str(path)), num_pages=16, page_size=PAGE_SIZE)
    by_hand = ([fim[0]] + [int(t) for t in tiny.text.encode("hello", add_special_tokens=False)]
               + [fim[1]] + [int(t) for t in tiny.text.encode(" world", add_special_tokens=False)]
               + [fim[2]])
    want = tiny.text.decode(tiny.generate([by_hand], max_new_tokens=4)[0])
    server = Server(str(path), "--num-pages", "16", "--page-size", str(PAGE_SIZE))
    try:
        got = server.client().completions.create(model="tiny", prompt="hello", suffix=" world",
                                                 max_tokens=4, temperature=0)
    finally:
        assert server.stop() == 0
    assert got.usage.prompt_tokens == len(by_hand)
    assert got.choices[0].text == want
