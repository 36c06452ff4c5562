// The cached dispatch: rows moved again along a dispatch's handle (the combine's backward, a
// second tensor through the same routing): the owner stages its rows, each PE gathers the rows
// its handle names (expert_major: a token's row loaded once per rank, stored to its pairs'
// rows).
#include "kernels/intranode.h"

namespace jax_ep {
namespace {

// ------------------------------------------------------------------------------ cached

__global__ void __launch_bounds__(kThreads) stage_rows(CachedDispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCachedStage, kEnter);
  enter_call(ctx, call, "cached_dispatch");
  profile_mark(ctx, kProfCachedStage, kWaited);
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  char* rows = region<char>(ctx, ctx.rank, plan.rows);
  for (int t = warp; t < a.num_tokens; t += gridDim.x * kWarps)
    copy_row(rows + t * row_stride(a.row_bytes), static_cast<const char*>(a.x) + t * a.row_bytes,
             a.row_bytes, lane, 32);
  profile_end(ctx, kProfCachedStage);
  if (last_block(ctx, 2) && threadIdx.x == 0) {
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfCachedStage, kRetired);
  }
}

__global__ void __launch_bounds__(kThreads) gather_rows(CachedDispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfCachedGather, "cached_dispatch");
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < a.capacity; i += gridDim.x * kWarps) {
    char* out = static_cast<char*>(a.out) + size_t(i) * a.row_bytes;
    const int s = a.src_rank[i], t = a.src_token[i];
    // A handle entry out of range (not one dispatch made) reads nothing: a zero row.
    if (s < 0 || s >= ctx.num_ranks || t < 0 || t >= a.num_tokens) {
      zero_row(out, a.row_bytes, lane, 32);
    } else {
      copy_row(out, region<char>(ctx, s, plan.rows) + size_t(t) * row_stride(a.row_bytes),
               a.row_bytes, lane, 32);
    }
  }
  profile_end(ctx, kProfCachedGather);
  if (last_block(ctx, 3) && threadIdx.x == 0) {
    finish_call(ctx, call);
    profile_mark(ctx, kProfCachedGather, kRetired);
  }
}

// expert_major: each (source, token) row with pairs here is loaded once (over NVLink for a
// peer's) and stored to every pair's row; rows of no pair get zeros.
template <int kSources>
__global__ void __launch_bounds__(kThreads) gather_pairs(CachedDispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfCachedGather, "cached_dispatch");
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps, R = ctx.num_ranks, K = a.num_topk;
  for (int i = warp; i < a.capacity; i += warps) {
    const int s = a.src_rank[i];
    if (s < 0 || s >= R)
      zero_row(static_cast<char*>(a.out) + size_t(i) * a.row_bytes, a.row_bytes, lane, 32);
  }
  for (int item = warp; item < R * a.num_tokens; item += warps) {
    char* dsts[kSources];
    bool any = false;
#pragma unroll
    for (int j = 0; j < kSources; ++j) {
      const int row = j < K ? a.pair_row[size_t(item) * K + j] : -1;
      const bool valid = row >= 0 && row < a.capacity;
      dsts[j] = valid ? static_cast<char*>(a.out) + size_t(row) * a.row_bytes : nullptr;
      any |= valid;
    }
    if (!any) continue;
    const int s = item / a.num_tokens, t = item % a.num_tokens;
    broadcast_row(dsts, region<char>(ctx, s, plan.rows) + size_t(t) * row_stride(a.row_bytes),
                  a.row_bytes, lane);
  }
  profile_end(ctx, kProfCachedGather);
  if (last_block(ctx, 3) && threadIdx.x == 0) {
    finish_call(ctx, call);
    profile_mark(ctx, kProfCachedGather, kRetired);
  }
}

}  // namespace

cudaError_t launch_cached_stage(const CachedDispatchArgs& a, cudaStream_t stream) {
  return launch_after_previous(stage_rows, a.num_blocks, kThreads, 0, stream, a);
}

cudaError_t launch_cached_dispatch(const CachedDispatchArgs& a, cudaStream_t stream) {
  if (a.weights != nullptr) return launch_combine_backward(a, stream);
  const cudaError_t status = launch_cached_stage(a, stream);
  if (status != cudaSuccess) return status;
  auto launch = [&](auto kernel) {
    return launch_after_previous(kernel, a.num_blocks, kThreads, 0, stream, a);
  };
  if (a.pair_row == nullptr) return launch(gather_rows);
  if (a.num_topk <= 2) return launch(gather_pairs<2>);
  if (a.num_topk <= 4) return launch(gather_pairs<4>);
  if (a.num_topk <= 8) return launch(gather_pairs<8>);
  return launch(gather_pairs<kMaxSources>);
}


}  // namespace jax_ep
