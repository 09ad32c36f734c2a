"""The named shapes, the floors and the peers' figures of docs/perf/layer-forward.md ("Ceilings, named shapes, peers
and floors")."""
from dataclasses import dataclass

# (batch, L, D, N)
SHAPES = {
    "S1": (8, 2048, 256, 16),    # the original model's size
    "S2": (8, 4096, 1024, 16),   # mid-size layer
    "S3": (4, 8192, 2048, 16),   # Mamba-scale inner width, GEMM-heavy
    "S4": (1, 65536, 256, 16),   # one long sequence: parallelism must come from L
    "S5-1": (1, 1, 1024, 16),    # tiny decode-like calls: launch latency
    "S5-16": (1, 16, 1024, 16),
    "S5-64": (1, 64, 1024, 16),
}

# Ceilings measured on the H200 (docs/perf/layer-forward.md).
EXP_RATE = 3.6e12        # __expf per second (MUFU)
COPY_BW = 4.21e12        # bytes read + written per second
# GEMM floor rates as docs/perf/layer-forward.md takes them: bf16/fp16 on the bf16 rate, float32 on the tf32 rate.
MATMUL_RATE = {"bf16": 788e12, "fp16": 788e12, "fp32-high": 434e12, "fp32": 434e12}

# mamba-ssm on the same H200 model (docs/perf/layer-forward.md; not re-measured here), in ms.
MAMBA_SCAN_ONLY = {("S1", "fp32"): 0.162, ("S1", "bf16"): 0.080, ("S2", "bf16"): 0.556,
                   ("S3", "bf16"): 1.099, ("S4", "bf16"): 0.631}
MAMBA_USER_PATH = {("S1", "fp32"): 0.305, ("S1", "bf16"): 0.201, ("S2", "bf16"): 1.355,
                   ("S3", "bf16"): 2.835, ("S4", "bf16"): 1.079}


def shape_dims(shape: str):
    """(batch, L, D, N) of a named shape, or of one written as BxLxDxN (e.g. 4x2048x256x16)."""
    if shape in SHAPES:
        return SHAPES[shape]
    try:
        b, L, D, N = (int(v) for v in shape.split("x"))
    except ValueError:
        raise ValueError(f"unknown shape {shape!r}: a name of {sorted(SHAPES)} or BxLxDxN") from None
    return b, L, D, N


@dataclass
class Floors:
    exp_ms: float
    io_ms: float
    gemm_ms: float


def floors(shape: str, dtype: str) -> Floors:
    b, L, D, N = shape_dims(shape)
    tokens = b * L
    elem = 4 if dtype.startswith("fp32") else 2
    return Floors(
        exp_ms=tokens * D * N / EXP_RATE * 1e3,
        io_ms=tokens * D * 2 * elem / COPY_BW * 1e3,
        gemm_ms=2 * tokens * D * (D + 2 * N) / MATMUL_RATE[dtype] * 1e3,
    )
