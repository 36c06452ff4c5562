#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/device_utils.cuh"
#include "kernels/launch.h"
#include "kernels/layout.h"

namespace jax_ep {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxRanksPerWord = 32;
constexpr int kMaxClusterBlocks = 16;  // a non-portable cluster size; capped by what the GPU allows

// One launch, one thread-block cluster: each block counts its tokens (one thread a token) in
// its own shared memory, then, after the cluster barrier, every block sums its share of the
// entries over the cluster's blocks through distributed shared memory and writes them. No
// memset before it and no global atomics (three launches took 13–14 µs per call in a chain);
// integer sums, so the result does not depend on scheduling. A warp adds its tokens of a rank
// with one atomic (every lane of a warp hits the same two counters at two ranks), and a
// token's ids come as 16-byte loads where they are aligned.
template <bool kVectorIds>
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
  const int lane = threadIdx.x % 32;
  // Every thread of a warp takes the same number of rounds, so the ballots see whole warps.
  const int stride = blocks * blockDim.x;
  for (int first = block * blockDim.x; first < num_tokens; first += stride) {
    const int t = first + threadIdx.x;
    const bool valid = t < num_tokens;
    const int32_t* ids = topk_idx + static_cast<int64_t>(t) * num_topk;
    bool* row = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
    // Ranks are handled 32 at a time so that any EP size works with a register bitmask.
    for (int base = 0; base < num_ranks; base += kMaxRanksPerWord) {
      uint32_t mask = 0;
      auto take = [&](int e) {
        if (e < 0 || e >= num_experts) return;
        if (base == 0) atomicAdd(&expert_counts[e], 1);
        const int r = e / experts_per_rank - base;
        if (r >= 0 && r < kMaxRanksPerWord) mask |= 1u << r;
      };
      if (valid) {
        if constexpr (kVectorIds) {
          for (int k = 0; k < num_topk; k += 4) {
            const int4 v = __ldg(reinterpret_cast<const int4*>(ids + k));
            take(v.x);
            take(v.y);
            take(v.z);
            take(v.w);
          }
        } else {
          for (int k = 0; k < num_topk; ++k) take(ids[k]);
        }
      }
      const int width = min(kMaxRanksPerWord, num_ranks - base);
      for (int r = 0; r < width; ++r) {
        const bool hit = (mask >> r) & 1u;
        if (valid) row[base + r] = hit;
        const uint32_t hits = __ballot_sync(0xffffffffu, hit);
        if (lane == 0 && hits != 0) atomicAdd(&rank_counts[base + r], __popc(hits));
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

// The largest cluster of this kernel the device schedules with this block size and shared
// memory (16 on H100 and H200; 8, the portable size, wherever clusters exist), asked once per
// device, kernel and launch shape.
cudaError_t largest_cluster(const void* kernel, cudaLaunchConfig_t config, int* most) {
  static std::mutex lock;
  static std::map<std::tuple<int, const void*, unsigned, size_t>, int> known;
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const auto key = std::make_tuple(device, kernel, config.blockDim.x, config.dynamicSmemBytes);
  std::lock_guard<std::mutex> guard(lock);
  const auto it = known.find(key);
  if (it != known.end()) {
    *most = it->second;
    return cudaSuccess;
  }
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (status != cudaSuccess) return status;
  // The query takes the launch without a cluster dimension.
  config.gridDim = dim3(kMaxClusterBlocks);
  config.numAttrs = 1;
  status = cudaOccupancyMaxPotentialClusterSize(most, kernel, &config);
  if (status != cudaSuccess) return status;
  known[key] = *most;
  return cudaSuccess;
}

}  // namespace

// 512 threads a block, one token a thread, up to 16 blocks; 1024 threads beyond 8192 tokens.
// Measured on H100 (benchmarks/RESULTS.md): 4.7 µs a launch at 4096 tokens against 5.7 with
// 1024-thread blocks, 6.2 against 8.4 at 16 384.
cudaError_t launch_layout(const int32_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                          int num_ranks, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream) {
  const bool vector_ids =
      num_topk % 4 == 0 && reinterpret_cast<uintptr_t>(topk_idx) % sizeof(int4) == 0;
  const auto kernel = vector_ids ? layout_kernel<true> : layout_kernel<false>;
  const size_t shared = sizeof(int32_t) * (size_t(num_ranks) + num_experts);
  if (shared > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (status != cudaSuccess) return status;
  }
  const int threads = num_tokens > kMaxClusterBlocks * 512 ? 1024 : 512;
  int blocks = std::max(1, std::min(kMaxClusterBlocks, (num_tokens + threads - 1) / threads));
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config = config_after_previous(dim3(blocks), dim3(threads), shared, stream,
                                                    /*cooperative=*/false, attributes);
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = blocks;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.numAttrs = 2;
  int most = 0;
  const cudaError_t status = largest_cluster(reinterpret_cast<const void*>(kernel), config, &most);
  if (status != cudaSuccess) return status;
  blocks = std::max(1, std::min(blocks, most));
  config.gridDim = dim3(blocks);
  attributes[1].val.clusterDim.x = blocks;
  return cudaLaunchKernelEx(&config, kernel, topk_idx, num_tokens, num_topk, num_experts,
                            num_ranks, tokens_per_rank, tokens_per_expert, is_token_in_rank);
}

}  // namespace jax_ep
