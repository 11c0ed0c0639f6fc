"""A prompt's K/V is held once while it is fed (pagedkv_np.onnxruntime.batching).

The runner's prompt buffers hold the chunks fed so far; the pages get them
after the last chunk, layer by layer, each layer's buffers handed back once
written, or, for a prompt fed and decoded alone, when its batch ends (its
buffers are its decode buffers). The pages must end up with the bytes that
writing every chunk at once gave, the tokens must be those of a full
recompute, and the resident memory of the buffers and the pool together
must stay within one copy of the K/V (counted in the kernel's own pages).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_np.errors import ConfigError
from pagedkv_np.memory import LAZY_MIN_BYTES, lazy_zeros, release
from pagedkv_np.models.testmodel import DecoderConfig, build_model
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.onnxruntime.chunking import SOLO_PREFILL_CHUNK

from test_faults import Reference, assert_idle

FAMILIES = ["optimum", "gqa"]
PAGE = 16
OS_PAGE = 4096
_rng = np.random.default_rng(4564)
LONG = _rng.integers(1, 256, SOLO_PREFILL_CHUNK + 188).tolist()     # two chunks alone
_MODELS: dict = {}
_REFS: dict = {}


def model(family: str, **config) -> bytes:
    key = (family, tuple(sorted(config.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(DecoderConfig(**config), family=family).SerializeToString()
    return _MODELS[key]


def ref(family: str) -> Reference:
    if family not in _REFS:
        _REFS[family] = Reference(model(family))
    return _REFS[family]


def decoder(family: str, **kw) -> OrtDecoder:
    kw.setdefault("num_pages", 256)
    kw.setdefault("page_size", PAGE)
    return OrtDecoder(model(family, **kw.pop("config", {})), **kw)


def written_kv(dec: OrtDecoder, tokens: list[int]) -> tuple[list, list]:
    """Per layer, the K/V [T, H, D] that the pages hold for ``tokens``
    (all but the last: the most a sequence is served)."""
    cache = dec.cache
    seq = cache.add_sequence(tokens)
    try:
        assert seq.num_cached_tokens == len(tokens) - 1
        plan = cache.plan([seq])
        ks, vs = [], []
        for layer in range(cache.num_layers):
            k, v = cache.gather(layer, plan, "BHTD", host=True)
            ks.append(k[0].transpose(1, 0, 2).copy())
            vs.append(v[0].transpose(1, 0, 2).copy())
        return ks, vs
    finally:
        cache.release(seq)


def chunk_by_chunk(family: str, prompt: list[int], new: int):
    """Greedy tokens and per-layer K/V as every chunk's K/V was written
    before: prefill calls of the runner (chunks of the solo size), then
    decode steps over buffers gathered from those chunks' K/V."""
    runner = decoder(family)._runner
    n, parts = len(prompt), []
    for start in range(0, n, SOLO_PREFILL_CHUNK):
        chunk = np.array(prompt[start:start + SOLO_PREFILL_CHUNK], np.int64)
        logits, kv = runner.prefill(chunk, start, None, n)
        parts.append([(k.copy(), v.copy()) for k, v in kv])
    runner.forget_prompt()
    ks = [np.concatenate([p[layer][0] for p in parts]) for layer in range(len(parts[0]))]
    vs = [np.concatenate([p[layer][1] for p in parts]) for layer in range(len(parts[0]))]

    def gather(layer, out):
        if out is None:      # the optimum family's past is exactly the cached positions
            return (ks[layer].transpose(1, 0, 2)[None].copy(),
                    vs[layer].transpose(1, 0, 2)[None].copy())
        out[0][0, :, :n] = ks[layer].transpose(1, 0, 2)
        out[1][0, :, :n] = vs[layer].transpose(1, 0, 2)
        return out

    tokens = [int(np.argmax(logits))]
    runner.start_batch(gather, np.array([n], np.int64), n + new)
    for i in range(new - 1):
        logits = runner.decode(np.array(tokens[-1:], np.int64), np.array([n + i], np.int64))
        for layer, (k, v) in enumerate(runner.recent_kv(1)):
            ks[layer] = np.concatenate([ks[layer], k])
            vs[layer] = np.concatenate([vs[layer], v])
        tokens.append(int(np.argmax(logits[0])))
    return tokens, ks, vs


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_alone_leaves_the_pages_it_left_when_each_chunk_was_written(family):
    new = 6
    tokens, ks, vs = chunk_by_chunk(family, LONG, new)
    dec = decoder(family)
    rid = dec.add_request(LONG, max_new_tokens=new, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.pop_output(rid) == tokens == ref(family).tokens(LONG, new)
    assert dec.stats["num_regathers"] == 0        # decoded in the prompt's own buffers
    got_k, got_v = written_kv(dec, LONG + tokens[:-1])
    for layer in range(len(ks)):
        assert np.array_equal(got_k[layer], ks[layer][:-1])
        assert np.array_equal(got_v[layer], vs[layer][:-1])
    # the whole prompt, and what it decoded, is a prefix hit now
    again = dec.add_request(LONG + tokens[:3], max_new_tokens=2, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.status(again).num_cached_tokens == len(LONG) + 2
    assert dec.pop_output(again) == ref(family).tokens(LONG + tokens[:3], 2)
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_admitted_while_a_prompt_decodes_alone_finds_its_pages(family):
    prompt = LONG[:100]
    dec = decoder(family)
    first = dec.add_request(prompt, max_new_tokens=8, ignore_eos=True)
    dec.step()                                   # fed alone: decodes in its prompt's buffers
    other = [t for t in range(1, 4) if t != ref(family).tokens(prompt, 1)[0]][0]
    second = dec.add_request(prompt + [other], max_new_tokens=4, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.status(second).num_cached_tokens == 100 // PAGE * PAGE   # its full pages
    assert dec.pop_output(first) == ref(family).tokens(prompt, 8)
    assert dec.pop_output(second) == ref(family).tokens(prompt + [other], 4)
    assert_idle(dec)


# ------------------------------------------------------------------ memory

BIG = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}     # head_dim 64
BIG_PROMPT = _rng.integers(1, 256, 2100).tolist()    # a prompt buffer: over LAZY_MIN_BYTES


def _shmem() -> int:
    """Bytes resident in shared mappings (lazy_zeros buffers: the pool and
    the runner's K/V buffers)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def _bound(positions: int) -> int:
    """Bytes of the K and V of ``positions`` tokens in every layer (float32),
    plus one layer's (a layer is written before its buffers go back), plus
    the kernel page that each head's run of a buffer may start and end in."""
    geometry = DecoderConfig(**BIG)
    per_layer = 2 * geometry.num_kv_heads * geometry.head_dim * 4
    runs = 2 * geometry.num_layers * (geometry.num_kv_heads + 1)
    return positions * per_layer * (geometry.num_layers + 1) + 2 * runs * OS_PAGE


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "beside-a-decode"])
def test_a_long_prompt_is_resident_once(family, alone):
    dec = decoder(family, config=BIG, prefill_chunk=64)
    # a K buffer of the prompt (2 heads of 64): mapped, counted in RssShmem
    assert 2 * len(BIG_PROMPT) * 64 * 4 > LAZY_MIN_BYTES
    after_writes: list[int] = []
    cache_write = dec.cache.write

    def write(*args, **kwargs):           # the real write, then what is resident after it
        cache_write(*args, **kwargs)
        after_writes.append(_shmem())

    dec.cache.write = write               # type: ignore[method-assign]
    others = 0
    if not alone:
        others = 3 + 60
        dec.add_request([5, 6, 7], max_new_tokens=60, ignore_eos=True)
        dec.step()
    base = _shmem()
    rid = dec.add_request(BIG_PROMPT, max_new_tokens=4, ignore_eos=True)
    fed = 0
    while dec.has_unfinished_requests():
        after_writes.clear()
        prefilling = not dec.get_output(rid)
        dec.step()
        fed = min(len(BIG_PROMPT) + 4, fed + (SOLO_PREFILL_CHUNK if alone else 64))
        if prefilling or alone:
            # the pool and the prompt's buffers together: one copy of what was fed
            # (a batch of two decodes in buffers gathered from the pages: a second)
            bound = _bound(fed + others)
            assert _shmem() - base <= bound
            assert all(p - base <= bound for p in after_writes)
    if alone:       # it decoded in its prompt's buffers
        assert dec.stats["num_regathers"] == 0
    assert dec.pop_output(rid) == Reference(model(family, **BIG)).tokens(BIG_PROMPT, 4)
    assert_idle(dec)


