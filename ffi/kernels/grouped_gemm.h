// Grouped GEMM for few rows per group (experts.grouped_matmul(impl="cuda")): rows grouped by
// expert, each group times its expert's weights, the weights read once per pass of 64 rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/element_type.h"

namespace jax_ep {

// y [P, N] = x [P, K] rows grouped by expert (group l: rows [group_ends[l - 1],
// group_ends[l]), the inclusive sum of the group sizes) times w[l]: [L, K, N], or [L, N, K]
// read transposed (transpose_w); rows past the last group are zero. row_index (or nullptr):
// row i is x's row row_index[i] instead (x has x_rows rows; an index outside them reads
// zeros). bf16 or f16 operands and result, float32 accumulation; as many blocks as sm_count
// SMs hold (0: every SM).
cudaError_t launch_grouped_gemm(const void* x, const int32_t* row_index, int64_t x_rows,
                                const void* w, const int32_t* group_ends, void* y,
                                ElementType type, int64_t rows, int64_t k, int64_t n,
                                int64_t groups, bool transpose_w, int sm_count,
                                cudaStream_t stream);

}  // namespace jax_ep
