"""TextCodec, chat templates, the streaming detokenizer and stop strings, with
real tokenizers trained here (byte-level BPE, and SentencePiece-style BPE with
byte fallback)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedkv_np import ConfigError, DTypeError, PagedKVError
from pagedkv_np.text.streaming import (Detokenizer, StopMatcher, TextStream,
                                              truncate_at_stop)
from pagedkv_np.errors import ChatTemplateError, MissingModelFile, ModelFolderError
from pagedkv_np.text.codec import TextCodec, check_messages

import textfolders as tf

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Capital of France? 😀"}]
TEXTS = ["Paris 😀 is the capital", "日本語のテキスト", "🎉🚀❤️ café naïve Straße",
         "mixed 中文 and emoji 😀😀 ok", "plain ascii text."]


@pytest.fixture(scope="module")
def codec():
    return TextCodec(tf.tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>",
                     chat_template=tf.CHATML)


@pytest.fixture(scope="module")
def metaspace_codec():
    """SentencePiece-style: '▁' for spaces, byte-fallback tokens, the leading
    space stripped from the start of a text."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(tf.CORPUS, trainer)
    return TextCodec(tok, bos_token="<s>", eos_token="</s>", add_bos_token=True)


def stream(detok: Detokenizer, ids, chunks=None) -> list[str]:
    """Deltas of feeding ``ids`` in pieces of the given sizes (default 1)."""
    out, i = [], 0
    for n in chunks or [1] * len(ids):
        out.append(detok.push(ids[i:i + n]))
        i += n
    out.append(detok.push(ids[i:]))
    out.append(detok.finish())
    return out


# ------------------------------------------------------------------ codec

def test_encode_decode_round_trip(codec):
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids.dtype == np.int64 and ids.ndim == 1
        assert ids.tolist() == tf.tokenizer().encode(text).ids
        assert codec.decode(ids) == text
    assert codec.bos_token_id == tf.BOS_ID and codec.eos_token_id == tf.EOS_ID
    assert codec.vocab_size == tf.VOCAB


def test_special_tokens_skipped_unless_asked(codec):
    ids = [tf.BOS_ID] + codec.encode("hi").tolist() + [tf.EOS_ID]
    assert codec.decode(ids) == "hi"
    assert codec.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_add_bos_token(metaspace_codec):
    ids = metaspace_codec.encode("Hello world").tolist()
    assert ids[0] == metaspace_codec.bos_token_id == 1
    assert metaspace_codec.encode("Hello world", add_special_tokens=False).tolist() == ids[1:]
    assert metaspace_codec.decode(ids) == "Hello world"


def test_encode_rejects_non_text(codec):
    with pytest.raises(DTypeError):
        codec.encode(b"bytes")
    with pytest.raises(DTypeError):
        TextCodec("not a tokenizer")


def test_from_folder_reads_dict_tokens_and_named_templates(tmp_path):
    tf.write_tokenizer(str(tmp_path), bos_token={"content": "<|im_start|>", "lstrip": False},
                       eos_token={"content": "<|im_end|>"},
                       chat_template=[{"name": "default", "template": tf.CHATML},
                                      {"name": "tool_use", "template": "TOOLS {{ tools }}"}])
    codec = TextCodec.from_folder(tmp_path)
    assert (codec.bos_token, codec.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert codec.eos_token_id == tf.EOS_ID
    assert sorted(codec.chat_templates) == ["default", "tool_use"]
    assert codec.apply_chat_template(MESSAGES[1:]) == \
        "<|im_start|>user\nCapital of France? 😀<|im_end|>\n<|im_start|>assistant\n"
    assert codec.apply_chat_template(MESSAGES, template_name="tool_use", tools=[1]) == \
        "TOOLS [1]"
    with pytest.raises(ChatTemplateError, match="no template 'other'"):
        codec.apply_chat_template(MESSAGES, template_name="other")


def test_from_folder_template_file_and_special_tokens_map(tmp_path):
    tf.write_tokenizer(str(tmp_path), chat_template=None, bos_token=None, eos_token=None)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["bos_token"], cfg["eos_token"]
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    codec = TextCodec.from_folder(tmp_path)
    assert codec.eos_token_id == tf.EOS_ID
    assert codec.apply_chat_template(MESSAGES) == "<|im_start|>You are terse."


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_from_folder_names_the_missing_file(tmp_path, missing):
    tf.write_tokenizer(str(tmp_path))
    os.remove(tmp_path / missing)
    with pytest.raises(MissingModelFile, match=missing) as info:
        TextCodec.from_folder(tmp_path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, PagedKVError)


def test_from_folder_malformed_files(tmp_path):
    tf.write_tokenizer(str(tmp_path), eos_token=7)
    with pytest.raises(ModelFolderError, match="eos_token"):
        TextCodec.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelFolderError, match="not a JSON object"):
        TextCodec.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="tokenizer.json"):
        TextCodec.from_folder(tmp_path)


# --------------------------------------------------------------- templates

