"""Build of selscan_fused: a pure-Python package plus two CUDA extensions: selscan_fused._C (op
bindings and the unfused path's scan kernel, sm_80/sm_90) and selscan_fused._fused (the fused
CUTLASS/CuTe kernel, sm_90a only).

    pip install --no-build-isolation .        # or -e . ; builds against the torch already installed

Environment:
    CUDA_HOME            CUDA toolkit (default /usr/local/cuda when it exists; nvcc 12.4+ for sm_90a)
    SELSCAN_CUTLASS_DIR  a CUTLASS checkout (holding include/ and tools/util/include/) to use instead of
                         the headers of the pinned nvidia-cutlass wheel (see third_party/README.md)
    MAX_JOBS             parallel compile jobs (torch's ninja build)
    NVCC_THREADS         threads of one nvcc call across its targets (default 2)
    SELSCAN_SKIP_CUDA=1  build the pure-Python package only (impl="reference" works, the CUDA paths do not)
"""
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()

# The nvcc on PATH can be a wrapper script, from which torch would guess a wrong CUDA home.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"


def cutlass_include_dirs():
    """Include folders of CUTLASS: $SELSCAN_CUTLASS_DIR, else the nvidia-cutlass wheel's copy."""
    root = os.environ.get("SELSCAN_CUTLASS_DIR")
    if root:
        base = Path(root)
    else:
        try:
            import cutlass_library  # nvidia-cutlass==4.2.0.0 ships the C++ tree under source/
        except ImportError as e:
            raise RuntimeError(
                "CUTLASS headers not found: `pip install --no-deps nvidia-cutlass==4.2.0.0`, or set "
                "SELSCAN_CUTLASS_DIR to a CUTLASS checkout (third_party/README.md)") from e
        base = Path(cutlass_library.__file__).parent / "source"
    dirs = [base / "include", base / "tools" / "util" / "include"]
    for d, marker in zip(dirs, ("cute", "cutlass/util")):
        if not (d / marker).is_dir():
            raise RuntimeError(f"CUTLASS include folder {d} is missing or incomplete (no {marker}/)")
    return [str(d) for d in dirs]


def extension_modules():
    if os.environ.get("SELSCAN_SKIP_CUDA") == "1":
        print("selscan_fused: SELSCAN_SKIP_CUDA=1, building without the CUDA extension", file=sys.stderr)
        # The build record says a CUDA build was made (tests/test_build.py then expects a working
        # extension); one left from an earlier build would no longer be true.
        (ROOT / "selscan_fused" / "_build_info.py").unlink(missing_ok=True)
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None:
        raise RuntimeError(
            "selscan_fused: no CUDA toolkit found (set CUDA_HOME). A CPU-only torch build cannot build CUDA "
            "extensions either: install a CUDA build of torch. SELSCAN_SKIP_CUDA=1 builds without the extension.")

    cuda_home = Path(CUDA_HOME)
    include_dirs = [str(ROOT / "csrc")] + cutlass_include_dirs()
    if (cuda_home / "include" / "cccl").is_dir():  # CUDA 13 moved CCCL (cub, thrust, libcu++) here
        include_dirs.append(str(cuda_home / "include" / "cccl"))

    cxx_flags = [
        "-O3",
        "-std=c++20",  # torch 2.14 headers need it
    ]
    nvcc_common = [
        "-O3",
        "-std=c++20",
        "-DNDEBUG",  # important for speed: CUTLASS/CuTe asserts off
        "--expt-relaxed-constexpr",  # CuTe
        "-U__CUDA_NO_HALF_OPERATORS__",  # CUTLASS needs the half/bfloat16 operators torch turns off
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        f"--threads={os.environ.get('NVCC_THREADS', '2')}",  # parallel across the targets below
    ]
    nvcc_scan = nvcc_common + [
        "-gencode=arch=compute_80,code=sm_80",  # A100-class GPUs
        "-gencode=arch=compute_90,code=sm_90",  # H100/H200
        "-gencode=arch=compute_90,code=compute_90",  # PTX for newer GPUs
    ]
    nvcc_fused = nvcc_common + [
        "-gencode=arch=compute_90a,code=sm_90a",  # wgmma, TMA, setmaxnreg: H100/H200 only
        # wgmma N = 80, 96, ...: the stacked [W_delta; W_B; W_C] tile is kDt + 2N rows, one instruction
        "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
    ]
    # Extra nvcc flags for the fused kernel only, e.g. "-Xptxas -v", or the timing-only switches of
    # benchmarks/ablation/roles.patch.
    extra_fused = os.environ.get("SELSCAN_FUSED_NVCC_FLAGS", "").split()
    nvcc_fused += extra_fused

    write_build_info(torch, str(cuda_home), include_dirs[1], " ".join(extra_fused))
    # _C: the op bindings, the unfused path's scan kernels, the block's causal conv and decode step (no
    # CUTLASS).
    ext_c = CUDAExtension(
        name="selscan_fused._C",
        sources=["csrc/python_module.cpp", "csrc/torch_ops.cpp", "csrc/conv/conv_ops.cpp",
                 "csrc/decode/decode_ops.cpp"]
        + sorted(str(p.relative_to(ROOT)) for d in ("scan", "conv", "decode")
                 for p in (ROOT / "csrc" / d).glob("*.cu")),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_scan},
    )
    # _fused: the fused CUTLASS/CuTe kernel, sm_90a only, one .cu per dtype (parallel builds).
    ext_fused = CUDAExtension(
        name="selscan_fused._fused",
        sources=["csrc/fused/fused_module.cpp", "csrc/fused/fused_ops.cpp"]
        + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "fused").glob("*.cu")),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_fused},
    )
    # SELSCAN_BUILD_ONLY=_C or _fused: build that extension alone (the other one, built earlier against the
    # same torch, is left in place), e.g. after a change to the decode or conv kernels only.
    only = os.environ.get("SELSCAN_BUILD_ONLY", "")
    exts = [e for e in (ext_c, ext_fused) if not only or e.name == f"selscan_fused.{only}"]
    if not exts:
        raise RuntimeError(f"selscan_fused: SELSCAN_BUILD_ONLY={only!r} names no extension (use _C or _fused)")
    return exts, {"build_ext": BuildExtension}


def write_build_info(torch, cuda_home, cutlass_include, fused_extra_flags=""):
    """Records what the extension is built against, so that a failed load can say why."""
    (ROOT / "selscan_fused" / "_build_info.py").write_text(
        "# Generated by setup.py: what selscan_fused._C was built against.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"TORCH_CUDA_VERSION = {torch.version.cuda!r}\n"
        f"CUDA_HOME = {cuda_home!r}\n"
        f"CUTLASS_INCLUDE = {cutlass_include!r}\n"
        f"PYTHON_VERSION = {sys.version.split()[0]!r}\n"
        f"FUSED_NVCC_EXTRA_FLAGS = {fused_extra_flags!r}\n"
    )


ext_modules, cmdclass = extension_modules()

setup(
    name="selscan_fused",
    version="0.3.0.dev0",
    description="Selective state-space (Mamba-1 style) scan layer for PyTorch with a fused Hopper kernel",
    packages=find_packages(include=["selscan_fused", "selscan_fused.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    # The benchmarks' progress bars and plots (benchmarks/paper_figure.py, plot_results.py); the op never
    # needs them.
    extras_require={"bench": ["matplotlib", "tqdm"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
