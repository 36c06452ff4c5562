// Batched GEMMs through cuBLASLt with a target SM count: the expert GEMMs' share of the GPU
// while a communication kernel holds the rest (docs/design.md §8.1).
//
// XLA's own GEMMs are persistent kernels of one CTA an SM, so a jax_ep call beside one waits
// for SMs; cuBLASLt's CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET sizes the kernel for fewer SMs.
// The library is the one XLA's GPU backend has loaded (dlopen by its soname, no link-time
// dependency), so the extension builds without cuBLAS headers.
#pragma once

#include <cstdint>
#include <string>

struct CUstream_st;

namespace jax_ep {

enum class GemmType { kBF16, kF16, kF32 };

// out[l] = op(a[l]) @ op(b[l]) for l < batch, row-major: a is [m, k] ([k, m] if trans_a),
// b is [k, n] ([n, k] if trans_b), out [m, n]; float32 accumulation; float32 operands
// rounded to TF32 where tf32. sm_count: the SMs the kernel is sized for (0: every SM).
struct BatchedGemm {
  int64_t batch, m, n, k;
  bool trans_a, trans_b;
  GemmType a_type, b_type, out_type;
  int sm_count;
  bool tf32;
};

// Runs it on `stream`; an empty string on success, else what failed.
std::string run_batched_gemm(const BatchedGemm& gemm, const void* a, const void* b, void* out,
                             CUstream_st* stream);

}  // namespace jax_ep
