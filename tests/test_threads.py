"""PagedKVCache shared by several threads.

Eight threads each run a long random mix of operations on sequences they
own (add with a shared-prefix prompt, extend, plan + write + gather, fork,
release), so that threads keep hitting and releasing each other's cached
pages while the pool runs out and evicts. The K/V written for a token is a
function of the whole prefix up to it, so a page shared between sequences
has exactly one correct content, and every thread checks every row it
gathers against it. At the end the cache's invariants hold and every page
is back in the pool.

Two step disciplines are run:

* ``"external"``: the plan, its writes and its gathers run under the
  cache's own re-entrant lock, which makes the step one atomic unit while
  every other call races freely;
* ``"none"``: what a caller would naturally write, each call on its own.
  This needs a plan to stay valid while other threads change *their*
  sequences, and pages to be shared only after their K/V is written.

Two deterministic tests pin down those two needs on their own.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import numpy as np
import pytest

import pagedkv_np as pk

from helpers import kv_of, prefix_codes

NUM_THREADS = 8
OPS_PER_THREAD = 500
NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 2
MAX_TOKENS = 48
MAX_OWN = 5

CPU_BACKENDS = [name for name in pk.available_backends() if name in ("numpy", "numba")]


# ------------------------------------------------------------------ workers
class Worker:
    """One thread's random operations on the sequences it owns."""

    def __init__(self, cache: pk.PagedKVCache, prefixes: list[list[int]], seed: int,
                 step_lock, stop: threading.Event, num_ops: int) -> None:
        self.cache, self.prefixes, self.rng = cache, prefixes, random.Random(seed)
        self.step_lock, self.stop, self.num_ops = step_lock, stop, num_ops
        self.own: list[tuple[pk.Sequence, list[int]]] = []
        self.ops_done = 0
        self.rows_checked = 0
        self.error: BaseException | None = None

    def step(self, items: list[tuple[pk.Sequence, list[int]]]) -> None:
        """Plan the sequences, write their new tokens for every layer, gather
        every layer and compare each row with the prefix function."""
        cache = self.cache
        codes = [prefix_codes(tokens) for _, tokens in items]
        with self.step_lock():
            plan = cache.plan([seq for seq, _ in items])
            ctx = plan.context_lens
            for layer in range(NUM_LAYERS):
                parts = [kv_of(c[int(lo):], layer, NUM_KV_HEADS, HEAD_DIM)
                         for c, lo in zip(codes, ctx)]
                k = np.concatenate([p[0] for p in parts])
                v = np.concatenate([p[1] for p in parts])
                cache.write(layer, plan, k, v)
            gathered = [cache.gather(layer, plan) for layer in range(NUM_LAYERS)]
        for layer, (k, v) in enumerate(gathered):
            for b, c in enumerate(codes):
                want_k, want_v = kv_of(c, layer, NUM_KV_HEADS, HEAD_DIM)
                n = len(c)
                assert int(plan.seq_lens[b]) == n
                for name, got, want in (("K", k, want_k), ("V", v, want_v)):
                    assert np.array_equal(got[b, :, :n].view(np.uint32),
                                          want.transpose(1, 0, 2).view(np.uint32)), \
                        f"{name} of sequence {items[b][0].seq_id}, layer {layer}"
                assert not k[b, :, n:].any() and not v[b, :, n:].any()
                self.rows_checked += n

    def op_add(self) -> None:
        rng = self.rng
        base = rng.choice(self.prefixes)
        tail = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
        prompt = base[:rng.randint(1, len(base))] + tail
        seq = self.cache.add_sequence(prompt, salt=None if rng.random() < 0.9 else "tenant-b")
        try:
            self.cache.extend(seq, prompt[seq.num_cached_tokens:])
        except pk.OutOfPages:
            self.cache.release(seq)
            return
        self.own.append((seq, prompt))
        self.step([(seq, prompt)])

    def op_extend(self, num_seqs: int) -> None:
        rng = self.rng
        picked = rng.sample(self.own, min(num_seqs, len(self.own)))
        items = []
        for seq, tokens in picked:
            new = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
            if len(tokens) + len(new) > MAX_TOKENS:
                continue
            try:
                self.cache.extend(seq, new)
            except pk.OutOfPages:
                continue
            tokens.extend(new)
            items.append((seq, tokens))
        if items:
            self.step(items)

    def op_fork(self) -> None:
        seq, tokens = self.rng.choice(self.own)
        child = self.cache.fork(seq)
        self.own.append((child, list(tokens)))
        self.op_extend_one(child)

    def op_extend_one(self, seq: pk.Sequence) -> None:
        tokens = next(t for s, t in self.own if s is seq)
        new = [self.rng.randrange(1000) for _ in range(self.rng.randint(1, 3))]
        try:
            self.cache.extend(seq, new)
        except pk.OutOfPages:
            return
        tokens.extend(new)
        self.step([(seq, tokens)])

    def op_release(self) -> None:
        seq, _ = self.own.pop(self.rng.randrange(len(self.own)))
        self.cache.release(seq)

    def run(self) -> None:
        try:
            for i in range(self.num_ops):
                if self.stop.is_set():
                    return
                r = self.rng.random()
                if not self.own or (r < 0.3 and len(self.own) < MAX_OWN):
                    self.op_add()
                elif len(self.own) >= MAX_OWN or r < 0.45:
                    self.op_release()
                elif r < 0.55:
                    self.op_fork()
                elif r < 0.65:
                    self.step(self.rng.sample(self.own, min(3, len(self.own))))
                else:
                    self.op_extend(self.rng.choice([1, 1, 2, 3]))
                self.ops_done += 1
                if i % 200 == 0:
                    self.cache.check_invariants()
            for seq, _ in self.own:
                self.cache.release(seq)
            self.own.clear()
        except BaseException as exc:  # reported by the test in the main thread
            self.error = exc
            self.stop.set()


