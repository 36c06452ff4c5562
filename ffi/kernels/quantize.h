// FP8 block quantisation of a [rows, hidden] array (jax_ep.quantize_fp8 on the GPU).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/element_type.h"

namespace jax_ep {

// x [rows, hidden] (hidden a multiple of 128) -> data [rows, hidden] e4m3, scales
// [rows, hidden / 128] float32; with ue8m0 every scale a power of two.
cudaError_t launch_quantize_fp8(const void* x, ElementType type, int64_t rows, int64_t hidden,
                                bool ue8m0, void* data, float* scales, cudaStream_t stream);

}  // namespace jax_ep
