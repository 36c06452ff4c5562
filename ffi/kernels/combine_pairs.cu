// The expert_major combine and its backward: the expert's rank sums a token's pairs (by k,
// with their weights) into one partial per (token, rank), so one row crosses back; the owner
// sums the partials by rank. docs/design.md, section 4.5.
#include "kernels/combine_common.cuh"

namespace jax_ep {
namespace {

// expert_major stage: for every peer's token with pairs here, their rows summed in k order
// with the rows' weights, rounded to T, at the token's first pair's row of the staging region:
// one row per (token, rank) crosses back. This PE's own tokens' partials are summed by the
// reduce, straight from y.
template <typename T, int kVector, int kSources>
__global__ void __launch_bounds__(kThreads) combine_stage_pairs(CombineArgs a, size_t row_bytes) {
  const uint64_t call = enter_combine_stage(a);
  const PeerContext& ctx = a.ctx;
  const RegionPlan plan = plan_combine(a.capacity, row_bytes);
  const int K = a.num_topk, items = ctx.num_ranks * a.num_tokens;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  char* staged = region<char>(ctx, ctx.rank, plan.rows);
  const size_t stride = row_stride(row_bytes);
  for (int item = warp; item < items; item += gridDim.x * kWarps) {
    if (item / a.num_tokens == ctx.rank) continue;
    const int32_t* pairs = a.pair_row + size_t(item) * K;
    const T* rows[kSources];
    float weights[kSources];
    int lead = -1;
#pragma unroll
    for (int j = 0; j < kSources; ++j) {  // k ascending
      rows[j] = nullptr;
      weights[j] = 0.f;
      const int row = j < K ? pairs[j] : -1;
      if (row < 0 || row >= a.capacity) continue;
      rows[j] = reinterpret_cast<const T*>(static_cast<const char*>(a.y) + size_t(row) * row_bytes);
      weights[j] = a.weights[row];
      if (lead < 0) lead = row;
    }
    if (lead < 0) continue;
    weighted_sum<T, kVector, kSources, false>(
        rows, weights, reinterpret_cast<T*>(staged + size_t(lead) * stride),
        a.hidden / kVector, lane);
  }
  profile_end(ctx, kProfCombineStage);
  if (last_block(ctx, 4) && threadIdx.x == 0) {
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfCombineStage, kRetired);
  }
}

// expert_major reduce, one warp per token: out[t] = sum over ranks r ascending of p_r, p_r
// the partial rank r's stage left at the token's first pair's row there (over NVLink), and
// ours summed here from y over the token's pairs in k order, rounded to T like the peers'.
template <typename T, int kVector, int kRanks, int kPairs>
__global__ void __launch_bounds__(kThreads) combine_reduce_pairs(CombineArgs a,
                                                                 size_t row_bytes) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineReduce, kEnter);
  wait_all_ready(ctx, call, "combine");
  profile_mark(ctx, kProfCombineReduce, kWaited);
  const RegionPlan plan = plan_combine(a.capacity, row_bytes);
  const int R = ctx.num_ranks, me = ctx.rank, K = a.num_topk, L = a.num_experts / R;
  const size_t stride = row_stride(row_bytes);
  const int lane = threadIdx.x % 32, chunks = a.hidden / kVector;
  uint32_t* cursor = &control_of(ctx, me)->work_cursor[kCursorCombine];
  for (int t = claim_item(cursor, lane); t < a.num_tokens; t = claim_item(cursor, lane)) {
    const T* remote[kRanks];  // each peer's partial (null: none, or ours)
    const T* local[kPairs];   // our pairs' rows of y, k ascending
    float weights[kPairs];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) remote[r] = nullptr;
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      local[k] = nullptr;
      weights[k] = 0.f;
    }
    bool here = false;
    for (int k = K - 1; k >= 0; --k) {  // descending: each rank's first pair is seen last
      const int e = a.topk_idx[size_t(t) * K + k];
      const int slot = a.send_slot[size_t(t) * K + k];
      if (e < 0 || e >= a.num_experts || slot < 0 || slot >= a.capacity) continue;
      const int r = e / L;
#pragma unroll
      for (int j = 0; j < kRanks; ++j)
        if (j == r && r != me)
          remote[j] = reinterpret_cast<const T*>(region<char>(ctx, r, plan.rows) +
                                                 slot * stride);
#pragma unroll
      for (int j = 0; j < kPairs; ++j)
        if (j == k && r == me) {
          local[j] = reinterpret_cast<const T*>(static_cast<const char*>(a.y) +
                                                size_t(slot) * row_bytes);
          weights[j] = a.weights[slot];
          here = true;
        }
    }
    T* out = static_cast<T*>(a.out) + size_t(t) * a.hidden;
    for (int c = lane; c < chunks; c += 32) {
      T rv[kRanks][kVector], lv[kPairs][kVector];
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (remote[r] != nullptr) load_vector<kVector>(rv[r], remote[r], c);
#pragma unroll
      for (int k = 0; k < kPairs; ++k)
        if (local[k] != nullptr) load_vector<kVector>(lv[k], local[k], c);
      float acc[kVector];
#pragma unroll
      for (int v = 0; v < kVector; ++v) acc[v] = 0.f;
#pragma unroll
      for (int r = 0; r < kRanks; ++r) {
        if (r == me && here) {
          float p[kVector];
#pragma unroll
          for (int v = 0; v < kVector; ++v) p[v] = 0.f;
#pragma unroll
          for (int k = 0; k < kPairs; ++k) {
            if (local[k] == nullptr) continue;
#pragma unroll
            for (int v = 0; v < kVector; ++v)  // no FMA contraction: the order is the contract
              p[v] = __fadd_rn(p[v], __fmul_rn(weights[k], Element<T>::load(lv[k][v])));
          }
#pragma unroll
          for (int v = 0; v < kVector; ++v)
            acc[v] = __fadd_rn(acc[v], Element<T>::load(Element<T>::store(p[v])));
        } else if (remote[r] != nullptr) {
#pragma unroll
          for (int v = 0; v < kVector; ++v)
            acc[v] = __fadd_rn(acc[v], Element<T>::load(rv[r][v]));
        }
      }
      T packed[kVector];
#pragma unroll
      for (int v = 0; v < kVector; ++v) packed[v] = Element<T>::store(acc[v]);
      store_vector<kVector>(out, c, packed);
    }
  }
  profile_end(ctx, kProfCombineReduce);
  if (last_block(ctx, 5) && threadIdx.x == 0) {
    finish_call(ctx, call);
    profile_mark(ctx, kProfCombineReduce, kRetired);
  }
}

