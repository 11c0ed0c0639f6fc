"""Tool calls in ``pagedkv serve`` (``tools``, ``tool_choice``,
``parallel_tool_calls``): the call parser on hand-written model outputs in
both formats, and a real server in a subprocess, driven by the official
``openai`` client, serving a small model folder whose chat template takes
tools (Hermes style, written here) beside one whose template does not.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import jinja2.sandbox  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from pagedkv_np.serve.api_error import APIError  # noqa: E402
from pagedkv_np.serve.tool_calls import ToolCall, ToolStream, detect_format, parse_calls  # noqa: E402
from pagedkv_np.serve.tools import call_grammar, message_fields, parse_tools  # noqa: E402
from test_serve import MODEL, NUM_PAGES, PAGE_SIZE, Server, assert_error, build_folder  # noqa: E402
from test_serve_sampling import valid  # noqa: E402

# A Hermes-style template: the tools in a system turn, earlier calls as
# <tool_call> blocks, tool results as <tool_response> user turns.
HERMES = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": NAME, \"arguments\": ARGS}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' and message.tool_calls is defined %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response id=\"{{ message.tool_call_id }}\">\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ----------------------------------------------------------------- the parser
@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None,
     [ToolCall("f", '{"x": 1}')]),
    ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"q": "é"}}\n</tool_call>\n'
     '<tool_call>{"name":"g","arguments":"{\\"y\\": [1,2]}"}</tool_call>', "Let me look.",
     [ToolCall("f", '{"q": "é"}'), ToolCall("g", '{"y": [1, 2]}')]),
    # the closing tag may be missing at the very end
    ('<tool_call>\n{"name": "f", "arguments": {}}', None, [ToolCall("f", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', None, []),   # malformed
    ('<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>', None, []),               # no name
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', None, []),       # not an object
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and more', None, []),
    ("Just text, no call.", None, []),
])
def test_parse_hermes(text, content, calls):
    got_content, got_calls = parse_calls(text, "hermes")
    assert got_calls == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"x": 1}}', [ToolCall("f", '{"x": 1}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}', [ToolCall("f", '{"a": "b"}')]),
    (' {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"z": null}}\n',
     [ToolCall("f", "{}"), ToolCall("g", '{"z": null}')]),
    ('{"name": "f", "parameters": {"x": 1}', []),                      # malformed
    ('{"name": "f"}', []),                                             # no parameters
    ('{"city": "Paris"}', []),                                         # plain JSON answer
    ('The answer is {"name": "f", "parameters": {}}', []),
])
def test_parse_llama3_json(text, calls):
    content, got = parse_calls(text, "llama3_json")
    assert got == calls
    assert content == (None if calls else text)


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Sure <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
    ("hermes", "a < b, and <tool or <tool_ca are not calls <tool_call"),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'),
    ("llama3_json", ' {"name": "f", "parameters": {"x": [1, 2]}}'),
    ("llama3_json", "<|python"),
    ("llama3_json", "Hello {there}"),
])
def test_tool_stream_matches_whole_parse(fmt, text):
    """Fed a character at a time, a stream gives out the same text and calls
    as the whole answer's parse, and loses nothing when there is no call."""
    for step in (1, 3, len(text)):
        stream = ToolStream(fmt)
        out = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
        rest, calls = stream.finish()
        whole_content, whole_calls = parse_calls(text, fmt)
        assert calls == whole_calls
        if calls:
            assert out.strip() == (whole_content or "")
        else:
            assert out + rest == text


def test_deep_json_is_no_call_and_a_400():
    """JSON nested past Python's recursion limit is plain text in an answer,
    and a 400 naming the field in a history's call."""
    deep = "[" * 100_000
    assert parse_calls("<tool_call>" + deep, "hermes") == ("<tool_call>" + deep, [])
    assert parse_calls('{"name": "f", "parameters": ' + deep, "llama3_json")[1] == []
    with pytest.raises(APIError) as info:
        message_fields("messages[1]", "assistant", {"tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": deep}}]})
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


def test_detect_format():
    assert detect_format(HERMES) == "hermes"
    llama = ("{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
             "{{- tool_call.arguments | tojson }}")
    assert detect_format(llama) == "llama3_json"
    assert detect_format("{% for t in tools %}{{ t.name }}{% endfor %}") == "hermes"


def test_call_grammar_llama3_is_a_schema():
    req = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "add"}}})
    from dataclasses import replace
    kind, schema = call_grammar(replace(req, format="llama3_json"))
    assert kind == "json_schema"
    assert schema["properties"] == {"name": {"const": "add"}, "parameters": ADD}


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [1]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_parse_tools_refuses(body, param):
    with pytest.raises(APIError) as info:
        parse_tools(body)
    assert info.value.status == 400 and info.value.param == param


