// The copy-engine combine (rank_major and source_slots): the GPU's copy engines send each
// owner its rows, chunk by chunk with a landed flag each, alongside the reduce, which waits for
// the flags. docs/design.md, section 5.3.
#include "kernels/combine_common.cuh"
#include "runtime/diagnostics.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

// Copy-engine combine, stage of chunk `chunk`: for every owner s but us, records [first,
// first + copy_chunk_rows) of s's block of y (and their weights) go to staged slot s, from
// where the copy engines send the whole chunk to s. Rows of a block are contiguous in y and
// ascending in the owner's token list; a block's start is the first row with src_rank >= s.
__global__ void __launch_bounds__(kThreads) combine_copy_stage(CombineArgs a, size_t row_bytes,
                                                               int chunk) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  if (chunk == 0) profile_mark(ctx, kProfCombineStage, kEnter);
  const int R = ctx.num_ranks, T = a.num_tokens;
  const CombineCopyPlan plan = plan_combine_copy(R, T, row_bytes);
  const int used = min(*a.num_received, a.capacity);
  __shared__ int block_start[kMaxCopyRanks + 1];
  for (int s = threadIdx.x; s <= R; s += kThreads) {  // first row with src_rank >= s
    int lo = 0, hi = used;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (a.src_rank[mid] < s) lo = mid + 1; else hi = mid;
    }
    block_start[s] = lo;
  }
  __syncthreads();
  const int first = chunk * a.copy_chunk_rows;
  const int rows = min(a.copy_chunk_rows, T - first);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  char* staged = region<char>(ctx, ctx.rank, plan.staged);
  for (int w = warp; w < R * rows; w += gridDim.x * kWarps) {
    const int s = w / rows, q = first + w % rows;
    if (s == ctx.rank || block_start[s] + q >= block_start[s + 1]) continue;
    const int row = block_start[s] + q;
    char* record = staged + (size_t(s) * T + q) * plan.record_stride;
    copy_row(record, static_cast<const char*>(a.y) + row * row_bytes, row_bytes, lane, 32);
    if (lane == 0) *reinterpret_cast<float*>(record + plan.weight_offset) = a.weights[row];
  }
  if (chunk + 1 == a.copy_chunks) profile_end(ctx, kProfCombineStage);
}

// Copy-engine combine: guard, then per chunk a stage kernel and, once it has run, the chunk's
// transfers to every owner, as one copy sequence alongside the reduce (which waits for the
// landed flags). The staging area needs no release of its own: a peer's next call touches our
// buffer only after every rank's done, and each rank raises done only once all the chunks sent
// to it, read from the senders' staging areas, have landed.
cudaError_t enqueue_combine_copies(const CombineArgs& a, size_t row_bytes, cudaStream_t stream) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, T = a.num_tokens;
  const CombineCopyPlan plan = plan_combine_copy(R, T, row_bytes);
  const char* local = static_cast<const char*>(transport()->local);
  cudaError_t status = copy_engine_guard(ctx, /*combine=*/true, stream);
  if (status != cudaSuccess) return status;
  CombineArgs staging = a;  // the stage kernels live in a cached graph: a fixed profile row
  staging.ctx.profile = graph_profile_row();
  CopySequence sequence;
  for (int c = 0; c < a.copy_chunks; ++c) {
    const int stage = sequence.add_kernel(combine_copy_stage, dim3(a.num_blocks), dim3(kThreads),
                                          staging, row_bytes, c);
    const int first = c * a.copy_chunk_rows, rows = std::min(a.copy_chunk_rows, T - first);
    for (int step = 1; step < R; ++step) {
      const int owner = (ctx.rank + step) % R;
      const size_t staged = size_t(owner) * T + first, landed = size_t(ctx.rank) * T + first;
      const CopyPiece piece = {plan.landed + landed * plan.record_stride,
                               local + plan.staged + staged * plan.record_stride,
                               rows * plan.record_stride};
      sequence.add_transfer(owner, c, stage, &piece, 1);
    }
  }
  return copy_engine_run(ctx, sequence, stream);
}

// Copy-engine combine, source_slots: an owner's rows are one block of y, so each chunk goes
// straight from y (and the weights) to the owner's landing area; no stage kernels.
cudaError_t enqueue_combine_slots(const CombineArgs& a, size_t row_bytes, cudaStream_t stream) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, T = a.num_tokens;
  const SlotsCombinePlan plan = plan_combine_slots(R, T, row_bytes);
  cudaError_t status = copy_engine_guard(ctx, /*combine=*/true, stream);
  if (status != cudaSuccess) return status;
  CopySequence sequence;
  for (int c = 0; c < a.copy_chunks; ++c) {
    const int first = c * a.copy_chunk_rows, rows = std::min(a.copy_chunk_rows, T - first);
    for (int step = 1; step < R; ++step) {
      const int owner = (ctx.rank + step) % R;
      const size_t block = size_t(owner) * T + first, landed = size_t(ctx.rank) * T + first;
      const CopyPiece pieces[2] = {
          {plan.rows + landed * row_bytes, static_cast<const char*>(a.y) + block * row_bytes,
           rows * row_bytes},
          {plan.weights + landed * sizeof(float), a.weights + block, rows * sizeof(float)},
      };
      sequence.add_transfer(owner, c, /*after_kernel=*/-1, pieces, 2);
    }
  }
  return copy_engine_run(ctx, sequence, stream);
}

}  // namespace

cudaError_t launch_combine_copy(const CombineArgs& args, cudaStream_t stream) {
  CombineArgs a = args;
  const size_t row_bytes = element_size(a.dtype) * size_t(a.hidden);
  if (a.source_slots)
    copy_chunking(a.num_tokens, row_bytes, a.copy_chunk_bytes, &a.copy_chunk_rows,
                  &a.copy_chunks);
  else  // staged: rows travel as records (a row and its weight) of record_stride bytes
    copy_chunking(a.num_tokens, plan_combine_copy(1, 1, row_bytes).record_stride,
                  a.copy_chunk_bytes, &a.copy_chunk_rows, &a.copy_chunks);
  cudaError_t status = a.source_slots ? enqueue_combine_slots(a, row_bytes, stream)
                                      : enqueue_combine_copies(a, row_bytes, stream);
  if (status == cudaSuccess)
    status = for_element_type(a.dtype, [&](auto element) {
      return launch_reduce_rows<decltype(element), true>(a, row_bytes, stream);
    });
  if (status == cudaSuccess) status = copy_engine_join(a.ctx, stream);
  return status;
}

}  // namespace jax_ep