def run_stress(backend: str, discipline: str, num_threads: int = NUM_THREADS,
               num_ops: int = OPS_PER_THREAD) -> list[Worker]:
    cache = pk.PagedKVCache(NUM_LAYERS, 160, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                            backend=backend, hash_secret=b"threads")
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(n)] for n in (4, 8, 9, 16, 23, 32)]
    step_lock = (lambda: cache._lock) if discipline == "external" else contextlib.nullcontext
    stop = threading.Event()
    workers = [Worker(cache, prefixes, 100 + i, step_lock, stop, num_ops)
               for i in range(num_threads)]
    threads = [threading.Thread(target=w.run, name=f"worker-{i}") for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a worker hangs (deadlock?)"
    errors = [(i, w.error) for i, w in enumerate(workers) if w.error is not None]
    if errors:
        i, exc = errors[0]
        raise AssertionError(f"worker {i} failed after {workers[i].ops_done} operations "
                             f"({len(errors)} of {num_threads} workers failed): "
                             f"{type(exc).__name__}: {exc}") from exc
    cache.check_invariants()
    assert cache.pool.num_used == 0, "pages still referenced after every sequence was released"
    assert cache.stats.num_sequences == 0
    assert cache.stats.prefix_hit_tokens > 0, "threads never shared a page"
    return workers


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("discipline", ["external", "none"])
def test_threads_stress(backend: str, discipline: str):
    start = time.perf_counter()
    workers = run_stress(backend, discipline)
    ops = sum(w.ops_done for w in workers)
    rows = sum(w.rows_checked for w in workers)
    print(f"\n{discipline} step lock, {backend}: {NUM_THREADS} threads x {OPS_PER_THREAD} "
          f"operations = {ops} operations, {rows} gathered rows checked, "
          f"{time.perf_counter() - start:.1f} s")
    assert ops == NUM_THREADS * OPS_PER_THREAD


def _write_prefix_kv(cache: pk.PagedKVCache, plan: pk.Plan, tokens: list[int]) -> None:
    codes = prefix_codes(tokens)[int(plan.context_lens[0]):]
    for layer in range(cache.num_layers):
        cache.write(layer, plan, *kv_of(codes, layer, NUM_KV_HEADS, HEAD_DIM))


def _in_thread(fn) -> None:
    box: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=30)
    if box:
        raise box[0]


