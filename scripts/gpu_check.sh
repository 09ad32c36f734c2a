#!/usr/bin/env bash
# The GPU check: on a fresh H100/H200 machine with no package registry, build the extension, run the
# whole test suite (GPU tests included) and the benchmark, write the logs to the folder given, and
# print a short summary last.
#
#   scripts/gpu_check.sh LOGDIR [benchmark args...]
#
# Needs: python3 with torch (CUDA build), pytest, ninja, nvcc. CUTLASS comes from the nvidia-cutlass
# wheel: installed already, or carried as .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl (no registry
# needed), or a checkout named by SELSCAN_CUTLASS_DIR.
# SELSCAN_PREBUILT=DIR or FILE.tgz: use DIR/*.so (built elsewhere against this exact torch and Python
# minor version), or those of a scripts/prebuild.sh archive, instead of building.
set -uo pipefail
LOG=${1:?usage: scripts/gpu_check.sh LOGDIR [benchmark args...]}
shift
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 SELSCAN_EXPECT_EXTENSION=1
status=0

if ! $PY -c "import cutlass_library" 2>/dev/null && [ -z "${SELSCAN_CUTLASS_DIR:-}" ]; then
  whl=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -n 1)
  [ -n "$whl" ] || { echo "no CUTLASS: pip install --no-deps nvidia-cutlass==4.2.0.0, or carry it in .whl/"; exit 2; }
  rm -rf /tmp/selscan_cutlass && mkdir -p /tmp/selscan_cutlass
  $PY -m zipfile -e "$whl" /tmp/selscan_cutlass >/dev/null
  export SELSCAN_CUTLASS_DIR=/tmp/selscan_cutlass/cutlass_library/source
fi

# The host compiler: the system g++ unless SELSCAN_CXX names another. (Seen on the H200 image: its
# CXX=/opt/gcc/bin/g++ builds extensions whose C++ exceptions crash the process on the first error.)
if [ -n "${SELSCAN_CXX:-}" ]; then export CXX=$SELSCAN_CXX; elif command -v g++ >/dev/null; then
  export CXX=$(command -v g++) CC=$(command -v gcc)
fi

# SELSCAN_PEERS=DIR: mamba-ssm's kernels built from DIR (prepared by `scripts/build_peers.sh src DIR ...`)
# in the background while the extension builds and the tests run; DIR's modules go on PYTHONPATH for
# the optional benchmark stages below, which wait for that build.
peers_pid=""
if [ -n "${SELSCAN_PEERS:-}" ]; then
  if ls "$SELSCAN_PEERS"/scan/selective_scan_cuda*.so "$SELSCAN_PEERS"/conv/causal_conv1d_cuda*.so >/dev/null 2>&1; then
    echo "peers: built already in $SELSCAN_PEERS" > "$LOG/peers.log"
  else
    nice -n 10 bash scripts/build_peers.sh build "$SELSCAN_PEERS" > "$LOG/peers.log" 2>&1 &
    peers_pid=$!
  fi
fi

t0=$(date +%s)
if [ -n "${SELSCAN_PREBUILT:-}" ]; then
  pre=$SELSCAN_PREBUILT
  if [ -f "$pre" ]; then  # a scripts/prebuild.sh archive
    rm -rf /tmp/selscan_prebuilt && mkdir -p /tmp/selscan_prebuilt && tar xzf "$pre" -C /tmp/selscan_prebuilt || exit 1
    pre=/tmp/selscan_prebuilt/selscan_fused
  fi
  # A build for another torch fails to load (or loads and misbehaves): say so before any test runs.
  $PY - "$pre/_build_info.py" <<'PY' || exit 2
import runpy, sys, torch
info = runpy.run_path(sys.argv[1])
want, have = info.get("TORCH_VERSION"), torch.__version__
pyv = info.get("PYTHON_VERSION", "").rsplit(".", 1)[0]
if want != have or pyv != "%d.%d" % sys.version_info[:2]:
    sys.exit(f"the prebuilt extension was built for torch {want}, Python {pyv}; here torch {have}, Python "
             f"{sys.version_info[0]}.{sys.version_info[1]}: build it for this machine (scripts/prebuild.sh)")
