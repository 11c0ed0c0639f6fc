#!/usr/bin/env bash
# Benchmark smoke run: every asv benchmark once (--quick) against the
# installed package, then `pagedkv bench --quick`. Exits non-zero if the suite
# does not import, if any benchmark fails or times out, or if the command
# fails. Figures from a smoke run are not worth comparing (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
if [ ! -x "$BIN/asv" ] || [ ! -x "$BIN/pagedkv" ]; then
    echo "bench_smoke: $BIN/asv or $BIN/pagedkv is missing; run 'make install' first" >&2
    exit 1
fi

"$BIN/asv" check --python=same
"$BIN/asv" machine --yes > /dev/null

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"$BIN/asv" run --python=same --quick --show-stderr 2>&1 | tee "$log" || status=$?
# asv 0.6.6 exits 1 when the suite cannot be discovered and 2 when any
# benchmark (or any parameter combination of one) failed or timed out. Its
# status lines ("... failed", "... 1/4 failed") are checked too, so that a
# failure is caught even if a future asv stops reporting it in the exit status.
failed_lines='^\[ *[0-9.]+%\] [^ ]+ .*[^ ] +([0-9]+/[0-9]+ )?failed$|asv: benchmark (failed|timed out)'
if grep -Eq "$failed_lines" "$log"; then
    echo "bench_smoke: failed benchmarks:" >&2
    grep -E "$failed_lines" "$log" >&2
    if [ "$status" -eq 0 ]; then
        status=1
    fi
fi
if [ "$status" -ne 0 ]; then
    echo "bench_smoke: asv run failed (exit status $status)" >&2
    exit "$status"
fi

"$BIN/pagedkv" bench --quick

# the llama.cpp peer harness end to end against its plain onnxruntime peer
# (no llama.cpp build): servers, the streaming client, the figures
"$BIN/python" scripts/bench_llamacpp.py --quick --workloads sequential,long,itl
