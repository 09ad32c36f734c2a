#!/usr/bin/env bash
# mamba-ssm as the benchmarks' peer, prepared in a git-ignored folder (never committed): its Python
# package (mamba_ssm) and causal-conv1d's, and the sources of its selective-scan and causal-conv1d
# kernels with a build script each (the peers' build scripts in ../shared/peers/ copy them). By default
# the kernels keep their bfloat16 instantiations only (the benchmarks run bfloat16; the other dtypes'
# instantiations and dispatch branches are dropped from the copies), which cuts their build on a
# 16-core H100/H200 machine from ~130 + ~310 s to a fraction of that; --all-dtypes keeps every dtype.
#
#   here (CPU machine), after `fetch github:state-spaces/mamba` and `fetch github:Dao-AILab/causal-conv1d`:
#     scripts/build_peers.sh src DEST MAMBA_GIT_DIR CONV_GIT_DIR [--all-dtypes]
#   on the GPU machine (carry DEST):
#     scripts/build_peers.sh build DEST        # both kernel modules, side by side; logs in DEST/*.log
#     export PYTHONPATH=DEST/py:DEST/scan:DEST/conv:$PYTHONPATH
#
# The benchmarks (block_bench.py, decode_bench.py, inference_throughput.py) then import mamba_ssm, and
# say why in their rows when it does not import.
set -euo pipefail
cmd=${1:?usage: scripts/build_peers.sh src DEST MAMBA_GIT CONV_GIT [--all-dtypes] | build DEST}
dest=${2:?destination folder}
here=$(cd "$(dirname "$0")/.." && pwd)
case $cmd in
src)
  mamba=${3:?mamba git dir}; conv=${4:?causal-conv1d git dir}; all=${5:-}
  peers=${SELSCAN_PEER_SCRIPTS:-$here/../shared/peers}
  rm -rf "$dest" && mkdir -p "$dest/py"
  bash "$peers/build_mamba_scan.sh" src "$mamba" "$dest/scan"
  bash "$peers/build_causal_conv1d.sh" src "$conv" "$mamba" "$dest/conv"
  git --git-dir="$mamba" archive HEAD mamba_ssm | tar -x -C "$dest/py"
  git --git-dir="$conv" archive HEAD causal_conv1d | tar -x -C "$dest/py"
  # mamba_ssm's package __init__ imports every model family (Mamba-2, Mamba-3: Triton and TileLang
  # kernels); the benchmarks import the modules they need directly.
  version=$(sed -n 's/^__version__ = //p' "$dest/py/mamba_ssm/__init__.py")
  printf '__version__ = %s\n' "$version" > "$dest/py/mamba_ssm/__init__.py"
  if [ "$all" != "--all-dtypes" ]; then
    python3 - "$dest" <<'PY'
import glob, os, re, sys
d = sys.argv[1]
bf16 = {"ITYPE": "using input_t = at::BFloat16;", "WTYPE": "using weight_t = at::BFloat16;"}

def bf16_dispatch(path, kinds):
    """The dispatch macros' bodies: the bfloat16 branch, else an error naming what was built."""
    s = open(path).read()
    for kind in kinds:
        pat = re.compile(r"(#define DISPATCH_%s_FLOAT_AND_HALF_AND_BF16\((\w+), NAME, \.\.\.\)\s*\\\n)(?:.*\\\n)*?.*\}\n"
                         % kind)
        m = pat.search(s)
        assert m, f"{path}: the {kind} dispatch macro changed; update scripts/build_peers.sh"
        var = m.group(2)
        body = (f"    if ({var} == at::ScalarType::BFloat16) {{ {bf16[kind]} __VA_ARGS__(); }} \\\n"
                f"    else {{ TORCH_CHECK(false, #NAME, \" built for bfloat16 only (scripts/build_peers.sh)\"); }}\n")
        s = s[:m.start()] + m.group(1) + body + s[m.end():]
    open(path, "w").write(s)

def bf16_instantiations(path):
    """Explicit instantiations other than <at::BFloat16, at::BFloat16> dropped (the conv's weights are
    in the model's dtype; the scan's generated files are per dtype, float32 weights)."""
    keep = ("<at::BFloat16, at::BFloat16>",)
    lines = open(path).read().splitlines(keepends=True)
    out = [l for l in lines if not (l.startswith("template void ") and not any(k in l for k in keep))]
    assert len(out) < len(lines), f"{path}: no instantiation dropped; update scripts/build_peers.sh"
    open(path, "w").writelines(out)

for f in glob.glob(f"{d}/scan/fwd_fp*.cu") + glob.glob(f"{d}/scan/bwd_fp*.cu"):
    os.remove(f)
bf16_dispatch(f"{d}/scan/binding.cpp", ["ITYPE"])
bf16_dispatch(f"{d}/conv/causal_conv1d.cpp", ["ITYPE", "WTYPE"])
for k in ("fwd", "bwd", "update"):
    bf16_instantiations(f"{d}/conv/causal_conv1d_{k}.cu")
print("kernels trimmed to bfloat16")
PY
  fi
  echo "peer sources in $dest; on the GPU machine: scripts/build_peers.sh build $dest"
  ;;
build)
  t0=$(date +%s)
  (bash "$dest/scan/build.sh" > "$dest/scan.log" 2>&1; echo "scan rc=$? $(( $(date +%s) - t0 )) s" >> "$dest/scan.log") &
  (bash "$dest/conv/build.sh" > "$dest/conv.log" 2>&1; echo "conv rc=$? $(( $(date +%s) - t0 )) s" >> "$dest/conv.log") &
  wait
  tail -n 2 "$dest/scan.log" "$dest/conv.log"
  ls "$dest"/scan/selective_scan_cuda*.so "$dest"/conv/causal_conv1d_cuda*.so
  ;;
*)
  echo "usage: scripts/build_peers.sh src DEST MAMBA_GIT CONV_GIT [--all-dtypes] | build DEST" >&2; exit 2 ;;
esac
