// The pull combine (rank_major's default below the push combine's CTA count, and the
// source_slots layout's second path): every PE stages the rows of y that peers will read, then
// each PE sums its tokens' rows, pulled over NVLink, in the contract's order.
// Also the combine's entry point, which picks the path. docs/design.md, section 5.2.
#include "kernels/combine_common.cuh"

namespace jax_ep {
namespace {

// Stages the rows that peers will read (y outside the XLA windows): rows whose token lives on
// another PE. Rows of this PE's own tokens stay where they are; the reduce reads them straight
// from y. Unstaged calls (y in this PE's XLA allocation, mapped at the peers) have no stage
// kernel: the reduce kernel opens them (open_unstaged_combine).
__global__ void __launch_bounds__(kThreads) combine_stage(CombineArgs a, size_t row_bytes) {
  const uint64_t call = enter_combine_stage(a);
  const PeerContext& ctx = a.ctx;
  const RegionPlan plan = plan_combine(a.capacity, row_bytes);
  const int used = min(*a.num_received, a.capacity);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  char* rows = region<char>(ctx, ctx.rank, plan.rows);
  for (int i = warp; i < used; i += gridDim.x * kWarps) {
    const int source = a.src_rank[i];
    if (source < 0 || source == ctx.rank) continue;  // padding, or read locally from y
    copy_row(rows + i * row_stride(row_bytes), static_cast<const char*>(a.y) + i * row_bytes,
             row_bytes, lane, 32);
  }
  float* weights = region<float>(ctx, ctx.rank, plan.meta_weights);
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < used; i += gridDim.x * kThreads)
    weights[i] = a.weights[i];
  profile_end(ctx, kProfCombineStage);
  if (last_block(ctx, 4) && threadIdx.x == 0) {
    fence_acq_rel_system();  // the staged rows and weights, before the words that release them
    publish_combine_inputs(ctx, call, 0, 0);
    profile_mark(ctx, kProfCombineStage, kRetired);
  }
}

}  // namespace

cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream) {
  if (args.expert_major) return launch_combine_pairs(args, stream);
  if (args.copy_engine) return launch_combine_copy(args, stream);
  if (args.push) return launch_combine_push(args, stream);
  const size_t row_bytes = element_size(args.dtype) * size_t(args.hidden);
  if (!args.unstaged) {  // the unstaged call opens in the reduce kernel (open_unstaged_combine)
    const cudaError_t status =
        launch_after_previous(combine_stage, args.num_blocks, kThreads, 0, stream, args, row_bytes);
    if (status != cudaSuccess) return status;
  }
  return for_element_type(args.dtype, [&](auto element) {
    return launch_reduce_rows<decltype(element), false>(args, row_bytes, stream);
  });
}

}  // namespace jax_ep
