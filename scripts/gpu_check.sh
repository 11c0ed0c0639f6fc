#!/usr/bin/env bash
# Everything that needs a GPU, in one run of under five minutes: the CuPy
# backend's tests (bit for bit against the NumPy reference) and the bandwidth
# benchmark (write/gather beside a device-to-device copy; goal ratio >= 0.8).
# Output goes to $OUT when set (else a temporary folder) and to stdout.
#
# Runs from a source checkout on a machine with a GPU and no network: CuPy
# must be installed, or come as wheels in .whl/ (installed
# into /tmp/site). The project itself is used from the checkout.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import cupy" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "gpu_check: CuPy is not installed and .whl/ holds no wheels" >&2
        exit 1
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

status=0
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PY" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__,
'gpu', cupy.cuda.is_available())"
} 2>&1 | tee "$OUT/env.txt"

# The wheel test needs PyPI (hatchling); it runs on every CPU machine instead.
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cupy_gpu.py \
    --deselect tests/test_cupy_gpu.py::test_wheel_ships_the_sources_and_the_installed_loader_finds_them \
    2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 80 "$PY" scripts/bench_gpu.py --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: exit $status, output in $OUT"
exit $status
