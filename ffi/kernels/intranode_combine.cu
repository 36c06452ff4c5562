// Intranode combine: every PE stages its expert outputs, then each source PE pulls the rows
// of its tokens from the peers and sums them in float32 in the contract's fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/intranode.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

size_t element_size(ElementType type) { return type == ElementType::kF32 ? 4 : 2; }

template <typename T> struct Element;
template <> struct Element<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <> struct Element<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Element<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};

// Stages the rows that peers will read: rows whose token lives on another PE. Rows of this
// PE's own tokens stay where they are; the reduce reads them straight from y.
__global__ void __launch_bounds__(kThreads) combine_stage(CombineArgs a, size_t row_bytes) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineStage, kEnter);
  reset_cursor(ctx, kCursorCombine);  // for the reduce that follows
  enter_call(ctx, call, "combine");
  profile_mark(ctx, kProfCombineStage, kWaited);
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
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfCombineStage, kRetired);
  }
}

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

// Chunk c of kVector elements of a row: one 16-byte access when that is its size.
template <int kVector, typename T>
__device__ __forceinline__ void load_vector(T (&dst)[kVector], const T* row, int c) {
  if constexpr (kVector * sizeof(T) == 16) {
    *reinterpret_cast<int4*>(dst) = reinterpret_cast<const int4*>(row)[c];
  } else {
#pragma unroll
    for (int v = 0; v < kVector; ++v) dst[v] = row[c * kVector + v];
  }
}
template <int kVector, typename T>
__device__ __forceinline__ void store_vector(T* row, int c, const T (&src)[kVector]) {
  if constexpr (kVector * sizeof(T) == 16) {
    reinterpret_cast<int4*>(row)[c] = *reinterpret_cast<const int4*>(src);
  } else {
#pragma unroll
    for (int v = 0; v < kVector; ++v) row[c * kVector + v] = src[v];
  }
}

// out = sum over j ascending of weights[j] * rows[j] (null rows skipped), in float32, then
// rounded to T. One warp, `kVector` elements per lane access (16 bytes when rows allow it);
// each lane loads kUnroll chunks of every source before adding, so about 16 loads per lane are
// in flight (over NVLink that latency, not bandwidth, bounds a warp). kBypassL1: the rows may
// have been written during this kernel (by a copy engine).
template <typename T, int kVector, int kSources, bool kBypassL1>
__device__ __forceinline__ void weighted_sum(const T* (&rows)[kSources],
                                             const float (&weights)[kSources], T* out,
                                             int chunks, int lane) {
  constexpr int kUnroll = kSources >= 16 ? 1 : 16 / kSources;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    T values[kUnroll][kSources][kVector];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int j = 0; j < kSources; ++j) {
        if (rows[j] == nullptr || c >= chunks) continue;
        if constexpr (kVector * sizeof(T) == 16) {
          const int4* src = reinterpret_cast<const int4*>(rows[j]) + c;
          *reinterpret_cast<int4*>(values[u][j]) = kBypassL1 ? __ldcg(src) : *src;
        } else {
#pragma unroll
          for (int v = 0; v < kVector; ++v)
            values[u][j][v] = kBypassL1 ? __ldcg(rows[j] + c * kVector + v)
                                        : rows[j][c * kVector + v];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float acc[kVector];
#pragma unroll
      for (int v = 0; v < kVector; ++v) acc[v] = 0.f;
#pragma unroll
      for (int j = 0; j < kSources; ++j) {
        if (rows[j] == nullptr) continue;
#pragma unroll
        for (int v = 0; v < kVector; ++v)  // no FMA contraction: the order is the contract
          acc[v] = __fadd_rn(acc[v], __fmul_rn(weights[j], Element<T>::load(values[u][j][v])));
      }
      T packed[kVector];
#pragma unroll
      for (int v = 0; v < kVector; ++v) packed[v] = Element<T>::store(acc[v]);
      if constexpr (kVector * sizeof(T) == 16) {
        reinterpret_cast<int4*>(out)[c] = *reinterpret_cast<int4*>(packed);
      } else {
#pragma unroll
        for (int v = 0; v < kVector; ++v) out[c * kVector + v] = packed[v];
      }
    }
  }
}

// expert_major stage: for every peer's token with pairs here, their rows summed in k order
// with the rows' weights, rounded to T, at the token's first pair's row of the staging region:
// one row per (token, rank) crosses back. This PE's own tokens' partials are summed by the
// reduce, straight from y.
template <typename T, int kVector, int kSources>
__global__ void __launch_bounds__(kThreads) combine_stage_pairs(CombineArgs a, size_t row_bytes) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineStage, kEnter);
  reset_cursor(ctx, kCursorCombine);  // for the reduce that follows
  enter_call(ctx, call, "combine");
  profile_mark(ctx, kProfCombineStage, kWaited);
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
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, ctx.rank)->epoch = call;
    profile_mark(ctx, kProfCombineReduce, kRetired);
  }
}