# ------------------------------------------------------------------ the server
def hermes_folder(path):
    build_folder(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hermes_folder(tmp_path_factory.mktemp("serve_tools") / MODEL)


@pytest.fixture(scope="module")
def server(folder):
    s = Server(str(folder), "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "4", "--max-queue", "64")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_tools_plain") / MODEL
    build_folder(path)
    s = Server(str(path), "--num-pages", "64", "--page-size", str(PAGE_SIZE),
               "--max-batch-size", "2", "--max-queue", "8")
    yield s
    assert s.stop() == 0


def streamed_calls(stream) -> tuple[str, list[dict], str]:
    """(content, calls as {name, arguments, id}, finish reason) of a chat stream,
    the deltas joined as an OpenAI client joins them."""
    content, calls, reason = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"name": "", "arguments": "", "id": None})
                if part.id is not None:
                    assert call["id"] is None and call["name"] == "", "id and name come first"
                    call["id"] = part.id
                    assert part.type == "function"
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            reason = choice.finish_reason or reason
    return "".join(content), [calls[i] for i in sorted(calls)], reason


def check_call(name: str, arguments: str, allowed=("get_weather", "add")) -> None:
    assert name in allowed
    args = json.loads(arguments)
    assert valid(args, SCHEMAS[name]), arguments


@pytest.mark.parametrize("choice, allowed", [
    ("required", ("get_weather", "add")),
    ({"type": "function", "function": {"name": "add"}}, ("add",)),
    ({"type": "function", "function": {"name": "get_weather"}}, ("get_weather",)),
])
def test_forced_call_whole_and_streamed(server, choice, allowed):
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    client = server.client()
    for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 7}):
        got = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice=choice, max_tokens=200, **sampling)
        choice0 = got.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        calls = choice0.message.tool_calls
        assert len(calls) == 1 and calls[0].type == "function"
        assert calls[0].id.startswith("call_")
        check_call(calls[0].function.name, calls[0].function.arguments, allowed)
        content, streamed, reason = streamed_calls(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
            stream=True, **sampling))
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in streamed] == \
            [(calls[0].function.name, calls[0].function.arguments)]


def test_forced_calls_of_n_choices_streamed_with_logprobs(server):
    """n=2 streamed: each choice's deltas carry its own call under its index,
    equal to the whole answer's choice of the same seed; logprobs still come."""
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    client = server.client()
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=1, seed=21, n=2, logprobs=True)
    whole = client.chat.completions.create(**fields)
    chunks = list(client.chat.completions.create(stream=True, **fields))
    for choice in whole.choices:
        mine = [c for c in chunks if c.choices and c.choices[0].index == choice.index]
        content, calls, reason = streamed_calls(mine)
        assert reason == choice.finish_reason == "tool_calls"
        want = choice.message.tool_calls
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in want]
        check_call(want[0].function.name, want[0].function.arguments)
        assert choice.logprobs is not None and choice.logprobs.content
        assert any(c.choices[0].logprobs is not None for c in mine)


def test_parallel_forced_calls(server):
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    got = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=True, max_tokens=120, temperature=1, seed=11, n=2)
    for choice in got.choices:
        if choice.finish_reason == "length":
            # a run of calls outlasted max_tokens: no calls are read out of
            # it, and its whole calls validate
            assert choice.message.tool_calls is None
            text = choice.message.content
            calls = parse_calls(text[:text.rfind("</tool_call>") + 12], "hermes")[1]
        else:
            assert choice.finish_reason == "tool_calls"
            calls = [ToolCall(c.function.name, c.function.arguments)
                     for c in choice.message.tool_calls]
        assert len(calls) >= 1, choice
        for call in calls:
            check_call(call.name, call.arguments)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_forced_grammar_in_the_engine(folder, fmt):
    """The constraint of each format, run by the real engine at a high
    temperature: every answer parses, in that format, into calls that
    validate; with parallel_tool_calls some answers hold several."""
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    from dataclasses import replace

    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder.from_pretrained(str(folder), num_pages=128, page_size=PAGE_SIZE,
                                     max_batch_size=4)
    prompt = dec.text.encode_chat(ASK)
    counts = []
    for parallel in (False, True):
        req = replace(parse_tools({"tools": TOOLS, "tool_choice": "required",
                                   "parallel_tool_calls": parallel}), format=fmt)
        constraint = dec.make_constraint(*call_grammar(req))
        outs = dec.generate([prompt] * 4, 300, temperature=2.0, seed=5, constraint=constraint)
        for out in outs:
            text = dec.text.decode(out)
            if len(out) == 300:   # a run of calls cut by the budget: its whole calls
                assert parallel, text
                text = (text[:text.rfind("</tool_call>") + len("</tool_call>")]
                        if fmt == "hermes" else text[:text.rfind("; ")])
            content, calls = parse_calls(text, fmt)
            assert calls and content is None, text
            assert parallel or len(calls) == 1
            for call in calls:
                check_call(call.name, call.arguments)
            counts.append(len(calls))
    assert max(counts) > 1, counts


ORDER = {"type": "object",
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"$ref": "#/$defs/Item"}}},
         "required": ["items"], "additionalProperties": False,
         "$defs": {"Item": {"type": "object",
                            "properties": {"kind": {"enum": ["tea", "milk"]},
                                           "size": {"$ref": "#/definitions/Size"}},
                            "required": ["kind", "size"], "additionalProperties": False}},
         "definitions": {"Size": {"enum": ["small", "large"]}}}


