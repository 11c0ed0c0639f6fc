"""The disk tier under OrtDecoder with a tiny random model: the same greedy
tokens with the tier on and off and as a full recompute, across a restart
in this process and in another one, and through faults (damaged entries, a
full disk, a writer killed with SIGKILL, two processes writing the same
pages at once), each with no wrong token and no crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnxruntime as ort
import pytest

from pagedkv_np.onnxruntime import OrtDecoder
from pagedkv_np.models.testmodel import DecoderConfig, build_model, save_model
from pagedkv_np.tiers import decode_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = DecoderConfig()
PAGE, NEW = 8, 12
_rng = np.random.default_rng(77)
SYSTEM = _rng.integers(0, CONFIG.vocab_size, 45).tolist()        # 5 full pages and 5 tokens
PROMPTS = [SYSTEM + _rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 11, 20)]
OTHERS = [_rng.integers(0, CONFIG.vocab_size, 30).tolist() for _ in range(12)]


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "decoder.onnx")
    save_model(build_model(CONFIG), path)
    return path


_REFS: dict = {}


def reference(model_path, prompt, n=NEW):
    """Greedy by recomputing the whole sequence for every token (no cache)."""
    key = (model_path, tuple(prompt), n)
    if key not in _REFS:
        sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
        tokens, out = list(prompt), []
        for _ in range(n):
            t = len(tokens)
            feeds = {"input_ids": np.array([tokens], np.int64),
                     "attention_mask": np.ones((1, t), np.int64)}
            for arg in sess.get_inputs():
                if arg.name == "position_ids":
                    feeds[arg.name] = np.arange(t, dtype=np.int64)[None]
                elif arg.name.startswith("past_key_values."):
                    feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
                elif arg.name == "num_logits_to_keep":   # 0: every position
                    feeds[arg.name] = np.zeros(1, np.int64)
            tok = int(np.argmax(sess.run(["logits"], feeds)[0][0, -1]))
            out.append(tok)
            tokens.append(tok)
        _REFS[key] = out
    return _REFS[key]


def decoder(model_path, directory=None, **kw):
    kw.setdefault("num_pages", 64)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_size", 4)
    if directory is not None:
        kw["disk_cache"] = str(directory)
    return OrtDecoder(model_path, **kw)


def disk_stats(dec):
    return dec.cache.stats.tiers["disk"]


DRIVER = textwrap.dedent("""
    import json, sys, resource, signal
    import numpy as np
    from pagedkv_np.onnxruntime import OrtDecoder
    args = json.loads(sys.argv[1])
    if args.get("fsize"):          # a disk that fills up: writes past this size fail
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize"], args["fsize"]))
    dec = OrtDecoder(args["model"], num_pages=args.get("num_pages", 64), page_size=args["page"],
                     max_batch_size=4, disk_cache=args["dir"], **args.get("kw", {}))
    outs = []
    for round_ in range(args.get("rounds", 1)):
        prompts = args["prompts"]
        if args.get("fresh"):      # new prompts every round: new pages to write
            rng = np.random.default_rng(round_)
            prompts = [rng.integers(0, 256, 30).tolist() for _ in range(4)]
        for p in prompts:
            outs.append(dec.generate([p], args["new"])[0])
            if args.get("announce"):
                print("step", flush=True)
    dec.cache.tiers.flush(30)
    print(json.dumps({"outs": outs, "stats": dec.cache.stats.tiers}), flush=True)
