"""A fuzz target over the public API: random call sequences, often-invalid arguments.

:class:`ApiFuzz` is a Hypothesis state machine over one small
:class:`PagedKVCache` (random backend, dtype, layout, page size and pool
size, so pages run out and cached prefixes are evicted), a seed-compatible
:class:`PagedCache`, a bare :class:`PagePool` and the backends' kernels. Its
rules mix

* valid work: add / extend / fork / release sequences and run steps (plan,
  write every layer, gather every layer into fresh or reused, dirty buffers),
  checking every gathered row bit for bit against a function of the
  sequence's prefix;
* calls with at least one invalid argument, which must raise a
  :class:`PagedKVError` and change nothing (pool, index, store, sequences);
* calls with random arguments, valid or not, where any outcome is fine
  except an exception that is not a :class:`PagedKVError`, and a failed call
  must change nothing;
* the same random kernel call on the chosen backend and on the NumPy
  reference, which must fail alike or produce the same bits.

After every rule the invariants of every structure hold.

``test_fuzz`` runs a small, fixed number of examples; ``scripts/fuzz.py
--seconds 60`` runs the same machine for a time budget.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv_np as pk
from pagedkv_np.errors import OutOfPages, PagedKVError
from pagedkv_np.pool import PagePool

import helpers
from helpers import bits, deep_state, prefix_codes

NUM_KV_HEADS, HEAD_DIM = 2, 3
BACKENDS = [name for name in pk.available_backends() if name in ("numpy", "numba")]
DTYPES = ["float32", "float16", "bfloat16"]

DOCUMENTS = [[(7 * d + 3 * i) % 11 for i in range(24)] for d in range(3)]
VALID_SALTS = [None, "a", b"a", 1, np.int64(3)]
INVALID_SALTS = [1.5, [1], True, np.bool_(True), bytearray(b"a"), object()]
INVALID_TOKENS = [
    None, "abc", b"ab", 3, 2.5, [1.5], np.array([1.0]), [True], np.array([True, False]),
    [[1, 2]], np.ones((2, 2), np.int64), np.array(5), np.array([1, 2], dtype=object),
    [2**63], [2**70], np.array([2**63], np.uint64), [-1], [1, None], [1, "2"],
    [np.float32(1)], np.array(["1"]), object(),
]
INVALID_PROMPTS = INVALID_TOKENS + [[], np.zeros(0, np.int64)]
INVALID_COUNTS = [None, "3", 2.5, np.float64(2.0), [1], True]
# None is not here: gather(layout=None) is the cache's gather_layout
INVALID_LAYOUTS = ["XYZ", 3, "BHT", b"BHTD"]
GARBAGE = [None, -1, 0, 1, 2**40, 1.5, "x", [], [[1]], np.array([1.0]), np.zeros((2, 2)),
           np.array([-1], np.int32), True, object()]


def kv_of(codes: np.ndarray, layer: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """[len(codes), NUM_KV_HEADS, HEAD_DIM] K and V of ``dtype`` (any bit pattern)."""
    return helpers.kv_of(codes, layer, NUM_KV_HEADS, HEAD_DIM, dtype)


def _short(args: tuple) -> str:
    """``args`` for a message: arrays by shape and dtype, the rest by repr."""
    parts = []
    for a in args:
        if isinstance(a, np.ndarray):
            parts.append(f"ndarray({list(a.shape)}, {a.dtype})")
        elif isinstance(a, pk.Plan):
            parts.append(f"Plan(seqs={list(a.seq_ids)})")
        else:
            parts.append(repr(a)[:60])
    return "(" + ", ".join(parts) + ")"


# ------------------------------------------------------------------- machine
class ApiFuzz(RuleBasedStateMachine):
    """See the module docstring."""

    num_examples = 0      # machines built (one per example), for the fuzz script's report
    num_calls = 0         # public calls made

    def __init__(self) -> None:
        super().__init__()
        type(self).num_examples += 1
        self.cache = None

    # --------------------------------------------------------------- setup
    @initialize(backend=st.sampled_from(BACKENDS), dtype=st.sampled_from(DTYPES),
                layout=st.sampled_from(["NHD", "HND"]), page_size=st.sampled_from([1, 2, 3, 4]),
                num_pages=st.integers(4, 14), num_layers=st.integers(1, 2))
    def setup(self, backend, dtype, layout, page_size, num_pages, num_layers):
        self.backend = pk.get_backend(backend)
        self.ref = pk.get_backend("numpy")
        self.cache = pk.PagedKVCache(num_layers, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM,
                                     dtype=dtype, layout=layout, backend=backend,
                                     hash_secret=b"fuzz")
        self.dtype = self.cache.dtype
        self.live: list[tuple[pk.Sequence, list[int]]] = []
        self.released: list[pk.Sequence] = []
        other = pk.PagedKVCache(1, 4, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype,
                                backend=backend)
        self.foreign_seq = other.add_sequence([1, 2])
        other.extend(self.foreign_seq, [1, 2])
        self.foreign_plan = other.plan([self.foreign_seq])
        self.stale_plans: list[pk.Plan] = []
        self.pool = PagePool(8)
        self.pc = pk.PagedCache(num_layers, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM,
                                dtype=dtype, backend=backend, hash_secret=b"fuzz")
        # Identical K/V stores for the kernel rule: one for the backend, one
        # for the reference; random bits, so a move from a wrong place shows.
        rng = np.random.default_rng(num_pages * 7 + page_size)
        self.bits_dtype = bits(np.zeros(1, self.dtype)).dtype
        k, v = (rng.integers(0, 2**16, size=self.cache.store.shape).astype(self.bits_dtype)
                .view(self.dtype) for _ in range(2))
        self.scratch = {"backend": (k, v), "reference": (k.copy(), v.copy())}

    # ------------------------------------------------------------- helpers
    def _call(self, fn, must_fail: bool, state, what: str = "") -> object:
        """Call ``fn``; a failure must be typed and leave ``state()`` as it was."""
        type(self).num_calls += 1
        before = state()
        try:
            result = fn()
        except PagedKVError as exc:
            after = state()
            assert after == before, f"a failed call ({type(exc).__name__}: {exc}) changed state"
            return exc
        except Exception as exc:  # the bug this target looks for
            raise AssertionError(f"untyped {type(exc).__name__} escaped: {exc}") from exc
        assert not must_fail, f"an invalid call was accepted: {what}"
        return result

    def _cache_call(self, fn, what: str, must_fail: bool = True):
        return self._call(fn, must_fail, lambda: deep_state(self.cache), what)

    def _tokens(self, data, max_len: int = 8) -> list[int]:
        doc = data.draw(st.sampled_from(DOCUMENTS))
        n = data.draw(st.integers(0, len(doc)))
        tail = data.draw(st.lists(st.integers(0, 12), min_size=0 if n else 1, max_size=max_len))
        return doc[:n] + tail

    def _step(self, items, data) -> None:
        """Plan, write every layer, gather every layer and check every row."""
        cache = self.cache
        type(self).num_calls += 1
        plan = cache.plan([seq for seq, _ in items])
        codes = [prefix_codes(tokens) for _, tokens in items]
        ctx = plan.context_lens
        for layer in range(cache.num_layers):
            parts = [kv_of(c[int(lo):], layer, self.dtype) for c, lo in zip(codes, ctx)]
            empty = np.zeros((0, NUM_KV_HEADS, HEAD_DIM), self.dtype)
            k = np.concatenate([p[0] for p in parts]) if parts else empty
            v = np.concatenate([p[1] for p in parts]) if parts else empty
            if data.draw(st.booleans()):  # a strided view, as a model's output often is
                k = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
            cache.write(layer, plan, k, v)
        layout = data.draw(st.sampled_from(["BHTD", "BTHD"]))
        max_len = max((len(c) for c in codes), default=0)
        extra = data.draw(st.integers(0, 3))
        for layer in range(cache.num_layers):
            if data.draw(st.booleans()):
                shape = ((len(items), NUM_KV_HEADS, max_len + extra, HEAD_DIM) if layout == "BHTD"
                         else (len(items), max_len + extra, NUM_KV_HEADS, HEAD_DIM))
                # Dirty buffers: gather must zero what it does not fill.
                out = tuple(np.full(shape, np.iinfo(self.bits_dtype).max, self.bits_dtype)
                            .view(self.dtype) for _ in range(2))
                k_out, v_out = cache.gather(layer, plan, layout=layout, out=out)
                assert k_out is out[0] and v_out is out[1]
            else:
                k_out, v_out = cache.gather(layer, plan, layout=layout,
                                            num_positions=max_len + extra)
            for b, c in enumerate(codes):
                want_k, want_v = kv_of(c, layer, self.dtype)
                n = len(c)
                got_k, got_v = (k_out[b, :, :n], v_out[b, :, :n]) if layout == "BHTD" else \
                    (k_out[b, :n].transpose(1, 0, 2), v_out[b, :n].transpose(1, 0, 2))
                assert np.array_equal(bits(got_k), bits(want_k.transpose(1, 0, 2))), \
                    f"K of sequence {items[b][0].seq_id}, layer {layer}"
                assert np.array_equal(bits(got_v), bits(want_v.transpose(1, 0, 2))), \
                    f"V of sequence {items[b][0].seq_id}, layer {layer}"
                tail = (k_out[b, :, n:], v_out[b, :, n:]) if layout == "BHTD" else \
                    (k_out[b, n:], v_out[b, n:])
                assert not bits(tail[0]).any() and not bits(tail[1]).any(), "padding not zero"

    def _pick(self, data) -> tuple[pk.Sequence, list[int]]:
        return self.live[data.draw(st.integers(0, len(self.live) - 1))]

    # ---------------------------------------------------------- valid work
    @rule(data=st.data())
    def add(self, data):
        prompt = self._tokens(data, max_len=data.draw(st.sampled_from([4, 8, 60])))
        salt = data.draw(st.sampled_from(VALID_SALTS))
        seq = self.cache.add_sequence(prompt, salt=salt)
        try:
            self.cache.extend(seq, prompt[seq.num_cached_tokens:])
        except OutOfPages:
            self.cache.release(seq)
            return
        self.live.append((seq, prompt))
        self._step([(seq, prompt)], data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def extend(self, data):
        items = []
        picked = [self._pick(data) for _ in range(data.draw(st.integers(1, 3)))]
        for seq, tokens in {id(seq): (seq, tokens) for seq, tokens in picked}.values():
            new = data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=6))
            try:
                self.cache.extend(seq, new)
            except OutOfPages:
                continue
            tokens.extend(new)
            items.append((seq, tokens))
        self._step(items, data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        seq, tokens = self._pick(data)
        child = self.cache.fork(seq)
        self.live.append((child, list(tokens)))
        self._step([self.live[-1]], data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        seq, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        plan = self.cache.plan([seq])          # nothing new to write; stale once released
        self.cache.release(seq)
        self.released.append(seq)
        self.stale_plans.append(plan)

    # --------------------------------------------------------- invalid calls
    def _seq_or_invalid(self, data, invalid: bool):
        if not invalid and self.live:
            return self._pick(data)[0]
        return data.draw(st.sampled_from([None, 0, "seq", self.foreign_seq, self.foreign_plan]
                                         + self.released[-2:]))

    @rule(data=st.data())
    def invalid_cache_call(self, data):
        cache = self.cache
        which = data.draw(st.sampled_from(
            ["add", "extend", "fork", "release", "plan", "write", "gather", "pages_needed"]))
        bad = data.draw(st.integers(0, 3))         # which argument is invalid
        mixed = lambda good, pool: (good() if data.draw(st.booleans())  # noqa: E731
                                    else data.draw(st.sampled_from(pool)))
        # A plan with no new tokens: current, nothing pending.
        plan = cache.plan(list({id(s): s for s, _ in self.live[:3]}.values()))
        seq_len = int(plan.seq_lens.max()) if plan.num_seqs else 0

        if which == "add":
            prompt = (data.draw(st.sampled_from(INVALID_PROMPTS)) if bad % 2 == 0
                      else self._tokens(data))
            salt = (data.draw(st.sampled_from(INVALID_SALTS)) if bad % 2 == 1
                    else mixed(lambda: None, INVALID_SALTS))
            call = lambda: cache.add_sequence(prompt, salt=salt)  # noqa: E731
            args = (prompt, salt)
        elif which == "extend":
            seq = self._seq_or_invalid(data, invalid=bad % 2 == 0)
            tokens = (data.draw(st.sampled_from(INVALID_TOKENS)) if bad % 2 == 1
                      else mixed(lambda: [1], INVALID_TOKENS))
            call = lambda: cache.extend(seq, tokens)  # noqa: E731
            args = (seq, tokens)
        elif which in ("fork", "release"):
            seq = self._seq_or_invalid(data, invalid=True)
            call = lambda: getattr(cache, which)(seq)  # noqa: E731
            args = (seq,)
        elif which == "plan":
            seqs = data.draw(st.sampled_from(
                [None, "ab", self.foreign_seq, [None], [self.foreign_seq], (s for s in []),
                 set(), [self.foreign_plan]]
                + ([self.live[0][0], [self.live[0][0]] * 2] if self.live else [])
                + ([[self.released[-1]]] if self.released else [])))
            call = lambda: cache.plan(seqs)  # noqa: E731
            args = (seqs,)
        elif which == "write":
            empty = np.zeros((plan.num_new_tokens, NUM_KV_HEADS, HEAD_DIM), self.dtype)
            bad_rows = [None, 1.0, empty.tolist(), empty.astype(np.float64), empty.astype(object),
                        np.zeros((plan.num_new_tokens + 1, NUM_KV_HEADS, HEAD_DIM), self.dtype),
                        np.zeros((plan.num_new_tokens, NUM_KV_HEADS + 1, HEAD_DIM), self.dtype)]
            layer = (data.draw(st.sampled_from([-1, cache.num_layers, 1.0, "0", None, True]))
                     if bad == 0 else 0)
            the_plan = (data.draw(st.sampled_from([None, "plan", self.foreign_plan]
                                                  + self.stale_plans[-2:]))
                        if bad == 1 else plan)
            k = data.draw(st.sampled_from(bad_rows)) if bad == 2 else empty
            v = data.draw(st.sampled_from(bad_rows)) if bad == 3 else empty
            call = lambda: cache.write(layer, the_plan, k, v)  # noqa: E731
            args = (layer, the_plan, k, v)
        elif which == "gather":
            layer, the_plan, layout, kw = 0, plan, "BHTD", {}
            if bad == 0:
                layer = data.draw(st.sampled_from([-1, cache.num_layers, 0.0, None]))
            elif bad == 1:
                the_plan = data.draw(st.sampled_from([None, self.foreign_plan]
                                                     + self.stale_plans[-2:]))
            elif bad == 2:
                layout = data.draw(st.sampled_from(INVALID_LAYOUTS))
            else:
                kw = data.draw(st.sampled_from(self._bad_gather_kwargs(plan, seq_len)))
            call = lambda: cache.gather(layer, the_plan, layout=layout, **kw)  # noqa: E731
            args = (layer, the_plan, layout, kw)
        else:
            seq = self._seq_or_invalid(data, invalid=bad % 2 == 0)
            count = data.draw(st.sampled_from(INVALID_COUNTS)) if bad % 2 == 1 else 1
            fn = data.draw(st.sampled_from([cache.num_pages_needed, cache.can_extend]))
            call = lambda: fn(seq, count)  # noqa: E731
            which, args = fn.__name__, (seq, count)
        self._cache_call(call, f"{which}{_short(args)}")

    def _bad_gather_kwargs(self, plan, seq_len) -> list[dict]:
        shape = (plan.num_seqs, NUM_KV_HEADS, seq_len + 1, HEAD_DIM)
        good = np.zeros(shape, self.dtype)
        ro = good.copy()
        ro.flags.writeable = False
        options = [
            {"num_positions": -1}, {"num_positions": 1.5}, {"num_positions": "3"},
            {"out": good}, {"out": (good.tolist(), good.copy())},
            {"out": (ro, good.copy())}, {"out": (good.astype(np.float64), good.copy())},
        ]
        if plan.num_seqs:  # empty buffers share nothing and are contiguous: valid
            options.append({"out": (good, good)})
            options.append({"out": (np.zeros(shape[:2] + (2 * shape[2],) + shape[3:],
                                             self.dtype)[:, :, ::2], good.copy())})
        if seq_len:
            options.append({"num_positions": seq_len - 1})
            short = (plan.num_seqs, NUM_KV_HEADS, seq_len - 1, HEAD_DIM)
            options.append({"out": (np.zeros(short, self.dtype), np.zeros(short, self.dtype))})
        return options

    # -------------------------------------------------- random calls, any outcome
    @rule(data=st.data())
    def pool_call(self, data):
        pool = self.pool
        ids = st.one_of(st.integers(-2, 9), st.sampled_from(GARBAGE))
        op = data.draw(st.sampled_from(["allocate", "free", "inc_ref", "touch", "mark_cached",
                                        "uncache", "ref_count", "can_allocate"]))
        if op in ("allocate", "can_allocate"):
            arg = data.draw(st.one_of(st.integers(-1, 10), st.sampled_from(GARBAGE)))
        elif op in ("free", "inc_ref"):
            arg = data.draw(st.one_of(st.lists(ids, max_size=4), st.sampled_from(GARBAGE)))
        else:
            arg = data.draw(ids)
        self._call(lambda: getattr(pool, op)(arg), False, lambda: deep_state(pool))

    @rule(data=st.data())
    def compat_call(self, data):
        pc, ps, num_pages = self.pc, self.cache.page_size, self.cache.num_pages
        page = st.one_of(st.integers(-2, num_pages), st.sampled_from(GARBAGE))
        tokens = st.one_of(st.lists(st.integers(0, 12), max_size=3 * ps + 1),
                           st.sampled_from(INVALID_TOKENS))
        table = st.one_of(
            st.lists(st.lists(st.integers(-2, num_pages), min_size=0, max_size=3),
                     min_size=1, max_size=2).filter(lambda rows: len({len(r) for r in rows}) == 1),
            st.sampled_from(GARBAGE + [[[0, 1], [2]]]))
        op = data.draw(st.sampled_from(["alloc", "alloc_n", "free", "inc_ref", "record_page",
                                        "lookup_prefix", "write", "gather", "view"]))
        if op == "alloc":
            call = pc.alloc
        elif op == "alloc_n":
            n = data.draw(st.one_of(st.integers(-1, num_pages + 1), st.sampled_from(GARBAGE)))
            call = lambda: pc.alloc_n(n)  # noqa: E731
        elif op in ("free", "inc_ref"):
            p = data.draw(page)
            call = lambda: getattr(pc, op)(p)  # noqa: E731
        elif op == "record_page":
            p, t = data.draw(page), data.draw(tokens)
            i = data.draw(st.one_of(st.integers(-1, 3), st.sampled_from(GARBAGE)))
            call = lambda: pc.record_page(p, t, i)  # noqa: E731
        elif op == "lookup_prefix":
            t = data.draw(tokens)
            call = lambda: pc.lookup_prefix(t)  # noqa: E731
        else:
            tab = data.draw(table)
            rows = len(tab) if isinstance(tab, list) else 1
            num_t = data.draw(st.integers(0, 2 * ps + 1))
            x = np.zeros((rows, num_t, NUM_KV_HEADS, HEAD_DIM), self.dtype)
            layer = data.draw(st.one_of(st.integers(-1, self.cache.num_layers),
                                        st.sampled_from(GARBAGE)))
            lens = data.draw(st.one_of(st.none(), st.lists(st.integers(-1, 3 * ps + 1),
                                                           min_size=rows, max_size=rows),
                                       st.sampled_from(GARBAGE)))
            if op == "write":
                start = data.draw(st.one_of(st.integers(-1, 3 * ps),
                                            st.lists(st.integers(-1, 3 * ps), min_size=rows,
                                                     max_size=rows),
                                            st.sampled_from(GARBAGE)))
                k = x if data.draw(st.booleans()) else data.draw(st.sampled_from(GARBAGE))
                call = lambda: pc.write(layer, tab, start, k, x, lengths=lens)  # noqa: E731
            elif op == "gather":
                call = lambda: pc.gather(layer, tab, seq_lens=lens)  # noqa: E731
            else:
                total = data.draw(st.one_of(st.none(), st.integers(-1, 3 * ps + 1),
                                            st.sampled_from(GARBAGE)))
                call = lambda: (pc.bind(tab, total_len=total, seq_lens=lens)  # noqa: E731
                                .gather(layer))
        self._call(call, False, lambda: deep_state(pc))

    @rule(data=st.data())
    def backend_call(self, data):
        """One random kernel call on the backend and on the NumPy reference."""
        store = self.cache.store
        num_pages, ps, layout = store.num_pages, store.page_size, store.layout
        idx = lambda lo, hi, n: np.array(  # noqa: E731
            data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int32)
        op = data.draw(st.sampled_from(["write", "gather", "copy_pages"]))
        args, kwargs = [], {"layout": layout}
        if op == "write":
            n = data.draw(st.integers(0, 6))
            slots = idx(-2, num_pages * ps + 1, n)
            if data.draw(st.integers(0, 3)) == 0:
                slots = slots.astype(np.int64)
            rng = np.random.default_rng(n)
            x = rng.integers(0, 2**16, size=(n, NUM_KV_HEADS, HEAD_DIM)).astype(
                bits(np.zeros(1, self.dtype)).dtype).view(self.dtype)
            args = [data.draw(st.integers(-1, store.num_layers)), slots, x, x[::-1].copy()]
        elif op == "gather":
            b, m = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
            table = idx(-2, num_pages, b * m).reshape(b, m)
            lens = idx(-1, m * ps + 1, b)
            args = [data.draw(st.integers(-1, store.num_layers)), table, lens]
            kwargs["out_layout"] = data.draw(st.sampled_from(["BTHD", "BHTD"]))
            if data.draw(st.booleans()):
                kwargs["num_positions"] = data.draw(st.integers(-1, m * ps + 2))
        else:
            n = data.draw(st.integers(0, 4))
            args = [idx(-1, num_pages, n), idx(-1, num_pages, n)]

        outcomes = []
        for backend, (k_cache, v_cache) in ((self.backend, self.scratch["backend"]),
                                            (self.ref, self.scratch["reference"])):
            try:
                result = getattr(backend, op)(k_cache, v_cache, *args, **kwargs)
            except PagedKVError as exc:
                outcomes.append(("error", type(exc)))
                continue
            except Exception as exc:
                raise AssertionError(f"{backend.name}.{op}: untyped {type(exc).__name__}: "
                                     f"{exc}") from exc
            outcomes.append(("ok", () if result is None else tuple(bits(r) for r in result)))
        assert [o[0] for o in outcomes] == [outcomes[1][0]] * 2, f"{op}: {outcomes}"
        if outcomes[0][0] == "error":
            assert outcomes[0][1] is outcomes[1][1], f"{op}: {outcomes}"
        else:
            for got, want in zip(outcomes[0][1], outcomes[1][1]):
                assert np.array_equal(got, want), f"{self.backend.name}.{op} differs from numpy"

    # ----------------------------------------------------------- invariants
    @invariant()
    def structures_agree(self):
        if self.cache is None:
            return
        self.cache.check_invariants()
        self.pool.check_invariants()
        self.pc.pool.check_invariants()
        self.pc._index.check_invariants()
        for a, b in zip(self.scratch["backend"], self.scratch["reference"]):
            assert np.array_equal(bits(a), bits(b)), "backend and reference stores differ"


# No shrinking: a failure is reported as found (its steps are printed), so a
# run stays within its budget even when it finds several bugs.
FUZZ_SETTINGS = dict(deadline=None, database=None, stateful_step_count=30,
                     phases=(Phase.explicit, Phase.generate),
                     suppress_health_check=list(HealthCheck))


def run_fuzz(max_examples: int, derandomize: bool = False) -> None:
    """Run ``max_examples`` random call sequences (raises on the first failure)."""
    run_state_machine_as_test(ApiFuzz, settings=settings(
        max_examples=max_examples, derandomize=derandomize, **FUZZ_SETTINGS))


def test_fuzz():
    start = ApiFuzz.num_examples
    run_fuzz(max_examples=30, derandomize=True)
    print(f"\nfuzz: {ApiFuzz.num_examples - start} examples, {ApiFuzz.num_calls} calls, "
          f"backends {BACKENDS}")
