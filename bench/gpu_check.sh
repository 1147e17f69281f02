#!/usr/bin/env bash
# One run on a GPU machine: the cuda tests of ember.csprng, bench/csprng_cuda.py and
# bench/dp.py --device cuda, each under a timeout, logs and JSON under $OUT (8 files, flat),
# then a summary table. Run from the repository root:  bash bench/gpu_check.sh
# It continues past a failing step and says which failed. Whole run: under 8 minutes.
set -u
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src"
# wheels carried in .whl/ (cryptography, opacus, ...), installed without network
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/env.log" 2>&1 \
        || echo "pip install of .whl/ failed (see env.log)" >>"$OUT/env.log"
    export PYTHONPATH="$PWD/src:/tmp/site"
fi
export EMBER_CACHE_DIR="${EMBER_CACHE_DIR:-/tmp/ember_cache_gpu_check}"
export PYTHONUNBUFFERED=1
declare -a NAMES STATUS SECS
START=$(date +%s)

BUDGET=450  # seconds for all steps together: each step's timeout is cut to what is left

step() {  # step NAME TIMEOUT_S LOGFILE COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    local t0 rc left
    t0=$(date +%s)
    left=$(( BUDGET - (t0 - START) ))
    if [ "$left" -lt 10 ]; then
        NAMES+=("$name"); STATUS+=("SKIPPED(budget)"); SECS+=(0)
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: $*" >>"$OUT/$log"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    NAMES+=("$name")
    SECS+=("$(( $(date +%s) - t0 ))")
    if [ "$rc" -eq 0 ]; then STATUS+=("ok"); elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        STATUS+=("TIMEOUT(${limit}s)"); else STATUS+=("FAILED(rc=$rc)"); fi
    echo "=== $name: rc=$rc after ${SECS[-1]} s" >>"$OUT/$log"
}

step "nvidia-smi" 20 env.log nvidia-smi
step "versions" 60 env.log "$PY" -c "
import importlib, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0))
for m in ('triton', 'cryptography', 'opacus', 'cuda.bindings', 'numpy'):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, '__version__', '?'))
    except Exception as e:
        print(m, 'MISSING', type(e).__name__, e)
from ember.csprng import nvrtc_kernels
from ember.csprng.cuda_backend import fast_path
print('nvrtc available', nvrtc_kernels.available(), 'path', fast_path())
if nvrtc_kernels.available(): print('nvrtc version', nvrtc_kernels.nvrtc_version())
"
step "compile-only" 90 env.log "$PY" bench/csprng_cuda.py --compile-only
step "tests: fast path (cuda)" 150 tests_fast.log "$PY" -m pytest -m cuda tests/csprng/test_nvrtc.py -q --maxfail=10 \
    -p no:cacheprovider -o addopts=""
step "tests: fast path (all)" 60 tests_fast.log "$PY" -m pytest tests/csprng/test_nvrtc.py -q \
    -p no:cacheprovider -o addopts="" -k "not cuda_"
step "tests: other cuda" 120 tests_other.log "$PY" -m pytest -m cuda tests/csprng -q --maxfail=10 -p no:cacheprovider \
    -o addopts="" --ignore=tests/csprng/test_nvrtc.py --deselect tests/csprng/test_bench_cuda.py::test_quick_run_on_a_gpu
step "tests: privacy noise" 60 tests_other.log "$PY" -m pytest tests/train/test_privacy_noise.py -q \
    -p no:cacheprovider -o addopts=""
step "bench: csprng_cuda" 150 bench.log "$PY" bench/csprng_cuda.py --json "$OUT/csprng_cuda.json"
step "bench: dp --device cuda" 80 dp.log "$PY" bench/dp.py --device cuda --quick --out "$OUT/dp.json"

{
    echo "gpu_check summary ($(date -u +%FT%TZ), total $(( $(date +%s) - START )) s)"
    printf '%-28s %-18s %6s\n' step status seconds
    for i in "${!NAMES[@]}"; do printf '%-28s %-18s %6s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}"; done
    echo
    grep -h -E "passed|failed|error" "$OUT/tests_fast.log" "$OUT/tests_other.log" 2>/dev/null | grep -E "^[=0-9 ]" | tail -6
    echo
    grep -h -A14 "^goals" "$OUT/bench.log" 2>/dev/null
    grep -h -E "^compile:" "$OUT/env.log" 2>/dev/null
    grep -h -A4 "DP-SGD step" "$OUT/dp.log" 2>/dev/null
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
