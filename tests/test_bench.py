"""The ``pagedkv bench`` command: its records, table, plot, filters and errors.

Figures depend on the machine, so nothing here asserts a time; the tests
check that every record is complete and self-consistent and that the
standard cases are there.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from pagedkv_np import BackendUnavailable, available_backends, backends
from pagedkv_np.bench import FIELDS, OPS, copy_bandwidth, main, plot_gather

DATA_OPS = {"gather", "prefill_write", "decode_write", "copy_pages"}


def run_json(capsys, *args: str) -> list[dict]:
    assert main(["--quick", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


def positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_records() -> list[dict]:
    """One full ``pagedkv bench --quick --json`` run, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--quick", "--json"]) == 0
    return json.loads(out.getvalue())


def find(records, op, **want):
    return [r for r in records if r["op"] == op
            and all(r.get(k, r["params"].get(k)) == v for k, v in want.items())]


# --------------------------------------------------------------- records
def test_quick_json_is_a_list_of_complete_records(quick_records):
    assert isinstance(quick_records, list) and quick_records
    for rec in quick_records:
        assert set(rec) == set(FIELDS)
        assert rec["op"] in OPS
        assert isinstance(rec["params"], dict) and rec["params"]
        assert isinstance(rec["case"], str) and rec["case"]
        assert positive_finite(rec["seconds"])
        assert rec["us_per_call"] == pytest.approx(rec["seconds"] * 1e6)


def test_data_records_carry_bandwidth_and_copy_ratio(quick_records):
    data = [r for r in quick_records if r["op"] in DATA_OPS]
    assert data
    for rec in data:
        for key in ("gbps", "copy_gbps", "ratio", "bytes"):
            assert positive_finite(rec[key]), (key, rec)
        assert rec["backend"] in available_backends()
        assert rec["dtype"] in ("float32", "float16")
        assert rec["layout"] == "NHD" or (rec["op"], rec["layout"]) == ("gather", "HND")
        assert rec["copy_threads"] in (1, 2)
        assert rec["gbps"] == pytest.approx(rec["bytes"] / rec["seconds"] / 1e9)
        assert rec["ratio"] == pytest.approx(rec["gbps"] / rec["copy_gbps"])
        assert positive_finite(rec["ratio_median"]), rec
        assert rec["rate"] is None and rec["rate_unit"] is None


def test_pool_and_prefix_records_carry_a_rate(quick_records):
    rest = [r for r in quick_records if r["op"] not in DATA_OPS]
    assert {r["op"] for r in rest} == {"alloc_free", "prefix_lookup"}
    for rec in rest:
        assert positive_finite(rec["rate"])
        assert rec["rate"] == pytest.approx(
            (rec["params"]["num_tokens"] if rec["op"] == "prefix_lookup" else 1) / rec["seconds"])
        assert rec["rate_unit"] == {"alloc_free": "pairs/s", "prefix_lookup": "tokens/s"}[rec["op"]]
        for key in ("backend", "dtype", "layout", "gbps", "copy_gbps", "ratio", "ratio_median",
                    "bytes"):
            assert rec[key] is None


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_standard_cases_are_present(quick_records, backend, dtype):
    itemsize = np.dtype(dtype).itemsize
    for layout, out_layout in (("NHD", "BHTD"), ("NHD", "BTHD"), ("HND", "BHTD")):
        (rec,) = find(quick_records, "gather", backend=backend, dtype=dtype, layout=layout,
                      out_layout=out_layout, num_seqs=32)
        assert rec["params"] == dict(num_seqs=32, seq_len=2048, num_kv_heads=8, head_dim=128,
                                     page_size=16)
        # K and V of 32 x 2048 tokens, read once and written once.
        assert rec["bytes"] == 2 * 2 * 32 * 2048 * 8 * 128 * itemsize
    host = backends.get_backend(backend).array_types == (np.ndarray,)
    for destination in ("reused", "fresh") if host else ("reused",):
        (prefill,) = find(quick_records, "prefill_write", backend=backend, dtype=dtype,
                          destination=destination)
        assert (prefill["params"]["num_seqs"], prefill["params"]["num_new_tokens"]) == (1, 2048)
        assert prefill["bytes"] == 2 * 2 * 2048 * 8 * 128 * itemsize
        (decode,) = find(quick_records, "decode_write", backend=backend, dtype=dtype,
                         destination=destination)
        assert (decode["params"]["num_seqs"], decode["params"]["num_new_tokens"]) == (32, 1)
        assert decode["bytes"] == 2 * 2 * 32 * 8 * 128 * itemsize
        assert ("fresh" in prefill["case"]) == ("fresh" in decode["case"]) == (
            destination == "fresh")
    assert find(quick_records, "copy_pages", backend=backend, dtype=dtype)


def test_pool_and_prefix_standard_cases_are_present(quick_records):
    sizes = {r["params"]["num_pages"] for r in find(quick_records, "alloc_free", source="free")}
    assert sizes == {1024, 65536, 1048576}
    outcomes = {r["params"]["outcome"] for r in find(quick_records, "prefix_lookup")}
    assert outcomes == {"hit", "miss"}


def test_gather_sweep_covers_batch_sizes(quick_records):
    for backend in available_backends():
        sweep = find(quick_records, "gather", backend=backend, dtype="float32", layout="NHD",
                     out_layout="BHTD")
        assert [r["params"]["num_seqs"] for r in sweep] == [1, 8, 32]


