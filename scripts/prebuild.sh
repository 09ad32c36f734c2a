#!/usr/bin/env bash
# The extension built on a machine without a GPU (nvcc and the CUDA headers suffice) for another
# machine's torch, packed into one archive that `SELSCAN_PREBUILT=FILE.tgz scripts/gpu_check.sh` there
# restores instead of building (the fused kernels alone take minutes to compile).
#
#   scripts/prebuild.sh PYTHON OUT.tgz
#
# PYTHON: a Python of the target's minor version with the target's torch version installed, a CUDA build,
# plus ninja and nvidia-cutlass, e.g. `python3.12 -m venv V && V/bin/pip install torch==2.11.0 ninja
# nvidia-cutlass==4.2.0.0` for torch 2.11.0+cu130 on Python 3.12. The objects go to a temporary folder;
# the source tree's selscan_fused/ is left as it was (its _build_info.py restored). The archive holds
# selscan_fused/*.so and _build_info.py, which records the torch and Python the build is for (gpu_check.sh
# refuses an archive built for another).
set -euo pipefail
py=${1:?usage: scripts/prebuild.sh PYTHON OUT.tgz}
out=${2:?usage: scripts/prebuild.sh PYTHON OUT.tgz}
here=$(cd "$(dirname "$0")/.." && pwd)
case $out in /*) ;; *) out=$PWD/$out ;; esac
tmp=$(mktemp -d)
info=$here/selscan_fused/_build_info.py
[ -f "$info" ] && cp "$info" "$tmp/info.bak"
restore() { if [ -f "$tmp/info.bak" ]; then cp "$tmp/info.bak" "$info"; else rm -f "$info"; fi; rm -rf "$tmp"; }
trap restore EXIT
(cd "$here" && CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-2} \
  "$py" setup.py build_ext --build-temp "$tmp/t" --build-lib "$tmp/l")
cp "$info" "$tmp/l/selscan_fused/"
tar czf "$out" -C "$tmp/l" selscan_fused
echo "wrote $out:"; tar tzf "$out"; cat "$tmp/l/selscan_fused/_build_info.py"
