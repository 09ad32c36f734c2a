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
missing="$(need torch torch) $(need ninja ninja) $(need pytest pytest) $(need numpy numpy) $(need wheel wheel)"
missing=$(echo $missing)
if [ -n "$missing" ]; then $PY -m pip install $missing; fi
$PY -c "import cutlass_library" 2>/dev/null || $PY -m pip install --no-deps nvidia-cutlass==4.2.0.0

if $PY -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" && [ -n "${CUDA_HOME:-}" ] \
   && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install --no-build-isolation --no-deps -e .
else
  echo "selscan_fused: no CUDA toolkit (CUDA_HOME/bin/nvcc) or a CPU-only torch: installing without the" \
       "CUDA extension (impl='reference' only)." >&2
  SELSCAN_SKIP_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e .
fi
$PY -m selscan_fused.demo
