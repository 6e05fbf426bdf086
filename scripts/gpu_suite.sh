#!/usr/bin/env bash
# The whole GPU job, for a machine with a CUDA device and CuPy, in stages that each fit a
# 10-minute run (README.md, "The GPU job", gives each stage's time on an H200):
#   gpu        every GPU test but the fuzz and the slow ones (examples, graphs, DLPack, the
#              ops on CuPy, the monitor, torch and JAX interop), over GPU_WORKERS pytest
#              processes (pytest-xdist, a test file each at a time) where xdist is installed
#   slow       the GPU tests marked slow (the memcheck run of the out-of-range workload)
#   fuzz       the parity fuzz against the NumPy reference (FUZZ_CASES cases, default 500)
#   sanitizer  every GPU test file under compute-sanitizer memcheck, SANITIZER_JOBS at a time
#   selftest   the fault-injection selftest on the CUDA backend
#   overhead, selfcheck, bench   the benchmarks (bench/, run as python3 -m bench...)
# Not in the default stages: cpu (the CPU tests, which CI runs) and contention (the GPU tests
# while another process keeps the device busy).
# STAGES="gpu fuzz" picks stages. Logs go to $OUT (default ./gpu-out). Each stage runs even
# if an earlier one failed; the exit status is the number of failed stages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STAGES=${STAGES:-"gpu slow fuzz sanitizer selftest overhead selfcheck bench"}
failed=0
stage() {  # stage NAME COMMAND...: run, log to $OUT/NAME.log, print the tail
    local name=$1; shift
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-6}" "$OUT/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# Test files spread over processes: each compiles its kernels once, and the device has room.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_WORKERS:-8}" --dist loadfile)
stage gpu python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu and not slow" "${workers[@]}" \
    --deselect tests/gpu/test_parity_fuzz.py --durations=15
stage slow python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu and slow" --deselect tests/gpu/test_parity_fuzz.py
stage cpu python3 -m pytest -q -p no:cacheprovider -rfE -m "not gpu" "${workers[@]}"
stage fuzz env KVCANARY_FUZZ_CASES="${FUZZ_CASES:-500}" python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_parity_fuzz.py
# The GPU tests again while another process keeps the device busy (not in the default
# stages): a missing order between streams shows only when queued work runs late.
stage contention bash -c 'python3 scripts/gpu_busy.py 600 & busy=$!; sleep 3
    python3 -m pytest -q -p no:cacheprovider -m gpu --deselect tests/gpu/test_parity_fuzz.py \
        --deselect tests/gpu/test_sanitizer.py; rc=$?; kill $busy; exit $rc'
# Every GPU test under memcheck, file by file, SANITIZER_JOBS files at a time.
stage sanitizer bash scripts/sanitize_gpu_tests.sh
stage selftest python3 -m kvcanary_cupy selftest --backend cuda --json /tmp/selftest.json
stage overhead bash -c 'python3 -m bench.monitor_host_overhead && python3 -m bench.vllm_gpu_host'
stage selfcheck python3 -m bench.selfcheck
# The harness fills in the table of a copy of bench/README.md; copy it (and bench.json, as
# bench/results.json) back to bench/ to publish a run.
cp bench/README.md "$OUT/bench.md" 2>/dev/null
stage bench python3 -m bench --json "$OUT/bench.json" --markdown "$OUT/bench.md" ${BENCH_ARGS:-}
exit $failed
