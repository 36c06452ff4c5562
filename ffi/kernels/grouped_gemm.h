// Grouped GEMM for few rows per group (experts.grouped_matmul(impl="cuda")): rows grouped by
// expert, each group times its expert's weights, the weights read once per pass of 64 rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/element_type.h"

namespace jax_ep {

// y [P, N] = x [P, K] rows grouped by expert (group l: the group_sizes[l] rows after the
// groups before it) times w[l]: [L, K, N], or [L, N, K] read transposed (transpose_w); rows
// past the groups' sum are zero. bf16 or f16 operands and result, float32 accumulation.
cudaError_t launch_grouped_gemm(const void* x, const void* w, const int32_t* group_sizes,
                                void* y, ElementType type, int64_t rows, int64_t k, int64_t n,
                                int64_t groups, bool transpose_w, cudaStream_t stream);

}  // namespace jax_ep
