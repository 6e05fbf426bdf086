#!/usr/bin/env bash
# Every GPU test under compute-sanitizer memcheck, one test file per sanitizer run,
# so that each file gets its own error summary and a slow file cannot hide the others.
# CuPy's memory pool is off (every kvcanary buffer its own allocation, so memcheck sees
# any access past its end); PyTorch keeps its caching allocator, which torch.cuda.graph
# capture needs. The parity fuzz is left out (the memcheck
# test in tests/gpu/test_sanitizer.py runs fuzz cases under the sanitizer itself).
# Per-file limit: SANITIZER_FILE_TIMEOUT seconds (default 300); files run SANITIZER_JOBS at
# a time (default: three quarters of the host's cores). Arguments, if any: the test files to
# run (default: all). Exit status: files that failed, timed out or reported errors.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export KVCANARY_CUPY_POOL=0 XLA_PYTHON_CLIENT_ALLOCATOR=platform
# Property tests at a tenth of their examples: memcheck makes each one far slower.
export KVCANARY_EXAMPLES_SCALE=${SANITIZER_EXAMPLES_SCALE:-0.1}
# Left out: the lifetime checks (the memo's, and the KV pools' through the ops and the
# monitor). Under compute-sanitizer the frames of recent calls stay referenced after they
# return, and they hold their arguments (the tests then fail with no memory error); in
# plain runs, CPU and GPU, the objects are freed and the tests pass.
skip=(--deselect "tests/test_ops_memo.py::test_calls_go_with_their_canary[cupy]"
      --deselect "tests/test_ops_memo.py::test_memo_is_bounded_and_lets_the_oldest_arguments_go[cupy]"
      --deselect tests/gpu/test_pool_lifetime.py --deselect tests/gpu/test_monitor_pool_lifetime.py
      # Two processes on two GPUs (NCCL): each process's kernels are those the files above check.
      --deselect tests/gpu/test_distributed_gpu.py --deselect "tests/test_examples.py::test_tp_agreement_two_gpus"
      # torch.compile's code generation under memcheck takes minutes; the ops it calls are
      # the library's, which the other files check.
      --deselect tests/gpu/test_torch_ops_gpu.py)
# Files whose time under memcheck goes to other code's kernels (a model's and PyTorch's, the
# bench's L2 flush and baseline): there memcheck checks only the library's kernels, every
# __global__ of kernels_cu/, which keeps each file well inside its limit.
ours_only=(tests/gpu/test_transformers_gpu.py tests/test_bench_quick.py)
ours=()
for k in $(sed -nE 's/.*__global__ void( __launch_bounds__\([^)]*\))? ([A-Za-z_0-9]+)\(.*/\2/p' kernels_cu/*.cu | sort -u); do
    ours+=(--kernel-name "kns=$k")
done
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_*.py tests/test_*.py)
# Files run SANITIZER_JOBS at a time: memcheck is bound by the host's cores, and
# each file's run is a process of its own. Each file's line is printed as its run ends, so
# a stage cut short by a time limit still shows the files it finished.
jobs=${SANITIZER_JOBS:-$(( $(nproc) * 3 / 4 ))}
[ "$jobs" -ge 1 ] || jobs=1
logs=$(mktemp -d)
one() {  # one FILE LOG: the file under memcheck; LOG gets its summary line (and its tail on failure)
    local f=$1 log=$2 out rc summary result t0=$SECONDS filter=()
    case " ${ours_only[*]} " in *" $f "*) filter=("${ours[@]}") ;; esac
    out=$(timeout "${SANITIZER_FILE_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 99 "${filter[@]}" \
        python3 -m pytest -q -p no:cacheprovider -m gpu "${skip[@]}" "$f" 2>&1)
    rc=$?
    summary=$(grep -E "ERROR SUMMARY" <<<"$out" | tail -n 1)
    result=$(grep -E "passed|failed|no tests ran|deselected" <<<"$out" | tail -n 1)
    echo "$f: rc=$rc in $((SECONDS - t0)) s${filter:+ (kvcanary kernels only)} | ${result:-?} | ${summary:-no summary}" >"$log"
    # rc 5: pytest collected no GPU test in this file.
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
        tail -n 40 <<<"$out" >>"$log"
        echo bad >"$log.bad"
    fi
    cat "$log"
}
i=0
for f in "${files[@]}"; do
    case "$f" in */test_parity_fuzz.py|*/test_sanitizer.py) continue ;; esac
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    one "$f" "$logs/$(printf %03d $i).log" &
    i=$((i + 1))
done
wait
echo "sanitizer: $i files in $SECONDS s, $jobs at a time"
bad=$(ls "$logs"/*.bad 2>/dev/null | wc -l)
rm -rf "$logs"
exit "$bad"