PY
  cp "$pre"/*.so "$pre"/_build_info.py selscan_fused/ || exit 1
  echo "using the prebuilt extension in $SELSCAN_PREBUILT" | tee "$LOG/build.log"
  # SELSCAN_BUILD_ONLY=_C (or _fused) beside SELSCAN_PREBUILT: that extension rebuilt here over the
  # prebuilt one (a change to the unfused, conv or decode kernels only: ~40 s instead of ~170 s), with
  # the host compiler chosen above.
  if [ -n "${SELSCAN_BUILD_ONLY:-}" ]; then
    MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-3} \
      $PY setup.py build_ext --inplace >>"$LOG/build.log" 2>&1 || { echo "BUILD FAILED"; tail -n 40 "$LOG/build.log"; exit 1; }
    echo "rebuilt $SELSCAN_BUILD_ONLY over it" | tee -a "$LOG/build.log"
  fi
else
  # In place, without pip: the GPU machine has no package registry, and a pip editable install can
  # fall back to `setup.py develop`, which asks the registry for setuptools.
  MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
    $PY setup.py build_ext --inplace >"$LOG/build.log" 2>&1 || { echo "BUILD FAILED"; tail -n 40 "$LOG/build.log"; exit 1; }
fi
t1=$(date +%s)
# SELSCAN_SAVE_BUILD=DIR: the built extension packed into DIR as build.tgz.aa, .ab, ... (15 MB pieces, for
# a machine that returns files of limited size; `cat build.tgz.* | tar xzf - -C X` restores them as
# X/selscan_fused/*.so and _build_info.py, and SELSCAN_PREBUILT=X/selscan_fused takes them).
if [ -n "${SELSCAN_SAVE_BUILD:-}" ] && { [ -z "${SELSCAN_PREBUILT:-}" ] || [ -n "${SELSCAN_BUILD_ONLY:-}" ]; }; then
  mkdir -p "$SELSCAN_SAVE_BUILD"
  tar czf - selscan_fused/*.so selscan_fused/_build_info.py | split -b 15M - "$SELSCAN_SAVE_BUILD/build.tgz."
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$LOG/gpu.txt" 2>&1

# SELSCAN_GPU_CHECK_SKIP=tests,bench leaves those stages out (a second call on a prebuilt extension that
# runs only the optional stages below, each call within the device's per-command limit).
skip=",${SELSCAN_GPU_CHECK_SKIP:-},"
# SELSCAN_TEST_WORKERS=N: the suite over N pytest-xdist workers sharing the GPU (where xdist is installed),
# then every test that failed there once more on its own, serially: a failure that a lone rerun does
# not repeat came from the sharing (a per-test time limit, memory) and is reported as such.
# SELSCAN_TEST_TIMEOUT (s, default 900): pytest-timeout's limit per test, where installed.
# SELSCAN_TESTS_LIMIT (s, default none): the whole parallel run's limit. Each failure's report is in
# LOGDIR/failures.log as it happens (tests/conftest.py), also when the run is stopped at that limit.
# SELSCAN_BACKGROUND="cmd1;;cmd2": commands run in the background while the tests run (correctness work
# that does not time anything, e.g. resumable training runs: benchmarks/paper_tasks.py ... --ckpt), each
# in its own process group with its log in LOGDIR/background_<i>.log; sent SIGTERM when the tests end
# (paper_tasks.py saves its checkpoint then) and given 30 s to stop.
bg_pids=()
if [ -n "${SELSCAN_BACKGROUND:-}" ]; then
  i=0
  while IFS= read -r cmd; do
    [ -n "$cmd" ] || continue
    setsid bash -c "$cmd" > "$LOG/background_$i.log" 2>&1 &
    bg_pids+=($!)
    i=$((i + 1))
  done < <(printf '%s\n' "${SELSCAN_BACKGROUND//;;/$'\n'}")
fi
stop_background() {
  [ ${#bg_pids[@]} -gt 0 ] || return 0
  for pid in "${bg_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  for _ in $(seq 1 30); do
    alive=0
    for pid in "${bg_pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
  done
  bg_pids=()
}

if [[ $skip != *,tests,* ]]; then
  export SELSCAN_FAILURE_LOG="$LOG/failures.log"
  : > "$SELSCAN_FAILURE_LOG"
  par=() tmo=()
  if [ -n "${SELSCAN_TEST_WORKERS:-}" ] && $PY -c "import xdist" 2>/dev/null; then par=(-n "$SELSCAN_TEST_WORKERS"); fi
  $PY -c "import pytest_timeout" 2>/dev/null && tmo=(--timeout "${SELSCAN_TEST_TIMEOUT:-900}")
  # SELSCAN_TEST_FILES: the test files (or node ids) to run, space-separated (default: the whole suite),
  # or @FILE: the node ids in FILE, one a line (a run's LOGDIR/unfinished.txt, below)
  if [[ ${SELSCAN_TEST_FILES:-} == @* ]]; then
    mapfile -t test_files < "${SELSCAN_TEST_FILES#@}"
    [ ${#test_files[@]} -gt 0 ] || { echo "SELSCAN_TEST_FILES=$SELSCAN_TEST_FILES names no test"; exit 2; }
  else
    read -r -a test_files <<< "${SELSCAN_TEST_FILES:-tests}"
  fi
  # every finished test's node id (tests/conftest.py), so that a run stopped at its limit names the rest
  export SELSCAN_DONE_LOG="$LOG/done.txt"
  : > "$SELSCAN_DONE_LOG"
  timeout "${SELSCAN_TESTS_LIMIT:-0}" $PY -m pytest -q -rs "${par[@]}" "${tmo[@]}" "${test_files[@]}" 2>&1 | tee "$LOG/tests.log" | tail -n 40
  test_rc=${PIPESTATUS[0]}
  if [ "$test_rc" = 124 ]; then
    # The tests it had not finished: the same selection collected again, less those done.
    PYTEST_ADDOPTS= $PY -m pytest --collect-only -q -p no:xdist "${test_files[@]}" 2>/dev/null | grep '::' \
      > "$LOG/collected.txt"
    grep -vxFf "$SELSCAN_DONE_LOG" "$LOG/collected.txt" > "$LOG/unfinished.txt"
    echo "tests: stopped at SELSCAN_TESTS_LIMIT=${SELSCAN_TESTS_LIMIT:-0} s with $(wc -l < "$LOG/unfinished.txt") of" \
         "$(wc -l < "$LOG/collected.txt") tests unfinished, named in $LOG/unfinished.txt" \
         "(SELSCAN_TEST_FILES=@$LOG/unfinished.txt runs them)" | tee -a "$LOG/tests.log"
  fi
  mapfile -t failed < <(sed -n 's/^==== \([^ ]*\) .*/\1/p' "$SELSCAN_FAILURE_LOG" | sort -u)
  if [ ${#par[@]} -gt 0 ] && [ ${#failed[@]} -gt 0 ]; then
    echo "rerunning the ${#failed[@]} failed tests one process, one at a time" | tee -a "$LOG/tests.log"
    SELSCAN_FAILURE_LOG="$LOG/failures_serial.log" $PY -m pytest -q -rfE --tb=short "${tmo[@]}" "${failed[@]}" \
      > "$LOG/tests_serial.log" 2>&1
    serial_rc=$?
    tail -n 3 "$LOG/tests_serial.log" | tee -a "$LOG/tests.log"
    # the lone rerun decides for those tests; the parallel run's other tests passed or were not reached
    [ "$serial_rc" = 0 ] && [ "$test_rc" = 1 ] && test_rc=0
  fi
  [ "$test_rc" = 0 ] || status=1
else
  echo "tests: left out (SELSCAN_GPU_CHECK_SKIP)" > "$LOG/tests.log"
fi
stop_background
t2=$(date +%s)

if [[ $skip != *,bench,* ]]; then
  $PY benchmarks/bench.py --json "$LOG/bench.json" "$@" 2>&1 | tee "$LOG/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  echo "benchmark: left out (SELSCAN_GPU_CHECK_SKIP)" > "$LOG/bench.log"
fi
t3=$(date +%s)

# Optional stages, each after the timings so that nothing else shares the GPU with them:
#   SELSCAN_GPU_CHECK_RELIABILITY=1   scripts/differential.py (500 cases; SELSCAN_DIFF_SEED fixes the
#                                     seed) and scripts/sanitize.sh (SELSCAN_SANITIZE_TOOLS, default
#                                     "memcheck synccheck racecheck initcheck"), logs in LOGDIR
#   SELSCAN_GPU_CHECK_MICRO=1         benchmarks/micro/bwd_layouts.cu and chunk_scan.cu, built and run
#   SELSCAN_GPU_CHECK_RESULTS=table,figure   a second run of the ablation table and / or the paper
#                                     figure into LOGDIR (SELSCAN_FIGURE_ARGS: e.g. --max-L 65536; the
#                                     figure resumes a CSV already in LOGDIR), each compared row by row
#                                     with the committed CSV (benchmarks/compare_results.py; docs/results.md, 5)
extra=""
if [ "${SELSCAN_GPU_CHECK_RELIABILITY:-0}" = 1 ]; then
  $PY scripts/differential.py --cases 500 ${SELSCAN_DIFF_SEED:+--seed "$SELSCAN_DIFF_SEED"} > "$LOG/differential.log" 2>&1 || status=1
  extra+="differential: $(tail -n 1 "$LOG/differential.log")"$'\n'
  bash scripts/sanitize.sh "$LOG/sanitize" ${SELSCAN_SANITIZE_TOOLS:-memcheck synccheck racecheck initcheck} > "$LOG/sanitize.log" 2>&1 || status=1
  extra+="$(grep -E '^[a-z]+check: rc=' "$LOG/sanitize.log")"$'\n'
fi
if [ "${SELSCAN_GPU_CHECK_MICRO:-0}" = 1 ]; then
  NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
  : > "$LOG/micro.log"
  for m in bwd_layouts chunk_scan; do
    if "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$LOG/$m" "benchmarks/micro/$m.cu" \
         >> "$LOG/micro.log" 2>&1 && "$LOG/$m" >> "$LOG/micro.log" 2>&1; then :; else status=1; fi
  done
  extra+="$(cat "$LOG/micro.log")"$'\n'
fi
# SELSCAN_GPU_CHECK_EXTRA=block,decode,varlen,throughput,profile: the block's, the language model's and
# the packed sequences' benchmarks into LOGDIR (CSV + log each; mamba-ssm's rows where its kernels
# import); profile: the block's unfused and fused forward and step with torch.profiler's kernel table.
extras=",${SELSCAN_GPU_CHECK_EXTRA:-},"
if [ "$extras" != ",," ] && [ -n "${SELSCAN_PEERS:-}" ]; then
  [ -n "$peers_pid" ] && wait "$peers_pid"
  extra+="peers: $(tail -n 2 "$LOG/peers.log" | tr '\n' ' ')"$'\n'
  export PYTHONPATH="$PYTHONPATH:$SELSCAN_PEERS/py:$SELSCAN_PEERS/scan:$SELSCAN_PEERS/conv"
fi
for what in block decode varlen throughput profile; do
  [[ $extras == *,$what,* ]] || continue
  case $what in
    block) run=(benchmarks/block_bench.py --impls unfused,fused,mamba-ssm --csv "$LOG/block_bench.csv") ;;
    decode) run=(benchmarks/decode_bench.py --csv "$LOG/decode_bench.csv" --prefill 1,4,16
                 --prefill-csv "$LOG/prefill_bench.csv") ;;
    varlen) run=(benchmarks/varlen_bench.py --impls unfused,fused --csv "$LOG/varlen_bench.csv") ;;
    throughput) run=(benchmarks/inference_throughput.py --csv "$LOG/inference_throughput.csv"
                     --png "$LOG/inference_throughput.png") ;;
    profile) run=(benchmarks/block_bench.py --impls unfused,fused --sizes 130M --shapes 8x2048,1x16384
                  --profile --csv "$LOG/block_profile.csv") ;;
  esac
  $PY "${run[@]}" > "$LOG/$what.log" 2>&1 || status=1
  extra+="$what: $(tail -n 3 "$LOG/$what.log")"$'\n'