// rank_major reduce, one warp per token: the token's source rows (one per rank, at most
// kSources) are found once, then summed in the contract's order (weighted_sum).
// kCopy (copy-engine combine, rank_major): the peers' rows are in our landing area, record
// send_slot - base[r] of slot r (base[r]: our first row at r, the smallest slot we have
// there), readable once its chunk's flag is up; loads from there bypass L1 (a record may
// share a cache line with one that lands later).
template <typename T, int kVector, int kSources, bool kCopy>
__global__ void __launch_bounds__(kThreads) combine_reduce(CombineArgs a, size_t row_bytes) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineReduce, kEnter);
  if (!kCopy) wait_all_ready(ctx, call, "combine");
  profile_mark(ctx, kProfCombineReduce, kWaited);
  const RegionPlan plan = plan_combine(a.capacity, row_bytes);
  const int R = ctx.num_ranks, me = ctx.rank;
  const CombineCopyPlan copy_plan = plan_combine_copy(R, a.num_tokens, row_bytes);
  const SlotsCombinePlan slots_plan = plan_combine_slots(R, a.num_tokens, row_bytes);
  __shared__ int base[kCopy ? kMaxCopyRanks : 1];
  if (kCopy && !a.source_slots) {
    for (int r = threadIdx.x; r < R; r += kThreads) base[r] = a.capacity;
    __syncthreads();
    for (int i = threadIdx.x; i < a.num_tokens * R; i += kThreads) {
      const int slot = a.send_slot[i];
      if (slot >= 0 && slot < a.capacity) atomicMin(&base[i % R], slot);
    }
    __syncthreads();
  }
  const int H = a.hidden;
  const size_t stride = row_stride(row_bytes);
  const int lane = threadIdx.x % 32;
  const int chunks = H / kVector;
  // Tokens claimed from the combine work counter: SMs whose loads return faster take more.
  uint32_t* cursor = &control_of(ctx, ctx.rank)->work_cursor[kCursorCombine];
  for (int t = claim_item(cursor, lane); t < a.num_tokens; t = claim_item(cursor, lane)) {
    // Compile-time indices only, so that these stay in registers.
    const T* rows[kSources];
    float weights[kSources];
#pragma unroll
    for (int j = 0; j < kSources; ++j) {  // fixed order: ranks ascending
      rows[j] = nullptr;
      weights[j] = 0.f;
      if (j >= R) continue;
      const int r = j;
      const int slot = a.send_slot[size_t(t) * R + j];
      if (slot < 0 || slot >= a.capacity) continue;  // not sent, dropped (or not a handle's)
      if (r == me) {  // our own expert outputs: straight from y
        weights[j] = a.weights[slot];
        rows[j] = reinterpret_cast<const T*>(static_cast<const char*>(a.y) + slot * row_bytes);
      } else if (kCopy && a.source_slots) {  // landed unstaged: rows [r][T], weights [r][T]
        wait_landed(ctx, r, t / a.copy_chunk_rows, lane, "combine");
        const size_t record = size_t(r) * a.num_tokens + t;
        weights[j] = __ldcg(region<float>(ctx, me, slots_plan.weights) + record);
        rows[j] = reinterpret_cast<const T*>(region<char>(ctx, me, slots_plan.rows) +
                                             record * row_bytes);
      } else if (kCopy) {
        const int q = slot - base[r];
        wait_landed(ctx, r, q / a.copy_chunk_rows, lane, "combine");
        const char* record = region<char>(ctx, me, copy_plan.landed) +
                             (size_t(r) * a.num_tokens + q) * copy_plan.record_stride;
        weights[j] = __ldcg(reinterpret_cast<const float*>(record + copy_plan.weight_offset));
        rows[j] = reinterpret_cast<const T*>(record);
      } else {
        weights[j] = region<float>(ctx, r, plan.meta_weights)[slot];
        rows[j] = reinterpret_cast<const T*>(region<char>(ctx, r, plan.rows) + slot * stride);
      }
    }
    weighted_sum<T, kVector, kSources, kCopy>(rows, weights,
                                              static_cast<T*>(a.out) + size_t(t) * H, chunks,
                                              lane);
  }
  profile_end(ctx, kProfCombineReduce);
  if (last_block(ctx, 5) && threadIdx.x == 0) {
    if (kCopy) close_copy_engine_call(ctx, a.copy_chunks, "combine");
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, ctx.rank)->epoch = call;
    profile_mark(ctx, kProfCombineReduce, kRetired);
  }
}

// kernel<kSources>, kSources the smallest of 2, 4, 8, kMaxSources that holds `sources`.
template <template <int> class Kernel>
cudaError_t launch_for_sources(int sources, int num_blocks, cudaStream_t stream,
                               const CombineArgs& a, size_t row_bytes) {
  auto launch = [&](auto kernel) {
    return launch_after_previous(kernel, num_blocks, kThreads, 0, stream, a, row_bytes);
  };
  if (sources <= 2) return launch(Kernel<2>::value);
  if (sources <= 4) return launch(Kernel<4>::value);
  if (sources <= 8) return launch(Kernel<8>::value);
  return launch(Kernel<kMaxSources>::value);
}

