"""The benchmark scripts (``scripts/bench_*.py``, ``scripts/quant_quality.py``)
still start: each answers ``--help``, and the two sections that need no
model and little time run through.

Their figures depend on the machine; nothing here asserts one. The long runs
themselves are for people (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCH_SCRIPTS = sorted(SCRIPTS.glob("bench_*.py")) + [SCRIPTS / "quant_quality.py"]


def run_script(path: Path, *args: str, timeout: float = 300) -> str:
    return _run([str(path), *args], timeout)


def run_script_code(code: str, *args: str, timeout: float = 300) -> str:
    return _run(["-c", code, *args], timeout)


def _run(args: list[str], timeout: float) -> str:
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


# Every script's --help in one process: the imports they share (NumPy, Numba,
# onnxruntime) take most of the time, and are paid once.
_HELP = r"""
import contextlib, io, json, runpy, sys
answers = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out, status = io.StringIO(), "returned"
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
    answers[path] = [status, out.getvalue()]
print(json.dumps(answers))
"""


def test_each_script_answers_help():
    answers = json.loads(run_script_code(_HELP, *map(str, BENCH_SCRIPTS)).splitlines()[-1])
    assert len(answers) == len(BENCH_SCRIPTS) > 10
    for path in BENCH_SCRIPTS:
        status, out = answers[str(path)]
        assert status == 0, (path.name, status, out)
        assert out.startswith(f"usage: {path.name}"), (path.name, out)


def test_quant_quality_groups_needs_no_model():
    out = run_script(SCRIPTS / "quant_quality.py", "--only", "groups").splitlines()
    assert out[0].startswith("RMS error / RMS signal, 4096 tokens x 8 x 128")
    rows = {line.split()[0]: [float(x) for x in line.split()[-3:]] for line in out[2:]}
    assert set(rows) == {"32", "64", "128", "float16"}
    # a smaller group costs more bytes and errs less, on K with outliers most of all
    assert rows["32"][0] > rows["64"][0] > rows["128"][0]
    assert rows["32"][1] < rows["64"][1] < rows["128"][1]
    assert rows["float16"][0] == 2.0 and rows["float16"][1] < rows["32"][1]


def test_tiers_store_section_runs_in_rounds(tmp_path):
    out = run_script(SCRIPTS / "bench_tiers.py", "--only", "store", "--quick", "--pages", "4",
                     "--workdir", str(tmp_path))
    assert out.startswith("== store")
    figures = json.loads(out[out.index("{"):])
    assert figures["pages"] == 4 and figures["copy_GBps"] > 0
    for store in ("sqlite", "files"):
        assert figures[store]["write_GBps"] > 0 and figures[store]["read_GBps"] > 0


def test_llamacpp_tg_depths_are_checked_before_anything_runs():
    """``--tg-depths``: non-negative token counts, else exit 2 with a message
    (argparse's), before any server, build or model is touched."""
    for bad in ("0,-1", "x", ",", ""):
        proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_llamacpp.py"), "--quick",
                               "--tg-depths", bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (bad, proc.stderr[-2000:])
        assert "expected depths such as 0,2048,4096" in proc.stderr


_PEER_FAILURE = r"""
import importlib.util, json, signal, subprocess, sys
spec = importlib.util.spec_from_file_location("bench_llamacpp", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
crash = subprocess.run([sys.executable, "-c",
                        "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
status = subprocess.run([sys.executable, "-c", "raise SystemExit(3)"])
print(json.dumps([crash.returncode, module.peer_failure("llama-bench", crash.returncode, False),
                  module.peer_failure("llama-bench", crash.returncode, True),
                  module.peer_failure("llama-server", status.returncode, False)]))
"""


def test_a_peer_killed_by_a_signal_is_named_with_the_repack_hint():
    """A llama.cpp tool that a signal ends (its repacked path's SIGSEGV on
    some Xeons) is reported by the signal's name, with the way out unless
    ``--no-repack`` was given; a plain exit status as it is."""
    code, default, no_repack, plain = json.loads(run_script_code(
        _PEER_FAILURE, str(SCRIPTS / "bench_llamacpp.py")).splitlines()[-1])
    assert code == -11
    assert default.startswith("llama-bench was killed by SIGSEGV") and "--no-repack" in default
    assert no_repack == "llama-bench was killed by SIGSEGV"
    assert plain == "llama-server exited with status 3"


def test_kv_dtypes_quick_prints_every_dtype_and_refuses_bad_depths():
    out = run_script(SCRIPTS / "bench_kv_dtypes.py", "--quick").splitlines()
    rows = [line.split() for line in out if line.startswith(("gemma3-270m", "smollm2-135m"))]
    assert [row[:2] for row in rows] == [["gemma3-270m", "512"], ["smollm2-135m", "512"]]
    for row in rows:      # depth, then a time and a ratio per dtype, float32's ratio 1
        assert len(row) == 2 + 2 * 5 and row[3] == "1.00x"
        assert all(float(ms) > 0 for ms in row[2::2])
    for bad in ("0,-1", "x", ""):
        proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_kv_dtypes.py"),
                               "--depths", bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (bad, proc.stderr[-2000:])
        assert "--depths" in proc.stderr or "depths must be" in proc.stderr