done
results=",${SELSCAN_GPU_CHECK_RESULTS:-},"
for what in table figure; do
  [[ $results == *,$what,* ]] || continue
  if [ $what = table ]; then name=ablation_table; run=(benchmarks/ablation_table.py); else
    name=paper_figure; run=(benchmarks/paper_figure.py ${SELSCAN_FIGURE_ARGS:-}); fi
  $PY "${run[@]}" --csv "$LOG/$name.csv" > "$LOG/$name.log" 2>&1 || status=1
  $PY benchmarks/compare_results.py "docs/$name.csv" "$LOG/$name.csv" > "$LOG/compare_$name.log" 2>&1 || status=1
  extra+="$(head -n 2 "$LOG/compare_$name.log")"$'\n'
done
t4=$(date +%s)

echo
echo "=== summary ==="
cat "$LOG/gpu.txt"
echo "build: $((t1 - t0)) s   tests: $((t2 - t1)) s   benchmark: $((t3 - t2)) s   optional stages: $((t4 - t3)) s"
grep -E "^[0-9]+ (passed|failed)|passed|failed" "$LOG/tests.log" | tail -n 1
cat "$LOG/bench.log" | tail -n 60
[ -n "$extra" ] && printf '%s' "$extra"
# SELSCAN_PACK=FILE: LOGDIR packed into one gzipped tar at the end (for a machine that returns few files;
# `tar xzf FILE` restores LOGDIR's last path component).
if [ -n "${SELSCAN_PACK:-}" ]; then
  tar czf "$SELSCAN_PACK" -C "$(dirname "$LOG")" "$(basename "$LOG")" || status=1
fi
exit $status