template <typename T, int kVector, int kPairs>
struct ReducePairs {
  template <int kRanks>
  struct Of {
    static constexpr auto value = combine_reduce_pairs<T, kVector, kRanks, kPairs>;
  };
};
template <typename T, int kVector>
struct StagePairs {
  template <int kSources>
  struct Of {
    static constexpr auto value = combine_stage_pairs<T, kVector, kSources>;
  };
};

template <typename T>
cudaError_t launch_pairs_typed(const CombineArgs& a, size_t row_bytes, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  const int R = a.ctx.num_ranks;
  // Staged rows are 16-byte aligned; y's rows and the output's need H % kWide == 0.
  const bool wide = a.hidden % kWide == 0;
  cudaError_t status =
      wide ? launch_for_sources<StagePairs<T, kWide>::template Of>(a.num_topk, a.num_blocks,
                                                                    stream, a, row_bytes)
           : launch_for_sources<StagePairs<T, 1>::template Of>(a.num_topk, a.num_blocks, stream,
                                                               a, row_bytes);
  if (status != cudaSuccess) return status;
  if (a.num_topk <= 8)
    return wide ? launch_for_sources<ReducePairs<T, kWide, 8>::template Of>(
                      R, a.num_blocks, stream, a, row_bytes)
                : launch_for_sources<ReducePairs<T, 1, 8>::template Of>(R, a.num_blocks, stream,
                                                                        a, row_bytes);
  return wide ? launch_for_sources<ReducePairs<T, kWide, kMaxSources>::template Of>(
                    R, a.num_blocks, stream, a, row_bytes)
              : launch_for_sources<ReducePairs<T, 1, kMaxSources>::template Of>(
                    R, a.num_blocks, stream, a, row_bytes);
}

