#!/usr/bin/env bash
# The README's first command: installs selscan_fused and what it needs into the current Python
# environment, builds the CUDA extension when a CUDA toolkit and a CUDA build of torch are present,
# then runs the main job (python -m selscan_fused.demo). Packages already installed are kept, so it
# also works on a machine with no package registry once torch, ninja, pytest and CUTLASS are there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

need() { $PY -c "import $1" 2>/dev/null || echo "$2"; }
missing="$(need torch torch) $(need ninja ninja) $(need pytest pytest) $(need numpy numpy) $(need wheel wheel) $(need transformers transformers==5.17.0)"
missing=$(echo $missing)
if [ -n "$missing" ]; then
  case " $missing " in
    *" torch "*) echo "selscan_fused: installing $missing; torch comes with its CUDA libraries: a download of" \
                      "several GB, about 5.5 GB installed." ;;
  esac
  $PY -m pip install $missing
fi
# --no-deps on purpose: the build uses only the CUTLASS C++ headers this wheel ships, not its Python
# package, so `pip check` lists the wheel's own dependencies as missing (expected).
$PY -c "import cutlass_library" 2>/dev/null || $PY -m pip install --no-deps nvidia-cutlass==4.2.0.0

if $PY -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" && [ -n "${CUDA_HOME:-}" ] \
   && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  # pip's verbose output goes to the log; the terminal gets one line per compiled file
  # (scripts/build_progress.py), and the log's tail if the build fails.
  jobs=${MAX_JOBS:-$(nproc)}
  log=build/install.log
  mkdir -p build
  echo "selscan_fused: compiling the CUDA extension (nvcc from $CUDA_HOME, $jobs parallel jobs):" \
       "about 6-7 minutes on 2 cores, about 2 on 16."
  echo "selscan_fused: one line per compiled file follows; the whole build output goes to $log."
  if ! MAX_JOBS=$jobs PYTHONUNBUFFERED=1 $PY -m pip install -v --no-build-isolation --no-deps -e . 2>&1 \
       | tee "$log" | $PY scripts/build_progress.py; then
    echo "selscan_fused: the build failed. The end of $log:" >&2
    tail -n 40 "$log" >&2
    echo "selscan_fused: the whole build output is in $log." >&2
    exit 1
  fi
else
  echo "selscan_fused: no CUDA toolkit (CUDA_HOME/bin/nvcc) or a CPU-only torch: installing without the" \
       "CUDA extension (impl='reference' only)." >&2
  SELSCAN_SKIP_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e .
fi
$PY -m selscan_fused.demo
