#!/usr/bin/env bash
# compute-sanitizer over both CUDA paths, forward and backward (scripts/sanitize_cases.py's grid), one
# tool at a time: memcheck, racecheck, synccheck, initcheck. Needs a GPU, the built extension and
# compute-sanitizer (CUDA toolkit). Writes each tool's log to LOGDIR and prints a summary; exits 1 if
# any tool reported an error. docs/reliability.md records the result.
#
#   scripts/sanitize.sh [LOGDIR] [TOOL ...]
#
# SELSCAN_SANITIZE_FULL=1 runs the whole grid under every tool; by default each tool runs a third of it
# (every shape, every N and dtype, both layouts and the L split still appear: sanitize_cases.py --quick),
# which takes minutes rather than tens of minutes; SELSCAN_SANITIZE_REST=1 runs the two thirds it leaves
# out. SELSCAN_SANITIZE_SHARD=K/M runs the K-th of M parts of that (racecheck is slow: run it as parts,
# side by side; 10 parts of the third took 64-137 s each on the H200, 2026-12-03).
# racecheck of the fused kernels wants the build whose dt/B/C hand-off goes through mbarriers
# (SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_HANDOFF_MBARRIER=1 python setup.py build_ext --inplace): the tool
# reports the default build's named-barrier hand-off whether or not it races (docs/reliability.md).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-/tmp/selscan-sanitize}
shift || true
TOOLS=${*:-memcheck racecheck synccheck initcheck}
PY=${PYTHON:-python3}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
[ -x "$CS" ] || { echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
mkdir -p "$LOG"
if [[ " $TOOLS " == *" racecheck "* ]] && ! $PY -c "import selscan_fused._build_info as b, sys; sys.exit('SELSCAN_HANDOFF_MBARRIER=1' not in b.FUSED_NVCC_EXTRA_FLAGS)" 2>/dev/null; then
  echo "note: this build's fused kernels hand off through named barriers; racecheck reports those whether or not they race (build with SELSCAN_FUSED_NVCC_FLAGS=-DSELSCAN_HANDOFF_MBARRIER=1)"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Every tensor its own cudaMalloc: an access past a tensor's end is past an allocation's end, which
# memcheck sees (inside the caching allocator's pool it would not be).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for tool in $TOOLS; do
  args=()
  quick=(--quick)
  [ "${SELSCAN_SANITIZE_FULL:-0}" = 1 ] && quick=()
  [ "${SELSCAN_SANITIZE_REST:-0}" = 1 ] && quick=(--rest)
  [ -n "${SELSCAN_SANITIZE_SHARD:-}" ] && quick+=(--shard "$SELSCAN_SANITIZE_SHARD")
  # synccheck instruments only this project's kernels (their names hold "selscan"): the hazards of
  # torch's and cuBLAS's kernels are not ours. SELSCAN_SANITIZE_ALL_KERNELS=1 checks every kernel.
  # racecheck instruments every kernel: with the filter, compute-sanitizer 2025.3.1 fails on cuBLAS's
  # bfloat16 product ("Internal Sanitizer Error: failed to handle a hardware exception", then an
  # illegal address; a bare bf16 F.linear does it, and runs clean unfiltered), so every bf16/fp16 run
  # died; unfiltered it is slow, so run it in parts (SELSCAN_SANITIZE_SHARD). initcheck instruments
  # every kernel too: a kernel left out is not seen writing either, and with the filter every input
  # that torch's kernels wrote read as uninitialized (2026-12-02).
  ours=(--kernel-name kns=selscan)
  [ "${SELSCAN_SANITIZE_ALL_KERNELS:-0}" = 1 ] && ours=()
  case $tool in
    memcheck) args=(--leak-check no) ;;
    # every hazard printed (--print-limit 0), so that each is attributed to its kernel below
    racecheck) args=(--racecheck-report hazard) ;;
    synccheck) args=("${ours[@]}") ;;
    # initcheck: on inputs no cuBLAS kernel wrote (sanitize_cases.py --initcheck says why);
    # --track-unused-memory is a switch in compute-sanitizer 2025+, off unless given
    initcheck) quick+=(--initcheck) ;;
  esac
  t0=$(date +%s)
  limit=50
  [ "$tool" = racecheck ] && limit=0
  "$CS" --tool "$tool" "${args[@]}" --error-exitcode 99 --print-limit $limit --target-processes all \
    $PY scripts/sanitize_cases.py "${quick[@]}" > "$LOG/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/$tool.log" | tail -n 1)
  runs=$(grep -E "forward\+backward runs" "$LOG/$tool.log" | tail -n 1)
  where=""
  if [ "$tool" = racecheck ] && [ $rc -eq 99 ] && [ -n "$runs" ]; then
    # racecheck instruments every kernel (above): a hazard counts against this project only when one
    # of its two threads is in one of this project's kernels (their names hold "selscan"); the others
    # (cuBLAS's nvjet kernels report WAR hazards on their own shared memory) are listed, not failed on.
    where=$($PY scripts/sanitize_hazards.py "$LOG/$tool.log")
    case $where in *"not printed"*) ;; "0 in this project's kernels"*) rc=0 ;; esac
    where=" | hazards: $where"
  fi
  echo "$tool: rc=$rc, $(( $(date +%s) - t0 )) s: ${summary:-no summary} | ${runs:-workload did not finish}$where"
  [ $rc -eq 0 ] || { status=1; grep -E "=========" "$LOG/$tool.log" | head -n 30; tail -n 5 "$LOG/$tool.log"; }
done
exit $status
