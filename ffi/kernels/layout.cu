#include <cooperative_groups.h>

#include <algorithm>

#include "kernels/device_utils.cuh"
#include "kernels/launch.h"
#include "kernels/layout.h"

namespace jax_ep {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kMaxRanksPerWord = 32;
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size

// One launch, one thread-block cluster: each block counts its tokens (one thread a token) in
// its own shared memory, then, after the cluster barrier, every block sums its share of the
// entries over the cluster's blocks through distributed shared memory and writes them. No
// memset before it and no global atomics (three launches took 13–14 µs per call in a chain);
// integer sums, so the result does not depend on scheduling.
__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int num_tokens, int num_topk,
                              int num_experts, int num_ranks, int32_t* tokens_per_rank,
                              int32_t* tokens_per_expert, bool* is_token_in_rank) {
  extern __shared__ int32_t counts[];  // [num_ranks + num_experts]
  int32_t* rank_counts = counts;
  int32_t* expert_counts = counts + num_ranks;
  const int entries = num_ranks + num_experts;
  for (int i = threadIdx.x; i < entries; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  wait_previous_kernel();

  cg::cluster_group cluster = cg::this_cluster();
  const int blocks = static_cast<int>(cluster.num_blocks());
  const int block = static_cast<int>(cluster.block_rank());
  const int experts_per_rank = num_experts / num_ranks;
  for (int t = block * blockDim.x + threadIdx.x; t < num_tokens; t += blocks * blockDim.x) {
    const int32_t* ids = topk_idx + static_cast<int64_t>(t) * num_topk;
    bool* row = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
    // Ranks are handled 32 at a time so that any EP size works with a register bitmask.
    for (int base = 0; base < num_ranks; base += kMaxRanksPerWord) {
      uint32_t mask = 0;
      for (int k = 0; k < num_topk; ++k) {
        const int e = ids[k];
        if (e < 0 || e >= num_experts) continue;
        if (base == 0) atomicAdd(&expert_counts[e], 1);
        const int r = e / experts_per_rank - base;
        if (r >= 0 && r < kMaxRanksPerWord) mask |= 1u << r;
      }
      const int width = min(kMaxRanksPerWord, num_ranks - base);
      for (int r = 0; r < width; ++r) {
        const bool hit = (mask >> r) & 1u;
        row[base + r] = hit;
        if (hit) atomicAdd(&rank_counts[base + r], 1);
      }
    }
  }
  cluster.sync();  // every block's counts are complete
  for (int i = block * blockDim.x + threadIdx.x; i < entries; i += blocks * blockDim.x) {
    int32_t sum = 0;
    for (int q = 0; q < blocks; ++q) sum += cluster.map_shared_rank(counts, q)[i];
    if (i < num_ranks)
      tokens_per_rank[i] = sum;
    else
      tokens_per_expert[i - num_ranks] = sum;
  }
  cluster.sync();  // no block's shared memory goes away while another block reads it
}

}  // namespace

cudaError_t launch_layout(const int32_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                          int num_ranks, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream) {
  const size_t shared = sizeof(int32_t) * (size_t(num_ranks) + num_experts);
  if (shared > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (status != cudaSuccess) return status;
  }
  const int blocks =
      std::max(1, std::min(kMaxClusterBlocks, (num_tokens + kThreads - 1) / kThreads));
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config = config_after_previous(dim3(blocks), dim3(kThreads), shared, stream,
                                                    /*cooperative=*/false, attributes);
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = blocks;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, layout_kernel, topk_idx, num_tokens, num_topk, num_experts,
                            num_ranks, tokens_per_rank, tokens_per_expert, is_token_in_rank);
}

}  // namespace jax_ep
