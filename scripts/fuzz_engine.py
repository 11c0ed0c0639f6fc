"""Fuzz OrtDecoder for a time budget: random settings, random traffic,
failures injected at random points, every token checked against a full
recompute.

Each run builds a decoder with random settings (family, page size, a pool
from just large enough to several times that, batch size, write interval,
store layout, NumPy or Numba backend, prefix reuse and partial page reuse on
or off), then serves random requests (shared system prompts, greedy or
seeded sampling, end tokens, requests joining while others run, aborts,
``generate`` calls) while wrapping the real session and cache methods to
fail now and then: the model call (``session.run``, ``run_with_iobinding``),
``gather``, ``extend``, ``extend_batch``, ``plan``, ``write`` and sampling,
with an ordinary exception or an interrupt (a ``BaseException``).

After every run it checks that

- every request that did not fail or was not aborted got exactly the tokens
  of a full recompute through another session of the same graph (up to its
  end token or ``max_new_tokens``), and every other one a prefix of them;
- every failure came back as a ``RequestFailed`` of exactly one request, in
  the step's ``errors`` and in ``status()``; nothing else escaped a call;
- nothing is left: no request queued or running, no page in use, no live
  sequence; the cache's invariants hold;
- the decoder then serves a clean request correctly.

Usage::

    python scripts/fuzz_engine.py --seconds 120 --seed 1

Prints one line per problem found and the summary
``fuzz_engine: N runs, M requests, F injected failures, W wrong tokens,
L leftover pages``; exits with status 1 if there was any problem.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402

from pagedkv_np import available_backends  # noqa: E402
from pagedkv_np.errors import ConfigError, RequestFailed  # noqa: E402
from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.onnxruntime.requests import Request  # noqa: E402
from pagedkv_np.onnxruntime.sampling import SamplingParams, sample  # noqa: E402
from pagedkv_np.models.testmodel import DecoderConfig, build_model  # noqa: E402

VARIANTS = {"optimum": dict(family="optimum"),
            "optimum-no-position-ids": dict(family="optimum", position_ids=False),
            "gqa": dict(family="gqa")}
MAX_POSITIONS = (4096, 64)      # the graph's table: ample, or a limit runs reach
BACKENDS = [b for b in ("numpy", "numba") if b in available_backends()]
POINTS = ("model", "gather", "extend", "extend_batch", "plan", "write", "sampling")
MAX_STEPS = 20_000


class InjectedInterrupt(BaseException):
    """An interrupt raised on purpose (not an Exception, like KeyboardInterrupt)."""


class InjectedFailure(RuntimeError):
    """An ordinary failure raised on purpose."""


class Model:
    """A test decoder's bytes and a no-cache reference through its own session."""

    def __init__(self, variant: str, max_positions: int) -> None:
        config = DecoderConfig(max_positions=max_positions)
        self.bytes = build_model(config, **VARIANTS[variant]).SerializeToString()
        self.max_positions = max_positions
        self.session = ort.InferenceSession(self.bytes, providers=["CPUExecutionProvider"])
        self.names = [a for a in self.session.get_inputs()]
        self.memo: dict[tuple, np.ndarray] = {}

    def logits(self, tokens: tuple) -> np.ndarray:
        if tokens not in self.memo:
            n = len(tokens)
            feeds = {"input_ids": np.array([tokens], np.int64),
                     "attention_mask": np.ones((1, n), np.int64)}
            for arg in self.names:
                if arg.name == "position_ids":
                    feeds[arg.name] = np.arange(n, dtype=np.int64)[None]
                elif arg.name.startswith("past_key_values."):
                    feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
                elif arg.name == "num_logits_to_keep":   # 0: every position
                    feeds[arg.name] = np.zeros(1, np.int64)
            self.memo[tokens] = self.session.run(["logits"], feeds)[0][0, -1]
        return self.memo[tokens]

    def expected(self, prompt: list[int], max_new: int, eos: frozenset, temperature: float,
                 seed: int | None) -> list[int]:
        """What the request must generate: greedy or seeded, cut after an end token."""
        params = SamplingParams(temperature)
        rng = None if params.greedy else np.random.default_rng(seed)
        seq, out = list(prompt), []
        for _ in range(max_new):
            tok = sample(self.logits(tuple(seq)), params, rng)
            out.append(tok)
            seq.append(tok)
            if tok in eos:
                break
        return out