# ------------------------------------------------------------- table, CLI
def test_table_has_a_header_and_one_row_per_case(capsys):
    assert main(["--quick", "--op", "prefix_lookup"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert "copy GB/s" in lines[header] and "x copy" in lines[header]
    rows = lines[header + 1:]
    assert len(rows) == 2
    assert all(row.startswith("prefix_lookup") and "tokens/s" in row for row in rows)
    assert "np.copyto on 1 and 2 threads" in "\n".join(lines[:header])


def test_python_dash_m_dispatches_to_bench():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv_np", "bench", "--quick", "--json", "--op", "prefix_lookup"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    assert [r["op"] for r in records] == ["prefix_lookup", "prefix_lookup"]


# ---------------------------------------------------------------- filters
def test_filters_select_op_backend_and_dtype(capsys):
    records = run_json(capsys, "--op", "decode_write", "--backend", "numpy", "--dtype", "float16")
    assert [(r["op"], r["backend"], r["dtype"], r["params"]["destination"])
            for r in records] == [("decode_write", "numpy", "float16", "reused"),
                                  ("decode_write", "numpy", "float16", "fresh")]


def test_filters_accept_commas_and_repeats(capsys):
    records = run_json(capsys, "--op", "decode_write,prefill_write", "--backend", "numpy",
                       "--dtype", "float32", "--dtype", "bfloat16")
    assert {(r["op"], r["dtype"]) for r in records} == {
        (op, dt) for op in ("decode_write", "prefill_write") for dt in ("float32", "bfloat16")}
    assert {r["backend"] for r in records} == {"numpy"}


def test_backend_filter_leaves_backend_free_cases_alone(capsys):
    records = run_json(capsys, "--op", "prefix_lookup", "--backend", "numpy")
    assert records and all(r["backend"] is None for r in records)


# ------------------------------------------------------------------- plot
def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "gather.png"
    assert main(["--quick", "--op", "gather", "--backend", "numpy", "--dtype", "float16",
                 "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_of_every_backend_and_dtype(quick_records, tmp_path):
    path = tmp_path / "all.png"
    plot_gather(quick_records, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    err = run_error(capsys, "--quick", "--plot", str(tmp_path / "x.png"))
    assert "pip install 'pagedkv-np[plot]'" in err
    with pytest.raises(ImportError, match=r"pagedkv-np\[plot\]"):
        plot_gather([], str(tmp_path / "y.png"))


# ------------------------------------------------------------- bad args
@pytest.mark.parametrize("args, message", [
    (["--backend", "nosuch"], "'nosuch' is not one of"),
    (["--dtype", "int8"], "Invalid dtype"),
    (["--op", "nosuch"], "unknown operation 'nosuch'; choose from gather"),
    (["--op", ","], "--op: expected at least one name"),
    (["--backend", ""], "--backend: expected at least one name"),
    (["--plot", "/nonexistent-dir/x.png"], "no such directory"),
    (["--op", "alloc_free", "--plot", "x.png"], "the plot shows gather"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_are_clear_errors(capsys, args, message):
    err = run_error(capsys, *args)
    assert err.startswith("usage: pagedkv bench")
    assert message in err


def test_unavailable_backend_is_a_clear_error(monkeypatch, capsys):
    def missing():
        raise BackendUnavailable("backend 'gone' is unavailable: its library is not installed")

    monkeypatch.setitem(backends._CUSTOM, "gone", missing)
    err = run_error(capsys, "--backend", "gone")
    assert "--backend: backend 'gone' is unavailable: its library is not installed" in err


def test_copy_bandwidth_is_a_positive_figure():
    gbps, threads = copy_bandwidth(1 << 20, repeat=2, min_time=0.001)
    assert positive_finite(gbps) and threads in (1, 2)


def test_the_command_passes_options_through(capsys):
    from pagedkv_np.cli import main as cli
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: pagedkv bench" in out and "--backend" in out
    assert cli(["bench", "--quick", "--op", "alloc_free", "--json"]) == 0
    assert '"op": "alloc_free"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli(["nonsense"])
    assert exc.value.code == 2


def test_fresh_copies_write_the_next_region_each_call():
    from pagedkv_np.bench.timing import CopyBaseline

    base = CopyBaseline()
    try:
        # 4096 bytes read and 4096 written per call, over 4 regions
        (one, threads_one), (two, threads_two) = base.fresh_copies(2 * 4096, 4 * 4096)
        assert (threads_one, threads_two) == (1, 2)
        src, dst = base._fresh_src, base._fresh_dst
        assert src.size == 4096 and dst.size == 4 * 4096 and (dst == 2).all()
        written = []
        for call in (one, two, one, two, one):
            before = dst.copy()
            call()
            changed = np.flatnonzero(before != dst)
            region = int(changed[0]) // 4096 if changed.size else None
            if changed.size:
                assert changed.size == 4096 and (dst[changed] == 1).all()
            written.append(region)
        # regions 1, 2, 3, 0 are written in turn; the fifth call finds region
        # 1 already holding the source's bytes
        assert written == [1, 2, 3, 0, None]
    finally:
        base.close()


def test_rounds_interleave_the_functions_and_time_each_call(monkeypatch):
    from pagedkv_np.bench import timing

    calls = []
    clock = [0.0]

    def fake(name, cost):
        def fn():
            calls.append(name)
            clock[0] += cost
        return fn

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    # a costs 2 s a call, b 1 s: one call per sample reaches min_time
    fns = [fake("a", 2.0), fake("b", 1.0)]
    rounds = timing.round_times(fns, repeat=4, min_time=0.5)
    assert rounds == [[2.0, 1.0]] * 4
    # a warm-up and a calibration call each, then the rounds take turns
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    # no round starts past max_time, but the first always completes
    assert len(timing.round_times(fns, repeat=10, min_time=0.5, max_time=7.0)) == 2
    assert timing.best_times(fns, repeat=3, min_time=0.5) == [2.0, 1.0]