def test_a_prompt_joining_a_batch_is_resident_once():
    """A long prompt fed beside a short stream joins its batch: its row is
    copied from the prompt's buffers, each layer handed back once copied, and
    reaches the pages when the batch ends; the short row is held to its own
    length, not the long one's. At every point: one copy of the long
    prompt's K/V, where the pages and a batch padded to the longest row held
    three (one per row, and the pages')."""
    dec = decoder("gqa", config=BIG, prefill_chunk=64)
    short = dec.add_request([5, 6, 7], max_new_tokens=60, ignore_eos=True)
    dec.step()
    base = _shmem()
    samples: list[int] = []
    runner, cache_write = dec._runner, dec.cache.write
    drop = runner.drop_prompt_layer

    def write(*args, **kwargs):
        cache_write(*args, **kwargs)
        samples.append(_shmem() - base)

    def dropped(layer):
        drop(layer)
        samples.append(_shmem() - base)

    dec.cache.write = write                       # type: ignore[method-assign]
    runner.drop_prompt_layer = dropped            # type: ignore[method-assign]
    rid = dec.add_request(BIG_PROMPT, max_new_tokens=4, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
        samples.append(_shmem() - base)
    assert dec.stats["num_regathers"] >= 1           # they decoded as a batch
    geometry = DecoderConfig(**BIG)
    per_layer = 2 * geometry.num_kv_heads * geometry.head_dim * 4
    per_position = per_layer * geometry.num_layers
    long = len(BIG_PROMPT) + 4
    # one copy of the long row, the short one's twice (pages and buffer),
    # one layer of the long row twice while it is copied or written, and a
    # kernel page where each head's run of a buffer or a page starts and ends
    bound = (long + 2 * 63) * per_position + long * per_layer + 96 * OS_PAGE
    assert max(samples) <= bound, (max(samples), bound)
    ref = Reference(model("gqa", **BIG))
    assert dec.pop_output(rid) == ref.tokens(BIG_PROMPT, 4)
    assert dec.pop_output(short) == ref.tokens([5, 6, 7], 60)
    # the prompt and what it decoded reached the pages when its batch ended
    got_k, _ = written_kv(dec, BIG_PROMPT + ref.tokens(BIG_PROMPT, 4)[:3])
    assert len(got_k) == geometry.num_layers
    again = dec.add_request(BIG_PROMPT + [9], max_new_tokens=2, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.status(again).num_cached_tokens == len(BIG_PROMPT)
    assert dec.pop_output(again) == ref.tokens(BIG_PROMPT + [9], 2)
    assert_idle(dec)


def _joined(dec: OrtDecoder, prompt: list[int], new: int, also: list[int] | None = None
            ) -> tuple[int, int, int | None]:
    """Start a stream, then feed ``prompt`` beside it to its end: it waits in
    the runner's buffers to join the batch (not yet in the pages). ``also``:
    a prompt queued behind it, fed in the step its last chunk is."""
    stream = dec.add_request([5, 6, 7], max_new_tokens=40, ignore_eos=True)
    dec.step()
    rid = dec.add_request(prompt, max_new_tokens=new, ignore_eos=True)
    other = None if also is None else dec.add_request(also, max_new_tokens=3,
                                                      ignore_eos=True)
    while not dec.get_output(rid):
        dec.step()
    if other is not None:          # fed in the same step: the first one was written
        assert dec.get_output(other) and dec.status(rid).num_cached_tokens == 0
    # kept, to be copied; written at once when it finished at its first token
    # or the runner fed another prompt
    kept = new > 1 and also is None
    assert dec._runner.prompt_positions == (len(prompt) if kept else len(also or ()))
    return stream, rid, other


def _prefix_hit(dec: OrtDecoder, prompt: list[int], family: str = "gqa") -> None:
    """A request for ``prompt`` and a token more finds all of it cached and
    decodes the full-recompute tokens."""
    rid = dec.add_request(prompt + [9], max_new_tokens=2, ignore_eos=True)
    while dec.has_unfinished_requests():
        dec.step()
    assert dec.status(rid).num_cached_tokens == len(prompt)
    assert dec.pop_output(rid) == ref(family).tokens(prompt + [9], 2)


@pytest.mark.parametrize("how", ["finished", "aborted", "another-prompt", "batch-fails",
                                 "alone-fails"])
def test_a_joining_prompt_that_does_not_join_is_written_or_recomputed(how):
    """A prompt waiting to join a batch that it never joins (it finished at
    its first token, was aborted, another prompt is fed, or the batch could
    not start) reaches the pages or is computed again: never lost, never
    served from a stale buffer."""
    dec = decoder("gqa")
    prompt = LONG[:150]
    stream, rid, other = _joined(dec, prompt, 1 if how == "finished" else 5,
                         LONG[200:230] if how == "another-prompt" else None)
    if how == "aborted":
        dec.abort(rid)
    if how == "alone-fails":          # the stream ends first: the prompt's batch is its own
        dec.abort(stream)
    if how in ("batch-fails", "alone-fails"):
        start = dec._runner.start_batch
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == 1:
                start(*args)           # part of the prompt's layers copied, then a failure
                raise MemoryError("injected")
            return start(*args)

        dec._runner.start_batch = failing     # type: ignore[method-assign]
    while dec.has_unfinished_requests():
        dec.step()
    assert dec._runner.prompt_positions == 0
    if how == "aborted":
        assert dec.status(rid).finish_reason == "abort"
    else:
        assert dec.pop_output(rid) == ref("gqa").tokens(prompt, 1 if how == "finished" else 5)
    if how == "another-prompt":
        assert dec.pop_output(other) == ref("gqa").tokens(LONG[200:230], 3)
    if how in ("batch-fails", "alone-fails"):
        assert dec.stats["num_preemptions"] >= 1           # computed again, not failed
    _prefix_hit(dec, prompt)
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_finished_requests_kv_is_written_by_the_next_step(family):
    """The step that gives a request its last token does not also write its
    K/V (a prompt decoded alone: all of it); the next step (or ``settle``)
    does, then releases its pages, and its prefix is cached."""
    dec = decoder(family)
    prompt = LONG[:150]
    writes: list[int] = []
    cache_write = dec.cache.write

    def write(layer, *args, **kwargs):
        writes.append(layer)
        cache_write(layer, *args, **kwargs)

    dec.cache.write = write                       # type: ignore[method-assign]
    rid = dec.add_request(prompt, max_new_tokens=4, ignore_eos=True)
    while not dec.is_finished(rid):
        writes.clear()
        dec.step()
    assert writes == []                           # the finishing step wrote nothing
    assert dec.has_unfinished_requests() and dec.stats["pages_used"] > 0
    assert dec.pop_output(rid) == ref(family).tokens(prompt, 4)
    if family == "gqa":
        dec.step()
    else:
        dec.settle()
    assert writes == list(range(dec.cache.num_layers))
    assert not dec.has_unfinished_requests() and dec.stats["pages_used"] == 0
    _prefix_hit(dec, prompt, family)
    assert_idle(dec)


# ------------------------------------------------------------- the runner


@pytest.mark.parametrize("family", FAMILIES)
def test_the_runner_refuses_what_it_does_not_hold(family):
    runner = decoder(family)._runner
    tokens = np.array(LONG[:10], np.int64)
    with pytest.raises(ConfigError, match="keeps no prompt"):
        runner.adopt_prompt()
    with pytest.raises(ConfigError, match="prompt_kv"):
        runner.prompt_kv(0, 0, 1)
    runner.prefill(tokens, 0, None, 12)
    with pytest.raises(ConfigError, match="go past the 12 positions"):
        runner.prefill(tokens[:3], 10, None)
    assert runner.prompt_positions == 10          # the prompt is kept as it was
    with pytest.raises(ConfigError, match="prompt_kv"):
        runner.prompt_kv(0, 5, 11)
    k, v = runner.prompt_kv(1, 2, 10)
    assert k.shape == v.shape == (8, 2, 16)
    runner.prefill(tokens[:2], 10, None)          # fits: 12 positions
    runner.adopt_prompt()
    assert runner.prompt_positions == 0
    k2, _ = runner.solo_kv(1, 2, 10)
    assert np.array_equal(k2, k)
    with pytest.raises(ConfigError, match="solo_kv"):
        runner.solo_kv(1, 0, 10**6)
    if not runner.positional:          # the optimum family's rows are not by position
        with pytest.raises(ConfigError, match="does not keep"):
            runner.rows_kv(1, [0], np.array([2]), np.array([10]))
        return
    k3, _ = runner.rows_kv(1, [0, 0], np.array([2, 4]), np.array([4, 10]))
    assert np.array_equal(k3, np.concatenate([k[:2], k[2:]]))
    for rows, start, end in (([1], 0, 1), ([0], 5, 4), ([0], 0, 10**6), ([-1], 0, 1)):
        with pytest.raises(ConfigError, match="rows_kv"):
            runner.rows_kv(1, rows, np.array([start]), np.array([end]))


def test_release_hands_a_lazy_buffer_back_and_leaves_it_usable():
    a = lazy_zeros((4, 1024, 1024), np.float32)      # 16 MiB
    before = _shmem()
    a[...] = 1
    assert _shmem() - before >= a.nbytes
    assert release(a[2:])                             # a view: the whole mapping goes
    assert _shmem() - before < OS_PAGE * 4
    assert not a.any()
    a[0, 0, 0] = 3                                    # committed again where written
    assert a.sum() == 3
    assert not release(np.zeros(4))                   # NumPy's memory: not ours to hand back


# ------------------------------------------- an adopted prompt's K/V, on every exit


def _decoding_alone(family: str, new: int = 8):
    dec = decoder(family)
    rid = dec.add_request(LONG[:100], max_new_tokens=new, ignore_eos=True)
    dec.step()
    dec.step()                 # two tokens, in the prompt's buffers: nothing in the pages
    assert _hits(dec, LONG[:100] + [1]) == 0
    return dec, rid


def _hits(dec: OrtDecoder, prompt: list[int]) -> int:
    """Tokens of ``prompt`` the prefix cache serves now."""
    seq = dec.cache.add_sequence(prompt)
    try:
        return seq.num_cached_tokens
    finally:
        dec.cache.release(seq)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_aborted_prompt_decoding_alone_stays_cached(family):
    dec, rid = _decoding_alone(family)
    dec.abort(rid)
    dec.step()
    assert dec.pop_output(rid) == ref(family).tokens(LONG[:100], 2)
    assert _hits(dec, LONG[:100] + [1]) == 100      # full pages and the partial tail
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failed_write_of_a_prompt_decoded_alone_keeps_its_tokens(family, exc):
    dec, rid = _decoding_alone(family, new=4)
    real, raised = dec.cache.write, []

    def write(*args, **kwargs):           # the real write, but the second layer fails once
        if args[0] == 1 and not raised:
            raised.append(exc)
            raise exc("injected")
        return real(*args, **kwargs)

    dec.cache.write = write               # type: ignore[method-assign]
    try:
        while dec.has_unfinished_requests():
            dec.step()
    except KeyboardInterrupt:
        assert exc is KeyboardInterrupt
    assert raised == [exc]
    assert dec.status(rid).finish_reason == "length"
    assert dec.pop_output(rid) == ref(family).tokens(LONG[:100], 4)
    assert _hits(dec, LONG[:100] + [1]) == 0         # half written: nothing is served
    assert_idle(dec)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["fails", "aborted"])
def test_an_interrupt_in_the_write_of_a_prompt_given_up_still_ends_it(family, how):
    """A prompt that fails (or is aborted) midway writes the chunks it fed;
    an interrupt in that write propagates, and the request still ends (it
    was once lost: neither finished nor waiting)."""
    dec = decoder(family, prefill_chunk=64)
    other = dec.add_request(LONG[:40], max_new_tokens=50)     # decoding: prompts go in chunks
    while not dec.get_output(other):
        dec.step()
    rid = dec.add_request(LONG, max_new_tokens=2)
    dec.step()                                  # its first chunk is fed
    real_prefill, real_write = dec._batcher.runner.prefill, dec.cache.write

    def prefill(*args, **kwargs):               # the next chunk fails
        raise RuntimeError("injected")

    def write(*args, **kwargs):                 # and so does the write of the fed chunk
        raise KeyboardInterrupt

    if how == "fails":
        dec._batcher.runner.prefill = prefill   # type: ignore[method-assign]
    dec.cache.write = write                     # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        if how == "fails":
            dec.step()
        else:
            dec.abort(rid)
    dec._batcher.runner.prefill, dec.cache.write = real_prefill, real_write
    assert dec.is_finished(rid)
    assert dec.status(rid).finish_reason == ("error" if how == "fails" else "abort")
    dec.pop_output(rid)
    while dec.has_unfinished_requests():
        dec.step()
    dec.pop_output(other)
    assert_idle(dec)