class Injector:
    """Wraps the decoder's session and cache methods (and the sampler) to
    fail with probability ``rate`` per call while ``armed``."""

    def __init__(self, rng: np.random.Generator, rate: float, interrupt_share: float) -> None:
        self.rng, self.rate, self.interrupt_share = rng, rate, interrupt_share
        self.armed = True
        self.num_failures = 0
        self.num_interrupts = 0
        self.points = set(rng.choice(POINTS, size=rng.integers(1, len(POINTS) + 1),
                                     replace=False).tolist())
        self._real_choose = Request.choose

    def _maybe_fail(self, name: str) -> None:
        if self.armed and self.rng.random() < self.rate:
            self.num_failures += 1
            if self.rng.random() < self.interrupt_share:
                self.num_interrupts += 1
                raise InjectedInterrupt(f"injected interrupt in {name}")
            raise InjectedFailure(f"injected failure in {name}")

    def _wrap(self, obj, name: str) -> None:
        real = getattr(obj, name)

        def wrapped(*args, **kwargs):
            self._maybe_fail(name)
            return real(*args, **kwargs)
        setattr(obj, name, wrapped)

    def install(self, dec: OrtDecoder) -> None:
        if "model" in self.points:
            self._wrap(dec.session, "run")
            if dec.io.family == "gqa":
                self._wrap(dec.session, "run_with_iobinding")
        for point in ("gather", "extend", "extend_batch", "plan", "write"):
            if point in self.points:
                self._wrap(dec.cache, point)
        if "sampling" in self.points:
            real = self._real_choose

            def flaky(*args):
                self._maybe_fail("sample")
                return real(*args)
            Request.choose = flaky   # type: ignore[method-assign]

    def uninstall(self) -> None:
        Request.choose = self._real_choose   # type: ignore[method-assign]


class Totals:
    def __init__(self) -> None:
        self.runs = self.requests = self.failures = self.wrong = self.leftover = 0
        self.problems: list[str] = []
        self.counts = dict.fromkeys(("failed", "aborted", "interrupts", "num_batch_failures",
                                     "num_preemptions"), 0)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        print(f"problem {len(self.problems)}: {text}", flush=True)


def _prompts(rng: np.random.Generator, n: int) -> list[list[int]]:
    systems = [rng.integers(0, 256, int(rng.integers(1, 30))).tolist() for _ in range(2)]
    out = []
    for _ in range(n):
        head = systems[int(rng.integers(0, 2))] if rng.random() < 0.7 else []
        tail = rng.integers(0, 256, int(rng.integers(0 if head else 1, 20))).tolist()
        out.append(head + tail)
    return out