def test_forced_call_with_defs_in_the_engine(folder):
    """Parameters that refer to their own $defs (as pydantic writes them):
    the references still resolve inside the call's grammar, for the named
    tool beside another tool with a definition of the same name."""
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    from dataclasses import replace

    from pagedkv_np.onnxruntime import OrtDecoder

    other = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}},
             "required": ["x"], "$defs": {"Item": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "order", "parameters": ORDER}},
             {"type": "function", "function": {"name": "other", "parameters": other}}]
    dec = OrtDecoder.from_pretrained(str(folder), num_pages=64, page_size=PAGE_SIZE,
                                     max_batch_size=4)
    for choice in ("required", {"type": "function", "function": {"name": "order"}}):
        req = replace(parse_tools({"tools": tools, "tool_choice": choice}), format="hermes")
        constraint = dec.make_constraint(*call_grammar(req))
        outs = dec.generate([dec.text.encode_chat(ASK)] * 4, 200, temperature=2.0, seed=3,
                            constraint=constraint)
        for out in outs:
            text = dec.text.decode(out)
            _, calls = parse_calls(text, "hermes")
            assert len(calls) == 1, text
            args = json.loads(calls[0].arguments)
            if calls[0].name == "other":
                assert choice == "required"
                assert isinstance(args["x"], int) and not isinstance(args["x"], bool), text
                continue
            assert calls[0].name == "order" and set(args) == {"items"}, text
            assert 1 <= len(args["items"]) <= 2
            for item in args["items"]:
                assert item["kind"] in ("tea", "milk") and item["size"] in ("small", "large")
                assert set(item) == {"kind", "size"}


def test_auto_and_none_answer_plain_text(server):
    """This random model writes no call unprompted: auto and none give its
    plain text, the same text as without tools' parsing (tool_choice none)."""
    client = server.client()
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          max_tokens=24, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=24, temperature=0)
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert auto.choices[0].finish_reason in ("stop", "length")
    content, calls, _ = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0, stream=True))
    assert calls == [] and content == auto.choices[0].message.content


def render(messages, tools) -> str:
    """The prompt text, rendered here with jinja2 as transformers does."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    return env.from_string(HERMES).render(messages=messages, tools=tools,
                                          add_generation_prompt=True)


def test_history_with_tool_messages_renders(server, folder):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    got = server.client().chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                  max_tokens=4, temperature=0)
    as_template_reads = ASK + [
        {"role": "assistant", "content": "",
         "tool_calls": [dict(call, function={"name": "get_weather",
                                             "arguments": {"city": "Paris",
                                                           "unit": "celsius"}})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    text = render(as_template_reads, TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response id="call_1">\n18 degrees' in text
    assert '"name": "add"' in text
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert got.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("patch, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": ASK + [{"role": "tool", "content": "18"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "assistant", "content": "", "tool_calls": {"id": "x"}}]},
     "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages[0].tool_calls"),
])
def test_bad_tool_fields_are_400(server, patch, param):
    if param in ("tools", "response_format") and "tool_choice" in patch:
        pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    body = dict({"messages": ASK, "max_tokens": 4}, **patch)
    with server.http() as http:
        assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_completions_refuse_tools(server):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json={"prompt": "hi", "tools": TOOLS}), 400,
                     param="tools", code="unsupported_parameter")


def test_template_without_tools_is_400(plain_server):
    client = plain_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "tools"
    with plain_server.http() as http:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4}
        assert_error(http.post("/v1/chat/completions", json=body), 400, param="tools",
                     code="unsupported_parameter")
    # tool_choice none: the tools are dropped, the answer is the plain one
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6,
                                           temperature=0)
    dropped = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice="none", max_tokens=6, temperature=0)
    assert dropped.choices[0].message.content == plain.choices[0].message.content
    assert dropped.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_gguf_whose_own_template_reads_tools_is_forced_to_call(tmp_path, monkeypatch):
    """A tiny GGUF made here whose tokenizer.chat_template is the tools-aware
    one: served as a file, a named choice gives the named call, valid."""
    pytest.importorskip("llguidance", reason="the constrain extra is not installed")
    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    from test_gguf_import import write_gguf

    plain, path = tmp_path / "plain.gguf", tmp_path / "tools.gguf"
    write_gguf(plain, context_length=2048)       # a tiny vocabulary: long prompts
    copy_with_new_metadata(
        gguf.GGUFReader(str(plain)), gguf.GGUFWriter(str(path), "llama"),
        {"tokenizer.chat_template": MetadataDetails(gguf.GGUFValueType.STRING, HERMES)}, [])
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    server = Server(str(path), "--num-pages", "128", "--page-size", str(PAGE_SIZE))
    try:
        got = server.client().chat.completions.create(
            model="tools", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    finally:
        assert server.stop() == 0
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call.function.name, call.function.arguments, ("get_weather",))