def test_plan_stays_valid_while_another_thread_extends_its_own_sequence():
    cache = pk.PagedKVCache(NUM_LAYERS, 16, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, backend="numpy")
    mine, theirs = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    a = cache.add_sequence(mine)
    cache.extend(a, mine)
    b = cache.add_sequence(theirs)
    cache.extend(b, theirs)
    plan = cache.plan([a])
    _in_thread(lambda: cache.extend(b, [10]))    # another thread, another sequence
    _write_prefix_kv(cache, plan, mine)            # raises StalePlanError today
    k, _ = cache.gather(0, plan, layout="BTHD")
    want_k, _ = kv_of(prefix_codes(mine), 0, NUM_KV_HEADS, HEAD_DIM)
    assert np.array_equal(k[0].view(np.uint32), want_k.view(np.uint32))


def test_pages_are_not_shared_before_their_writer_wrote_them():
    cache = pk.PagedKVCache(NUM_LAYERS, 16, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, backend="numpy")
    prompt = list(range(1, 10))                    # two full pages and one token
    a = cache.add_sequence(prompt)
    cache.extend(a, prompt)
    plan = cache.plan([a])                         # planned, not yet written
    seen = {}

    def other_thread():
        b = cache.add_sequence(prompt)
        seen["cached"] = b.num_cached_tokens
        cache.release(b)

    _in_thread(other_thread)
    _write_prefix_kv(cache, plan, prompt)
    assert seen["cached"] == 0, (
        f"another thread was served {seen['cached']} tokens whose K/V was not written yet")
    # Once written, the pages are shared.
    c = cache.add_sequence(prompt)
    cache.extend(c, prompt[c.num_cached_tokens:])
    assert c.num_cached_tokens == 8


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_large_moves_from_several_threads_on_separate_caches(backend: str):
    """Moves of a few MiB take the backends' multi-threaded paths; running
    them from several threads at once (one cache each, so nothing serialises
    them) must neither crash the thread pool nor mix up data."""
    num_threads, num_tokens = 4, 2048
    heads, dim = 4, 64                     # 2 MiB of K plus V per write in float32
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            cache = pk.PagedKVCache(1, num_tokens // 16 + 1, 16, heads, dim, backend=backend)
            seq = cache.add_sequence(list(range(num_tokens)))
            cache.extend(seq, list(range(num_tokens)))
            plan = cache.plan([seq])
            for _ in range(10):
                k = rng.standard_normal((num_tokens, heads, dim)).astype(np.float32)
                v = rng.standard_normal((num_tokens, heads, dim)).astype(np.float32)
                cache.write(0, plan, k, v)
                got_k, got_v = cache.gather(0, plan, layout="BTHD")
                assert np.array_equal(got_k[0].view(np.uint32), k.view(np.uint32))
                assert np.array_equal(got_v[0].view(np.uint32), v.view(np.uint32))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]


def test_ort_decoder_takes_requests_from_several_threads_while_stepping():
    """``OrtDecoder.add_request`` is documented as thread-safe: requests
    added from four threads while the main thread steps all finish, none is
    lost or run twice, and every page is back in the pool afterwards."""
    ort = pytest.importorskip("pagedkv_np.onnxruntime")
    from pagedkv_np.models.testmodel import build_model

    decoder = ort.OrtDecoder(build_model().SerializeToString(), num_pages=64, page_size=4,
                             max_batch_size=4, backend="numpy")
    num_threads, per_thread, max_new = 4, 5, 4
    rids: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(per_thread):
                prompt = [7, 3, 9, 1] + [rng.randrange(256) for _ in range(rng.randint(1, 6))]
                rid = decoder.add_request(prompt, max_new, salt=seed % 2)
                with lock:
                    rids.append(rid)
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (any(t.is_alive() for t in threads) or decoder.has_unfinished_requests()):
        decoder.step()
        assert time.monotonic() < deadline, "requests did not finish"
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(rids) == len(set(rids)) == num_threads * per_thread
    for rid in rids:
        assert decoder.is_finished(rid)
        assert 1 <= len(decoder.pop_output(rid)) <= max_new
    decoder.cache.check_invariants()
    assert decoder.cache.stats.pages_used == 0