def one_run(rng: np.random.Generator, models: dict, totals: Totals, run_id: int) -> None:
    variant = str(rng.choice(list(VARIANTS)))
    model = models[variant, int(rng.choice(MAX_POSITIONS))]
    page_size = int(rng.choice([1, 2, 3, 4, 8, 16]))
    prompts = _prompts(rng, int(rng.integers(1, 9)))
    budgets = [int(rng.integers(1, 13)) for _ in prompts]
    longest = max(len(p) + m - 1 for p, m in zip(prompts, budgets))
    # from just enough for the longest request (preemptions) to ample
    num_pages = (-(-min(longest, model.max_positions) // page_size)
                 + int(rng.choice([0, 0, 1, 2, 4, 12])))
    settings = dict(num_pages=num_pages, page_size=page_size,
                    max_batch_size=int(rng.integers(1, 7)),
                    write_interval=int(rng.choice([1, 2, 3, 5, 16, 1000])),
                    layout=str(rng.choice(["HND", "NHD"])), backend=str(rng.choice(BACKENDS)),
                    enable_prefix_caching=bool(rng.random() < 0.8),
                    partial_page_reuse=bool(rng.random() < 0.6))
    if rng.random() < 0.2:
        settings["max_positions"] = int(rng.integers(8, 80))
    where = f"run {run_id} ({variant}, {settings})"
    dec = OrtDecoder(model.bytes, **settings)   # valid settings: a failure here is a bug
    injector = Injector(rng, float(rng.choice([0.0, 0.01, 0.05, 0.15])),
                        float(rng.choice([0.0, 0.2])))
    injector.install(dec)
    expected: dict[int, list[int]] = {}
    specs: dict[int, tuple] = {}
    reported: dict[int, int] = {}          # rid -> times in a step's finished
    errors: dict[int, RequestFailed] = {}
    try:
        queue = list(zip(prompts, budgets))
        eos_pool = model.expected(prompts[0], budgets[0], frozenset(), 0.0, None)
        use_generate = rng.random() < 0.25
        steps = 0
        while queue or dec.has_unfinished_requests():
            steps += 1
            if steps > MAX_STEPS:
                totals.problem(f"{where}: never finished")
                return
            if queue and (rng.random() < 0.5 or not dec.has_unfinished_requests()):
                p, m = queue.pop(0)
                temperature = float(rng.choice([0.0, 0.0, 0.9]))
                seed = int(rng.integers(0, 1000))
                eos = (frozenset([int(rng.choice(eos_pool))]) if rng.random() < 0.3
                       else frozenset())
                fed = len(p) + m - 1
                fits = (dec.max_positions is None or fed <= dec.max_positions) and \
                    -(-fed // page_size) <= num_pages
                if use_generate and rng.random() < 0.5:
                    _generate(dec, model, [p], m, eos, temperature, seed, fits, injector,
                              totals, where)
                    totals.requests += 1
                    continue
                try:
                    rid = dec.add_request(p, m, eos_token_id=eos, temperature=temperature,
                                          seed=seed)
                except ConfigError:
                    if fits:
                        totals.problem(f"{where}: a request that fits was refused")
                    continue
                if not fits:
                    totals.problem(f"{where}: a request past the limits was accepted")
                totals.requests += 1
                specs[rid] = (p, m, eos, temperature, seed)
                expected[rid] = model.expected(p, m, eos, temperature, seed)
            if specs and rng.random() < 0.05:
                victim = int(rng.choice(list(specs)))
                if not dec.is_finished(victim):
                    injector.armed = False      # abort's own writes are not a test point
                    dec.abort(victim)
                    injector.armed = True
            try:
                events = dec.step()
            except InjectedInterrupt:
                dec.cache.check_invariants()
                continue
            for rid in events.finished:
                reported[rid] = reported.get(rid, 0) + 1
            if not set(events.errors) <= events.finished:
                totals.problem(f"{where}: errors outside finished")
            errors.update(events.errors)
        injector.armed = False
        events = dec.step()       # reports what ended since the last step (an abort)
        for rid in events.finished:
            reported[rid] = reported.get(rid, 0) + 1
        errors.update(events.errors)
        for rid, (_, _, eos, _, _) in specs.items():
            status = dec.status(rid)
            out = dec.pop_output(rid)
            totals.counts["failed"] += status.finish_reason == "error"
            totals.counts["aborted"] += status.finish_reason == "abort"
            want = expected[rid]
            if reported.get(rid, 0) != 1:
                totals.problem(f"{where}: request {rid} reported finished "
                               f"{reported.get(rid, 0)} times")
            if status.finish_reason in ("error", "abort"):
                ok = out == want[:len(out)]
                if status.finish_reason == "error" and (rid not in errors or
                                                        status.error is not errors[rid]):
                    totals.problem(f"{where}: request {rid} failed without its event")
            else:
                ok = out == want and status.finish_reason == (
                    "stop" if want and want[-1] in eos else "length")
            if not ok:
                totals.wrong += 1
                totals.problem(f"{where}: request {rid} ({status.finish_reason}) got {out}, "
                               f"expected {want}")
        _check_idle(dec, totals, where)
        # the decoder still serves, correctly
        room = min(dec.max_positions or 4096, num_pages * page_size)
        p = prompts[-1][:max(1, min(20, room // 2))]
        m = max(1, min(4, room - len(p) + 1))
        got = dec.generate([p], max_new_tokens=m)
        if got != [model.expected(p, m, frozenset(), 0.0, None)]:
            totals.wrong += 1
            totals.problem(f"{where}: a clean request after the run got wrong tokens")
        _check_idle(dec, totals, where)
    except Exception:
        totals.problem(f"{where}: {traceback.format_exc(limit=8)}")
    finally:
        injector.uninstall()
        totals.failures += injector.num_failures
        totals.counts["interrupts"] += injector.num_interrupts
        for key in ("num_batch_failures", "num_preemptions"):
            totals.counts[key] += dec.stats[key]
        totals.runs += 1


def _generate(dec, model, prompts, m, eos, temperature, seed, fits, injector, totals,
              where) -> None:
    try:
        outs = dec.generate(prompts, max_new_tokens=m, eos_token_id=eos,
                            temperature=temperature, seed=seed)
    except ConfigError:
        if fits:
            totals.problem(f"{where}: generate refused a request that fits")
        return
    except (RequestFailed, InjectedInterrupt):
        return    # what is left behind is checked at the end of the run
    if not fits:
        totals.problem(f"{where}: generate accepted a request past the limits")
    seeds = np.random.SeedSequence(seed).spawn(len(prompts)) if temperature else [None]
    for p, out, s in zip(prompts, outs, seeds):
        if out != model.expected(p, m, eos, temperature, s):
            totals.wrong += 1
            totals.problem(f"{where}: generate got {out}")


def _check_idle(dec: OrtDecoder, totals: Totals, where: str) -> None:
    stats = dec.stats
    left = stats["pages_used"]
    if left or dec.has_unfinished_requests() or dec.cache.stats.num_sequences:
        totals.leftover += max(left, 1)
        totals.problem(f"{where}: left behind {left} pages, running "
                       f"{stats['num_running']}, waiting {stats['num_waiting']}")
    dec.cache.check_invariants()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole run")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    models = {(v, n): Model(v, n) for v in VARIANTS for n in MAX_POSITIONS}
    totals = Totals()
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        one_run(rng, models, totals, totals.runs)
    elapsed = time.perf_counter() - start
    print(f"fuzz_engine: {totals.runs} runs, {totals.requests} requests, {totals.failures} "
          f"injected failures, {totals.wrong} wrong tokens, {totals.leftover} leftover pages "
          f"({elapsed:.0f} s, seed {args.seed}, backends {BACKENDS}, "
          f"{len(totals.problems)} problem(s))")
    c = totals.counts
    print(f"  requests failed {c['failed']}, aborted {c['aborted']}; injected interrupts "
          f"{c['interrupts']}; failed batch steps {c['num_batch_failures']}; preemptions "
          f"{c['num_preemptions']}")
    return 1 if totals.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
