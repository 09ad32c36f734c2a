// Element types the kernels are built for. Kept free of torch headers so that the kernel translation
// units compile without them; csrc/torch_ops.cpp maps at::ScalarType onto this.
#pragma once

namespace selscan {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

}  // namespace selscan
