// The floating-point row types the kernels read and write (FP8 rows travel as raw bytes).
#pragma once

namespace jax_ep {

enum class ElementType { kBF16, kF16, kF32 };

}  // namespace jax_ep
