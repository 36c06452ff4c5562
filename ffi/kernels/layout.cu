#include "kernels/layout.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRanksPerWord = 32;

// One thread per token; per-block counts in shared memory, then one global add per entry.
// Integer adds commute, so the result does not depend on scheduling.
__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int num_tokens, int num_topk,
                              int num_experts, int num_ranks, int32_t* tokens_per_rank,
                              int32_t* tokens_per_expert, bool* is_token_in_rank) {
  extern __shared__ int32_t counts[];  // [num_ranks + num_experts]
  int32_t* rank_counts = counts;
  int32_t* expert_counts = counts + num_ranks;
  for (int i = threadIdx.x; i < num_ranks + num_experts; i += blockDim.x) counts[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_tokens) {
    const int32_t* ids = topk_idx + static_cast<int64_t>(t) * num_topk;
    bool* row = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
    // Ranks are handled 32 at a time so that any EP size works with a register bitmask.
    for (int base = 0; base < num_ranks; base += kMaxRanksPerWord) {
      uint32_t mask = 0;
      for (int k = 0; k < num_topk; ++k) {
        int e = ids[k];
        if (e < 0 || e >= num_experts) continue;
        if (base == 0) atomicAdd(&expert_counts[e], 1);
        int r = e / experts_per_rank - base;
        if (r >= 0 && r < kMaxRanksPerWord) mask |= 1u << r;
      }
      int width = min(kMaxRanksPerWord, num_ranks - base);
      for (int r = 0; r < width; ++r) {
        bool hit = (mask >> r) & 1u;
        row[base + r] = hit;
        if (hit) atomicAdd(&rank_counts[base + r], 1);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_ranks; i += blockDim.x) {
    if (rank_counts[i]) atomicAdd(&tokens_per_rank[i], rank_counts[i]);
  }
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
    if (expert_counts[i]) atomicAdd(&tokens_per_expert[i], expert_counts[i]);
  }
}

}  // namespace

cudaError_t launch_layout(const int32_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                          int num_ranks, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(tokens_per_rank, 0, sizeof(int32_t) * num_ranks, stream);
  if (status == cudaSuccess)
    status = cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * num_experts, stream);
  if (status != cudaSuccess || num_tokens == 0) return status;
  size_t shared = sizeof(int32_t) * (num_ranks + num_experts);
  if (shared > 48 * 1024) {
    status = cudaFuncSetAttribute(layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(shared));
    if (status != cudaSuccess) return status;
  }
  int blocks = (num_tokens + kThreads - 1) / kThreads;
  layout_kernel<<<blocks, kThreads, shared, stream>>>(topk_idx, num_tokens, num_topk,
                                                      num_experts, num_ranks, tokens_per_rank,
                                                      tokens_per_expert, is_token_in_rank);
  return cudaGetLastError();
}

}  // namespace jax_ep