template <typename T, int kVector, bool kCopy>
struct Reduce {
  template <int kSources>
  struct Of {
    static constexpr auto value = combine_reduce<T, kVector, kSources, kCopy>;
  };
};
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

template <typename T, int kVector, bool kCopy>
cudaError_t launch_reduce(const CombineArgs& a, size_t row_bytes, cudaStream_t stream) {
  const int R = a.ctx.num_ranks;
  if (!a.expert_major)
    return launch_for_sources<Reduce<T, kVector, kCopy>::template Of>(R, a.num_blocks, stream, a,
                                                                      row_bytes);
  if (a.num_topk <= 8)
    return launch_for_sources<ReducePairs<T, kVector, 8>::template Of>(R, a.num_blocks, stream,
                                                                       a, row_bytes);
  return launch_for_sources<ReducePairs<T, kVector, kMaxSources>::template Of>(
      R, a.num_blocks, stream, a, row_bytes);
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

// The combine's backward, expert_major with row weights: each (source, token) row of the
// output gradient (staged by its owner) is loaded once, over NVLink for a peer's, and for each
// of the token's pairs here gives dy = w * g (rounded to T) and d_weight = <g, y> (float32,
// summed per lane then across the warp). Rows of no pair get zeros.
template <typename T, int kVector, int kPairs>
__global__ void __launch_bounds__(kThreads) combine_backward_pairs(CachedDispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCachedGather, kEnter);
  wait_all_ready(ctx, call, "cached_dispatch");
  profile_mark(ctx, kProfCachedGather, kWaited);
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
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, ctx.rank)->epoch = call;
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

template <typename T>
cudaError_t launch_typed(const CombineArgs& a, cudaStream_t stream) {
  const size_t row_bytes = sizeof(T) * a.hidden;
  constexpr int kWide = 16 / sizeof(T);
  if (a.copy_engine) {
    cudaError_t status = a.source_slots ? enqueue_combine_slots(a, row_bytes, stream)
                                        : enqueue_combine_copies(a, row_bytes, stream);
    if (status == cudaSuccess)
      status = a.hidden % kWide == 0 ? launch_reduce<T, kWide, true>(a, row_bytes, stream)
                                     : launch_reduce<T, 1, true>(a, row_bytes, stream);
    if (status == cudaSuccess) status = copy_engine_join(a.ctx, stream);
    return status;
  }
  const cudaError_t status =
      !a.expert_major
          ? launch_after_previous(combine_stage, a.num_blocks, kThreads, 0, stream, a, row_bytes)
      : a.hidden % kWide == 0
          ? launch_for_sources<StagePairs<T, kWide>::template Of>(a.num_topk, a.num_blocks,
                                                                  stream, a, row_bytes)
          : launch_for_sources<StagePairs<T, 1>::template Of>(a.num_topk, a.num_blocks, stream,
                                                              a, row_bytes);
  if (status != cudaSuccess) return status;
  // Staged rows are 16-byte aligned; y's rows and the output's need H % kWide == 0.
  return a.hidden % kWide == 0 ? launch_reduce<T, kWide, false>(a, row_bytes, stream)
                               : launch_reduce<T, 1, false>(a, row_bytes, stream);
}

}  // namespace

cudaError_t launch_combine_backward(const CachedDispatchArgs& a, cudaStream_t stream) {
  const cudaError_t status = launch_cached_stage(a, stream);
  if (status != cudaSuccess) return status;
  switch (a.dtype) {
    case ElementType::kBF16: return launch_backward_typed<__nv_bfloat16>(a, stream);
    case ElementType::kF16: return launch_backward_typed<__half>(a, stream);
    case ElementType::kF32: return launch_backward_typed<float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream) {
  CombineArgs a = args;
  const size_t row_bytes = element_size(a.dtype) * size_t(a.hidden);
  if (a.copy_engine && a.source_slots)  // transfers only, no stage kernels: the dispatch's size
    copy_chunking(a.num_tokens, row_bytes, kDispatchCopyChunkMB, &a.copy_chunk_rows,
                  &a.copy_chunks);
  else if (a.copy_engine)
    copy_chunking(a.num_tokens, plan_combine_copy(1, 1, row_bytes).record_stride,
                  kCombineCopyChunkMB, &a.copy_chunk_rows, &a.copy_chunks);
  switch (a.dtype) {
    case ElementType::kBF16: return launch_typed<__nv_bfloat16>(a, stream);
    case ElementType::kF16: return launch_typed<__half>(a, stream);
    case ElementType::kF32: return launch_typed<float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_ep