def test_chatml_rendering(codec):
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nCapital of France? 😀<|im_end|>\n")
    assert codec.apply_chat_template(MESSAGES, add_generation_prompt=False) == want
    assert codec.apply_chat_template(MESSAGES) == want + "<|im_start|>assistant\n"
    ids = codec.encode_chat(MESSAGES)
    # the template's special tokens are single ids, not spelled out
    assert ids[0] == tf.BOS_ID and (ids == tf.EOS_ID).sum() == 2
    assert codec.decode(ids, skip_special_tokens=False) == want + "<|im_start|>assistant\n"


def test_template_whitespace_control_and_builtins():
    """trim_blocks and lstrip_blocks, loop controls, tojson that keeps text
    as it is, {% generation %} blocks, bos/eos variables."""
    template = ("{{ bos_token }}\n"
                "{% for m in messages %}\n"
                "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
                "    {{ m['role'] | upper }}={{ m | tojson }}\n"
                "{% endfor %}\n"
                "{% generation %}GEN{% endgeneration %}{{ eos_token }}")
    codec = TextCodec(tf.tokenizer(), bos_token="<B>", eos_token="<E>", chat_template=template)
    msgs = MESSAGES + [{"role": "user", "content": "ignored"}]
    assert codec.apply_chat_template(msgs) == (
        '<B>\n'
        '    SYSTEM={"role": "system", "content": "You are terse."}\n'
        '    USER={"role": "user", "content": "Capital of France? 😀"}\n'
        'GEN<E>')


def test_template_variables_default_to_none():
    codec = TextCodec(tf.tokenizer(), chat_template=(
        "{% if tools is not none %}TOOLS {{ tools | tojson }} {% endif %}"
        "{% if documents is not none %}DOCS {% endif %}{{ messages | length }}"))
    assert codec.apply_chat_template(MESSAGES) == "2"
    assert codec.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == 'TOOLS [{"name": "f"}] 2'


def test_template_errors_are_typed(codec):
    raising = TextCodec(tf.tokenizer(), chat_template=(
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}ok"))
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        raising.apply_chat_template(MESSAGES)
    assert raising.apply_chat_template(MESSAGES[1:]) == "ok"
    mutating = TextCodec(tf.tokenizer(), chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        mutating.apply_chat_template(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        TextCodec(tf.tokenizer(), chat_template="{% for %}").apply_chat_template(MESSAGES)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        TextCodec(tf.tokenizer()).apply_chat_template(MESSAGES)
    with pytest.raises(ChatTemplateError):
        TextCodec(tf.tokenizer(), chat_template=[{"template": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize("messages, error", [
    ([], ConfigError),
    ("hello", DTypeError),
    (None, DTypeError),
    (["hello"], DTypeError),
    ([{"content": "x"}], ConfigError),
    ([{"role": "user"}], ConfigError),
    ([{"role": "user", "content": 3}], DTypeError),
    ([{"role": None, "content": "x"}], DTypeError),
])
def test_bad_messages(codec, messages, error):
    with pytest.raises(error):
        codec.apply_chat_template(messages)
    with pytest.raises(error):
        check_messages(messages)


# -------------------------------------------------------------- detokenizer

@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_a_character(codec, text):
    ids = codec.encode(text).tolist()
    # the test tokenizer splits multi-byte characters over several tokens
    assert any("\ufffd" in codec.decode([i]) for i in ids) or text.isascii()
    deltas = stream(Detokenizer(codec), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_an_incomplete_character(codec):
    ids = codec.encode("😀").tolist()
    assert len(ids) > 1
    detok = Detokenizer(codec)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "😀"
    assert detok.finish() == "" and detok.text == "😀"


def test_detokenizer_finish_gives_an_unfinished_character_as_decoded(codec):
    ids = codec.encode("a😀").tolist()[:-1]
    detok = Detokenizer(codec)
    assert "".join(detok.push(i) for i in ids) == "a"
    assert detok.finish() == codec.decode(ids)[1:]
    assert detok.text == codec.decode(ids)


def test_detokenizer_keeps_spaces_of_a_leading_space_decoder(metaspace_codec):
    text = "Hello world, the capital of France is Paris 😀"
    ids = metaspace_codec.encode(text, add_special_tokens=False).tolist()
    deltas = stream(Detokenizer(metaspace_codec), ids)
    assert "".join(deltas) == text
    assert " " in "".join(deltas[1:])   # later tokens keep their leading space


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, tf.VOCAB - 1), max_size=40),
       chunks=st.lists(st.integers(1, 4), max_size=40), skip=st.booleans())
def test_detokenizer_joins_to_the_whole_decode(codec, ids, chunks, skip):
    deltas = stream(Detokenizer(codec, skip_special_tokens=skip), ids, chunks)
    assert "".join(deltas) == codec.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 399), max_size=40),
       chunks=st.lists(st.integers(1, 4), max_size=40))
def test_detokenizer_joins_to_the_whole_decode_byte_fallback(metaspace_codec, ids, chunks):
    deltas = stream(Detokenizer(metaspace_codec), ids, chunks)
    assert "".join(deltas) == metaspace_codec.decode(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cé日😀\n")), max_size=30))
def test_detokenizer_of_real_text_emits_whole_characters(codec, text):
    ids = codec.encode(text).tolist()
    deltas = stream(Detokenizer(codec), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


# ----------------------------------------------------------------- stops

def test_stop_matcher_finds_the_first_completed_stop():
    m = StopMatcher(["abcd", "c", "zz"])
    assert m.find("xxabcd") == 4          # "c" completes before "abcd"
    assert m.find("xxabxx") is None
    assert StopMatcher(["bc", "abc"]).find("abc") == 0   # same end: earliest start
    assert truncate_at_stop("hello world", " wor") == "hello"
    assert truncate_at_stop("hello", None) == "hello"


def test_stop_matcher_holds_back_a_partial_stop():
    m = StopMatcher("</end>")
    assert m.push("text </") == "text "
    assert m.push("en") == ""
    assert m.push("x more") == "</enx more"
    assert m.push(" </end> after") == " "
    assert m.stopped and m.text == "text </enx more "
    assert m.push("ignored") == "" and m.finish() == ""


def test_stop_matcher_finish_releases_held_text():
    m = StopMatcher(["STOP"])
    assert m.push("almost ST") == "almost "
    assert m.finish() == "ST" and not m.stopped


@pytest.mark.parametrize("stop, error", [(3, DTypeError), ([""], ConfigError),
                                          (["a", None], DTypeError)])
def test_bad_stop_strings(stop, error):
    with pytest.raises(error):
        StopMatcher(stop)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_streamed_stops_equal_the_whole_text_stop(text, stops, cuts):
    m = StopMatcher(stops)
    pieces, prev = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[prev:cut])
        prev = max(prev, cut)
    out = "".join(m.push(p) for p in pieces)
    if not m.stopped:
        out += m.finish()
    assert out == truncate_at_stop(text, stops)
    assert m.stopped == any(s in text for s in stops)


def test_text_stream_drops_end_tokens_and_stops(codec):
    ids = codec.encode("The capital of France is Paris.").tolist()
    s = TextStream(codec, eos_token_ids=[tf.EOS_ID])
    text = "".join(s.push(i) for i in ids + [tf.EOS_ID]) + s.finish()
    assert text == s.text == "The capital of France is Paris."
    s = TextStream(codec, stop=[" is"], eos_token_ids=[tf.EOS_ID])
    text = "".join(s.push(i) for i in ids)
    assert s.stopped and text + s.finish() == "The capital of France"
    # an end token that is not special is still left out
    s = TextStream(codec, eos_token_ids=[ids[-1]], skip_special_tokens=False)
    assert "".join(s.push(i) for i in ids) + s.finish() == codec.decode(ids[:-1])


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, tf.VOCAB - 1), max_size=40),
       chunks=st.lists(st.integers(1, 4), max_size=40),
       stops=st.lists(st.sampled_from(["e", "th", " ", "😀", "\ufffd", "ab", "日本"]),
                      max_size=3))
