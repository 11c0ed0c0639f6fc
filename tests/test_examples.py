"""The examples run, and say what their loops must give."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                          text=True, timeout=300, check=False)
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
