// The push combine (rank_major): each PE stores the rows of y that peers own straight into the
// owners' [source][token] slots over NVLink and, in the same kernel, sums its own tokens once
// their peers' rows have arrived; no staging copy of y. It runs the fused dispatch's loop
// (push_loop.cuh). docs/design.md, section 5.1.
#include "kernels/combine_common.cuh"
#include "kernels/push_loop.cuh"

namespace jax_ep {
namespace {

// Tokens per arrival counter: one while Control::arrivals (kMaxChunks) holds them all. The
// last chunk to complete is summed by one warp after the last row lands, so its size is the
// call's tail: 4-token chunks took 265 µs per call against the pull's 258, one-token chunks
// 242 (2×H100, DeepSeek-V3 shapes, benchmarks/RESULTS.md).
__host__ __device__ inline int push_chunk_tokens(int num_tokens) {
  const int spread = (num_tokens + kMaxChunks - 1) / kMaxChunks;
  return spread > 1 ? spread : 1;
}

// One block: the push kernel's work counters reset, then every peer past the previous call
// (its slots and arrival counters here are free once it is).
__global__ void __launch_bounds__(kThreads) combine_push_enter(CombineArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  profile_mark(ctx, kProfCombineStage, kEnter);
  if (threadIdx.x == 0) {
    Control* mine = control_of(ctx, ctx.rank);
    mine->work_cursor[kCursorCombine] = 0;   // rows of y to push
    mine->work_cursor[kCursorDispatch] = 0;  // chunks of this PE's tokens to sum (one range)
  }
  enter_call(ctx, current_call(ctx), "combine");
  profile_mark(ctx, kProfCombineStage, kWaited);
  profile_end(ctx, kProfCombineStage);
}

// Peer rows that complete chunk c here: tokens of the chunk with a row at another rank.
__device__ __forceinline__ int rows_expected(const CombineArgs& a, int first, int last, int lane) {
  const int R = a.ctx.num_ranks, me = a.ctx.rank;
  int n = 0;
  for (int i = first * R + lane; i < last * R; i += 32) {
    const int slot = a.send_slot[i];
    n += i % R != me && slot >= 0 && slot < a.capacity;
  }
  return __reduce_add_sync(0xffffffffu, n);
}

// Row i of y to its owner's slot [me][token] with its weight, then (after a system fence) the
// owner's arrival counter of that token's chunk. Rows of this PE's own tokens stay in y.
__device__ __forceinline__ void push_row(const CombineArgs& a, const CombinePushPlan& plan,
                                         size_t row_bytes, int per_chunk, int i, int lane) {
  const PeerContext& ctx = a.ctx;
  const int owner = a.src_rank[i];
  if (owner < 0 || owner == ctx.rank) return;
  const int t = a.src_token[i];
  const size_t slot = size_t(ctx.rank) * a.num_tokens + t;
  copy_row(region<char>(ctx, owner, plan.rows) + slot * row_stride(row_bytes),
           static_cast<const char*>(a.y) + size_t(i) * row_bytes, row_bytes, lane, 32);
  if (lane == 0) region<float>(ctx, owner, plan.weights)[slot] = a.weights[i];
  __syncwarp();
  if (lane == 0) {
    fence_acq_rel_system();
    atomicAdd_system(&control_of(ctx, owner)->arrivals[t / per_chunk], 1u);
  }
}

// Tokens [first, last) of this PE: each token's rows (its own from y, the peers' from their
// slots here) summed in the contract's order.
template <typename T, int kVector, int kSources>
__device__ __forceinline__ void sum_tokens(const CombineArgs& a, const CombinePushPlan& plan,
                                           size_t row_bytes, int first, int last, int lane) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, me = ctx.rank, H = a.hidden;
  for (int t = first; t < last; ++t) {
    const T* rows[kSources];
    float weights[kSources];
#pragma unroll
    for (int j = 0; j < kSources; ++j) {  // fixed order: ranks ascending
      rows[j] = nullptr;
      weights[j] = 0.f;
      if (j >= R) continue;
      const int slot = a.send_slot[size_t(t) * R + j];
      if (slot < 0 || slot >= a.capacity) continue;  // not sent, or dropped
      if (j == me) {
        weights[j] = a.weights[slot];
        rows[j] = reinterpret_cast<const T*>(static_cast<const char*>(a.y) + slot * row_bytes);
      } else {
        const size_t at = size_t(j) * a.num_tokens + t;
        weights[j] = __ldcg(region<float>(ctx, me, plan.weights) + at);
        rows[j] = reinterpret_cast<const T*>(region<char>(ctx, me, plan.rows) +
                                             at * row_stride(row_bytes));
      }
    }
    weighted_sum<T, kVector, kSources, true>(rows, weights,
                                             static_cast<T*>(a.out) + size_t(t) * H,
                                             H / kVector, lane);
  }
}

// The push combine as push_loop's path: the items are the rows of y, the chunks this PE's
// tokens (one range), consumed by summing them.
template <typename T, int kVector, int kSources>
struct PushCombine {
  const CombineArgs& a;
  const CombinePushPlan& plan;
  size_t row_bytes;
  int per_chunk;
  __device__ int last(int c) const { return min(a.num_tokens, (c + 1) * per_chunk); }
  __device__ int2 range(int) const {
    return {0, (a.num_tokens + per_chunk - 1) / per_chunk};
  }
  __device__ int needed(int c, int lane) const {
    return rows_expected(a, c * per_chunk, last(c), lane);
  }
  __device__ void consume(int c, int lane) const {
    sum_tokens<T, kVector, kSources>(a, plan, row_bytes, c * per_chunk, last(c), lane);
  }
  __device__ void push(int i, int lane) const { push_row(a, plan, row_bytes, per_chunk, i, lane); }
  __device__ int peer(int c) const {  // the first rank with a row of the chunk's first token
    const PeerContext& ctx = a.ctx;
    for (int j = 0; j < ctx.num_ranks; ++j)
      if (j != ctx.rank && a.send_slot[size_t(c) * per_chunk * ctx.num_ranks + j] >= 0) return j;
    return ctx.rank;
  }
};

// Each warp pushes rows of y (claimed from a counter) and between them holds at most one chunk
// of this PE's tokens, summing it once its peers' rows have all arrived (push_loop).
template <typename T, int kVector, int kSources>
__global__ void __launch_bounds__(kThreads) combine_push(CombineArgs a, size_t row_bytes) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineReduce, kEnter);
  profile_mark(ctx, kProfCombineReduce, kWaited);
  const CombinePushPlan plan = plan_combine_push(ctx.num_ranks, a.num_tokens, row_bytes);
  PushCombine<T, kVector, kSources> path{a, plan, row_bytes, push_chunk_tokens(a.num_tokens)};
  Control* mine = control_of(ctx, ctx.rank);
  const PushCursors cursors{&mine->work_cursor[kCursorCombine],
                            &mine->work_cursor[kCursorDispatch]};
  push_loop(ctx, path, min(*a.num_received, a.capacity), cursors, 1, "combine",
            "rows of a chunk of tokens (push)");
  profile_end(ctx, kProfCombineReduce);
  if (last_block(ctx, 5) && threadIdx.x == 0) {
    finish_call(ctx, call);
    profile_mark(ctx, kProfCombineReduce, kRetired);
  }
}

template <typename T, int kVector>
struct Push {
  template <int kSources>
  struct Of {
    static constexpr auto value = combine_push<T, kVector, kSources>;
  };
};

}  // namespace

cudaError_t launch_combine_push(const CombineArgs& a, cudaStream_t stream) {
  const size_t row_bytes = element_size(a.dtype) * size_t(a.hidden);
  cudaError_t status = launch_after_previous(combine_push_enter, 1, kThreads, 0, stream, a);
  if (status != cudaSuccess) return status;
  const int R = a.ctx.num_ranks;
  return for_element_type(a.dtype, [&](auto element) {
    using T = decltype(element);
    constexpr int kWide = 16 / sizeof(T);
    if (a.hidden % kWide == 0)
      return launch_for_sources<Push<T, kWide>::template Of>(R, a.num_blocks, stream, a,
                                                             row_bytes);
    return launch_for_sources<Push<T, 1>::template Of>(R, a.num_blocks, stream, a, row_bytes);
  });
}

}  // namespace jax_ep