def test_text_stream_equals_the_whole_decode_cut_at_its_stop(codec, ids, chunks, stops):
    s = TextStream(codec, stop=stops or None, eos_token_ids=[tf.EOS_ID])
    out, i = [], 0
    for n in chunks + [len(ids)]:
        out.append(s.push(ids[i:i + n]))
        i += n
    out.append(s.finish())
    whole = codec.decode([t for t in ids if t != tf.EOS_ID])
    assert "".join(out) == s.text == truncate_at_stop(whole, stops or None)
    assert s.stopped == any(x in whole for x in stops)


def _held_runs_ids(codec, draw_runs):
    """Ids of long runs of tokens that decode to nothing or to incomplete
    characters (a lone UTF-8 lead byte, a skipped special token), between
    ordinary text."""
    lead = codec.tokenizer.token_to_id("ð")          # the byte 0xF0 alone
    special = codec.tokenizer.token_to_id("<|im_end|>")
    text = codec.encode("é 日 ok").tolist()
    ids = []
    for kind, n in draw_runs:
        ids += {"lead": [lead] * n, "special": [special] * n, "text": text * n}[kind]
    return ids


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.tuples(st.sampled_from(["lead", "special", "text"]),
                               st.integers(1, 60)), max_size=6),
       chunks=st.lists(st.integers(1, 5), max_size=80), skip=st.booleans())
def test_detokenizer_joins_long_held_runs_to_the_whole_decode(codec, runs, chunks, skip):
    ids = _held_runs_ids(codec, runs)
    deltas = stream(Detokenizer(codec, skip_special_tokens=skip), ids, chunks)
    assert "".join(deltas) == codec.decode(ids, skip_special_tokens=skip)


def test_detokenizer_decodes_a_bounded_window_however_long_text_is_held(codec):
    """4,000 tokens that never complete a character: each push decodes a few
    tokens, not every held token again (which made streaming quadratic)."""
    widths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            widths.append(len(ids))
            return codec.decode(ids, skip_special_tokens)

    for kind in ("lead", "special"):
        ids = _held_runs_ids(codec, [(kind, 4000)])
        widths.clear()
        detok = Detokenizer(Counting())
        joined = "".join(detok.push([i]) for i in ids)
        assert max(widths) <= 40, kind
        assert joined + detok.finish() == codec.decode(ids)