// The combine's backward, expert_major with row weights: each (source, token) row of the
// output gradient (staged by its owner) is loaded once, over NVLink for a peer's, and for each
// of the token's pairs here gives dy = w * g (rounded to T) and d_weight = <g, y> (float32,
// summed per lane then across the warp). Rows of no pair get zeros.
template <typename T, int kVector, int kPairs>
__global__ void __launch_bounds__(kThreads) combine_backward_pairs(CachedDispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfCachedGather, "cached_dispatch");
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps, R = ctx.num_ranks, K = a.num_topk;
  const int chunks = static_cast<int>(a.row_bytes / sizeof(T)) / kVector;
  for (int i = warp; i < a.capacity; i += warps) {
    const int s = a.src_rank[i];
    if (s >= 0 && s < R) continue;
    zero_row(static_cast<char*>(a.out) + size_t(i) * a.row_bytes, a.row_bytes, lane, 32);
    if (lane == 0) a.d_weights[i] = 0.f;
  }
  for (int item = warp; item < R * a.num_tokens; item += warps) {
    int rows[kPairs];
    float weights[kPairs], dots[kPairs];
    bool any = false;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int row = j < K ? a.pair_row[size_t(item) * K + j] : -1;
      rows[j] = row >= 0 && row < a.capacity ? row : -1;
      weights[j] = rows[j] >= 0 ? a.weights[rows[j]] : 0.f;
      dots[j] = 0.f;
      any |= rows[j] >= 0;
    }
    if (!any) continue;
    const int s = item / a.num_tokens, t = item % a.num_tokens;
    const T* g = reinterpret_cast<const T*>(region<char>(ctx, s, plan.rows) +
                                            size_t(t) * row_stride(a.row_bytes));
    for (int c = lane; c < chunks; c += 32) {
      T gv[kVector];
      load_vector<kVector>(gv, g, c);
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        if (rows[j] < 0) continue;
        T yv[kVector], dy[kVector];
        load_vector<kVector>(yv, reinterpret_cast<const T*>(static_cast<const char*>(a.y) +
                                                             size_t(rows[j]) * a.row_bytes), c);
#pragma unroll
        for (int v = 0; v < kVector; ++v) {
          const float gf = Element<T>::load(gv[v]);
          dy[v] = Element<T>::store(__fmul_rn(gf, weights[j]));
          dots[j] = fmaf(gf, Element<T>::load(yv[v]), dots[j]);
        }
        store_vector<kVector>(reinterpret_cast<T*>(static_cast<char*>(a.out) +
                                                   size_t(rows[j]) * a.row_bytes), c, dy);
      }
    }
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      if (rows[j] < 0) continue;
      float d = dots[j];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
      if (lane == 0) a.d_weights[rows[j]] = d;
    }
  }
  profile_end(ctx, kProfCachedGather);
  if (last_block(ctx, 3) && threadIdx.x == 0) {
    finish_call(ctx, call);
    profile_mark(ctx, kProfCachedGather, kRetired);
  }
}

template <typename T>
cudaError_t launch_backward_typed(const CachedDispatchArgs& a, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  const bool wide = (a.row_bytes / sizeof(T)) % kWide == 0;
  auto launch = [&](auto kernel) {
    return launch_after_previous(kernel, a.num_blocks, kThreads, 0, stream, a);
  };
  if (a.num_topk <= 8)
    return wide ? launch(combine_backward_pairs<T, kWide, 8>)
                : launch(combine_backward_pairs<T, 1, 8>);
  return wide ? launch(combine_backward_pairs<T, kWide, kMaxSources>)
              : launch(combine_backward_pairs<T, 1, kMaxSources>);
}

}  // namespace

cudaError_t launch_combine_pairs(const CombineArgs& a, cudaStream_t stream) {
  const size_t row_bytes = element_size(a.dtype) * size_t(a.hidden);
  return for_element_type(a.dtype, [&](auto element) {
    return launch_pairs_typed<decltype(element)>(a, row_bytes, stream);
  });
}

cudaError_t launch_combine_backward(const CachedDispatchArgs& a, cudaStream_t stream) {
  const cudaError_t status = launch_cached_stage(a, stream);
  if (status != cudaSuccess) return status;
  return for_element_type(a.dtype, [&](auto element) {
    return launch_backward_typed<decltype(element)>(a, stream);
  });
}

}  // namespace jax_ep