""")


def run_driver(model_path, directory, prompts, timeout=240, **extra):
    args = dict(model=model_path, dir=str(directory), page=PAGE, new=NEW, prompts=prompts,
                **extra)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(directory):
    root = os.path.join(str(directory), "pages-v1")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".page"))


# -------------------------------------------------------------- equality
def test_tokens_equal_with_the_tier_on_and_off_and_a_recompute(model_path, tmp_path):
    off = decoder(model_path).generate(PROMPTS, NEW)
    on = decoder(model_path, tmp_path).generate(PROMPTS, NEW)
    assert on == off == [reference(model_path, p) for p in PROMPTS]


def test_a_restarted_decoder_reads_the_system_prompt_from_disk(model_path, tmp_path):
    first = decoder(model_path, tmp_path)
    assert first.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
    assert first.cache.tiers.flush(30)
    written = disk_stats(first)["pages_written"]
    assert written >= 5
    second = decoder(model_path, tmp_path)
    outs = second.generate(PROMPTS[1:], NEW)
    assert outs == [reference(model_path, p) for p in PROMPTS[1:]]
    s = second.stats
    assert s["tier_disk_hits"] >= 5 and s["tier_disk_rejected"] == 0
    # the first request was served the 5 system pages from disk
    assert s["prefix_hit_tokens"] >= 5 * PAGE


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_gqa_model_restarts_from_disk(tmp_path, layout):
    path = str(tmp_path / "gqa.onnx")
    save_model(build_model(CONFIG, family="gqa"), path)
    first = decoder(path, tmp_path / "d", layout=layout)
    assert first.generate(PROMPTS[:1], NEW) == [reference(path, PROMPTS[0])]
    first.cache.tiers.flush(30)
    second = decoder(path, tmp_path / "d", layout=layout)
    assert second.generate(PROMPTS[1:], NEW) == [reference(path, p) for p in PROMPTS[1:]]
    assert disk_stats(second)["hits"] >= 5


def test_a_restart_in_another_process(model_path, tmp_path):
    child = run_driver(model_path, tmp_path, PROMPTS[:1])
    assert child["outs"] == [reference(model_path, PROMPTS[0])]
    assert child["stats"]["disk"]["pages_written"] >= 5
    dec = decoder(model_path, tmp_path)
    assert dec.generate(PROMPTS[1:2], NEW) == [reference(model_path, PROMPTS[1])]
    assert disk_stats(dec)["hits"] >= 5
    # and back: a second child reads what this process wrote
    dec.cache.tiers.flush(30)
    again = run_driver(model_path, tmp_path, PROMPTS[1:2])
    assert again["outs"] == [reference(model_path, PROMPTS[1])]
    assert again["stats"]["disk"]["hits"] >= 6


def test_another_model_file_never_loads_these_pages(model_path, tmp_path):
    first = decoder(model_path, tmp_path)
    first.generate(PROMPTS[:1], NEW)
    first.cache.tiers.flush(30)
    other = str(tmp_path / "other.onnx")
    save_model(build_model(CONFIG, seed=1), other)
    dec = decoder(other, tmp_path)
    dec.generate(PROMPTS[:1], NEW)
    assert disk_stats(dec)["hits"] == 0


def test_a_pool_four_times_too_small_hits_more_with_the_disk_tier(model_path, tmp_path):
    prompts = [_rng.integers(0, CONFIG.vocab_size, 33).tolist() for _ in range(8)]
    # 8 prefixes of 4 full pages each: 32 pages of prefix for a pool of 8+
    rates = {}
    for label, directory in (("ram", None), ("disk", tmp_path)):
        dec = decoder(model_path, directory, num_pages=10, max_batch_size=1)
        outs = []
        for _ in range(2):
            for p in prompts:
                outs.append(dec.generate([p], 4)[0])
                if directory is not None:
                    dec.cache.tiers.flush(30)
        assert outs == [reference(model_path, p, 4) for p in prompts] * 2
        rates[label] = dec.stats["prefix_hit_rate"]
    assert rates["ram"] == 0.0
    assert rates["disk"] > 0.4


# ---------------------------------------------------------------- faults
@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_entries_are_never_served(model_path, tmp_path, damage):
    first = decoder(model_path, tmp_path)
    first.generate(PROMPTS[:1], NEW)
    first.cache.tiers.flush(30)
    files = entries(tmp_path)
    assert len(files) >= 5
    rng = np.random.default_rng(5)
    for path in files:
        blob = bytearray(read(path))
        if damage == "truncate":
            blob = blob[:int(rng.integers(1, len(blob)))]
        elif damage == "flip":
            i = int(rng.integers(0, len(blob)))
            blob[i] ^= 1 << int(rng.integers(0, 8))
        elif damage == "garbage":
            blob = bytearray(rng.integers(0, 256, len(blob), dtype=np.uint8).tobytes())
        else:
            blob = bytearray()
        with open(path, "wb") as f:
            f.write(blob)
    dec = decoder(model_path, tmp_path)
    assert dec.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]
    s = disk_stats(dec)
    assert s["hits"] == 0 and s["rejected"] >= 1 and s["errors"] == 0


def test_a_tiny_disk_bound_keeps_the_bytes_and_the_tokens(model_path, tmp_path):
    page_bytes = 2 * CONFIG.num_layers * PAGE * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    bound = 3 * page_bytes          # fewer pages than one system prompt
    dec = decoder(model_path, tmp_path, disk_cache_bytes=bound)
    assert dec.generate(PROMPTS + OTHERS[:4], NEW)[:3] == [reference(model_path, p)
                                                           for p in PROMPTS]
    dec.cache.tiers.flush(30)
    assert sum(os.path.getsize(p) for p in entries(tmp_path)) <= bound
    again = decoder(model_path, tmp_path, disk_cache_bytes=bound)
    assert again.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]
    tiny = decoder(model_path, tmp_path / "tiny", disk_cache_bytes=100)   # holds no entry
    assert tiny.generate(PROMPTS[:1], NEW) == [reference(model_path, PROMPTS[0])]
    tiny.cache.tiers.flush(30)
    s = disk_stats(tiny)
    assert s["pages_written"] == 0 and s["drops"] >= 5


def test_a_full_disk_fails_writes_not_requests(model_path, tmp_path):
    """RLIMIT_FSIZE makes every write past 4 KB fail with EFBIG, as a full
    disk fails with ENOSPC: writes are counted as errors, tokens are right."""
    child = run_driver(model_path, tmp_path, PROMPTS, fsize=4096)
    assert child["outs"] == [reference(model_path, p) for p in PROMPTS]
    s = child["stats"]["disk"]
    assert s["errors"] >= 1 and s["pages_written"] == 0
    assert [p for p in entries(tmp_path) if os.path.getsize(p) > 4096] == []
    dec = decoder(model_path, tmp_path)
    assert dec.generate(PROMPTS, NEW) == [reference(model_path, p) for p in PROMPTS]


def test_a_writer_killed_mid_write_leaves_nothing_wrong(model_path, tmp_path):
    args = dict(model=model_path, dir=str(tmp_path), page=PAGE, new=NEW,
                prompts=[], rounds=10_000, fresh=True)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(entries(tmp_path)) < 12 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        seen = len(entries(tmp_path))
        assert seen >= 12
        while len(entries(tmp_path)) == seen and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(entries(tmp_path)) > seen          # still writing: kill it now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    # a torn entry like one a crash could leave without the rename: cut short
    victim = entries(tmp_path)[0]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 3)
    valid = 0
    for path in entries(tmp_path):
        try:
            decode_page(read(path))
            valid += 1
        except ValueError:
            pass
    assert valid == len(entries(tmp_path)) - 1        # only the one cut by hand is bad
    dec = decoder(model_path, tmp_path)
    rng = np.random.default_rng(0)      # the killed writer's first round
    prompts = [rng.integers(0, 256, 30).tolist() for _ in range(4)] + PROMPTS
    assert dec.generate(prompts, NEW) == [reference(model_path, p) for p in prompts]
    assert disk_stats(dec)["hits"] >= 3


def test_two_processes_writing_the_same_pages_at_once(model_path, tmp_path):
    args = dict(model=model_path, dir=str(tmp_path), page=PAGE, new=NEW,
                prompts=PROMPTS + OTHERS[:4], rounds=2)
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    want = [reference(model_path, p) for p in PROMPTS + OTHERS[:4]] * 2
    for r in results:
        assert r["outs"] == want
        assert r["stats"]["disk"]["rejected"] == 0 and r["stats"]["disk"]["errors"] == 0
    for path in entries(tmp_path):
        decode_page(read(path))       # every entry whole
    dec = decoder(model_path, tmp_path)
    assert dec.generate(PROMPTS, NEW) == want[:3]
    assert disk_stats(dec)["hits"] >= 5 and disk_stats(dec)["rejected"] == 0


BAD = [
    (dict(disk_cache=3), "DTypeError", "disk_cache"),
    (dict(disk_cache="{file}/sub"), "ConfigError", "disk_cache"),
    (dict(disk_cache="{dir}", disk_cache_bytes=-1), "ConfigError", "disk_cache_bytes"),
    (dict(disk_cache_bytes=1 << 20), "ConfigError", "disk_cache_bytes"),
    (dict(redis_url="localhost:6379", hash_secret=b"s"), "ConfigError", "redis_url"),
    (dict(redis_url="redis://127.0.0.1:1/0"), "ConfigError", "hash_secret"),
    (dict(disk_cache="{dir}", tier_options={"queue_size": 0}), "ConfigError", "queue_size"),
]


@pytest.mark.parametrize("kw,err,match", BAD)
def test_bad_tier_arguments_of_the_decoder(model_path, tmp_path, kw, err, match):
    import pagedkv_np.errors as errors
    (tmp_path / "f").write_bytes(b"x")
    kw = {k: v.format(file=tmp_path / "f", dir=tmp_path / "d") if isinstance(v, str) else v
          for k, v in kw.items()}
    with pytest.raises(getattr(errors, err), match=match):
        decoder(model_path, **kw)


def test_int8_pages_restart_from_disk(model_path, tmp_path):
    """int8 pages (codes and scales) come back bit for bit: a restarted
    decoder answers exactly as one that kept them in RAM. (With int8 pages
    an answer depends on which tokens came from pages, so both run without
    partial page reuse, which tiers do not serve: full pages only.)"""
    ram = decoder(model_path, kv_dtype="int8", partial_page_reuse=False)
    want = [ram.generate([p], NEW)[0] for p in PROMPTS]
    first = decoder(model_path, tmp_path, kv_dtype="int8", partial_page_reuse=False)
    assert first.generate(PROMPTS[:1], NEW) == want[:1]
    first.cache.tiers.flush(30)
    second = decoder(model_path, tmp_path, kv_dtype="int8", partial_page_reuse=False)
    assert second.generate(PROMPTS[1:], NEW) == want[1:]
    assert disk_stats(second)["hits"] >= 5
    float_pages = decoder(model_path, tmp_path)      # another page format: never loaded
    float_pages.generate(PROMPTS[1:2], NEW)
    assert disk_stats(float_pages)["hits"] == 0


def test_the_model_fingerprint_is_hashed_once_and_follows_the_file(tmp_path):
    from pagedkv_np.tiers.fingerprint import weights_digest
    path = str(tmp_path / "m.onnx")
    save_model(build_model(CONFIG), path)
    first = decoder(path, tmp_path / "d")
    (memo,) = [json.loads(p.read_text()) for p in (tmp_path / "d" / "digests").iterdir()]
    import hashlib
    with open(path, "rb") as f:
        assert memo["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert weights_digest(path, None) == weights_digest(path, str(tmp_path / "d"))
    first.generate(PROMPTS[:1], NEW)
    first.cache.tiers.flush(30)
    # the same path, other weights of the same size: a new fingerprint, no hit
    save_model(build_model(CONFIG, seed=7), path)
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    second = decoder(path, tmp_path / "d")
    assert second.cache.tiers.model_id != first.cache.tiers.model_id
    assert second.generate(PROMPTS[:1], NEW) == [reference(path, PROMPTS[0])]
    assert disk_stats(second)["hits"] == 0
