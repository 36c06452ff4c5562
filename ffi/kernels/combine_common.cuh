// What the combine paths share (included by combine_pull.cu, combine_copy.cu and
// combine_pairs.cu): element types, the vector accesses and the float32 weighted sum in the
// contract's order, and the rank_major reduce that the pull and copy-engine paths both end with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

size_t element_size(ElementType type) { return type == ElementType::kF32 ? 4 : 2; }

// The common start of the pull combine's stage kernels: after the previous kernel, the reduce's
// work cursor reset, every peer past the previous call. Returns the call number.
__device__ __forceinline__ uint64_t enter_combine_stage(const CombineArgs& a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCombineStage, kEnter);
  reset_cursor(ctx, kCursorCombine);  // for the reduce that follows
  enter_call(ctx, call, "combine");
  profile_mark(ctx, kProfCombineStage, kWaited);
  return call;
}

// One thread: this PE's y and weights for the call (0, 0: staged) to every peer of the group,
// this PE included, as words tagged with the call; the caller has fenced what they release.
__device__ inline void publish_combine_inputs(const PeerContext& ctx, uint64_t call, uint64_t y,
                                              uint64_t weights) {
  const int me = pe_of(ctx, ctx.rank);
  for (int p = 0; p < ctx.num_ranks; ++p)
    store_tagged_pair(control_of(ctx, p)->combine_in[me], call, y, weights);
}

// The unstaged combine's opening, in the reduce kernel's block 0 (nothing to stage, so no
// kernel of its own: as one, with its block arrival and the kernel boundary after it, it took
// 5.9-6.1 µs of each call's GPU cycle on 2×H100): the work cursor reset, every peer past the
// previous call, then y and the weights published as tagged words. A GPU-scope fence releases
// the reset to this PE's blocks, which acquire this PE's own words before claiming; no system
// fence or flag: the peers read y and the weights, which earlier kernels wrote, over NVLink.
__device__ void open_unstaged_combine(const CombineArgs& a, uint64_t call) {
  const PeerContext& ctx = a.ctx;
  profile_mark(ctx, kProfCombineStage, kEnter);
  if (threadIdx.x == 0) control_of(ctx, ctx.rank)->work_cursor[kCursorCombine] = 0;
  enter_call(ctx, call, "combine");
  profile_mark(ctx, kProfCombineStage, kWaited);
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();
    publish_combine_inputs(ctx, call, reinterpret_cast<uint64_t>(a.y),
                           reinterpret_cast<uint64_t>(a.weights));
  }
  profile_end(ctx, kProfCombineStage);
  profile_mark(ctx, kProfCombineStage, kRetired);
}

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
  if (!kCopy && a.unstaged && blockIdx.x == 0) open_unstaged_combine(a, call);
  // Pull: each source's y and weights as it published them (0: its staged copy), read where
  // published, through its mapped XLA allocation; every word acquired, this PE's own included
  // (it releases the work cursor's reset).
  __shared__ uint32_t halves[kCopy ? 1 : 4 * kSources];
  if (!kCopy) {
    const Control* mine = control_of(ctx, ctx.rank);
    for (int i = threadIdx.x; i < 4 * ctx.num_ranks; i += kThreads)
      halves[i] = wait_tagged</*kAcquire=*/true>(ctx, &mine->combine_in[pe_of(ctx, i / 4)][i % 4],
                                                 uint32_t(call), "combine",
                                                 "a source's rows published", i / 4);
    __syncthreads();
  }
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
  __shared__ const char* unstaged_rows[kCopy ? 1 : kSources];
  __shared__ const float* unstaged_weights[kCopy ? 1 : kSources];
  if (!kCopy) {
    if (threadIdx.x < R) {
      const int pe = pe_of(ctx, threadIdx.x);
      const uint32_t* h = halves + 4 * threadIdx.x;
      const uint64_t y = tagged_pair_value(h, 0), w = tagged_pair_value(h, 1);
      unstaged_rows[threadIdx.x] = nullptr;
      unstaged_weights[threadIdx.x] = nullptr;
      if (int(threadIdx.x) != me && y != 0) {
        if (!xla_mapped(ctx, pe)) {  // published, not mapped here
          report_timeout(ctx, "combine", "a peer's y outside the mapped XLA allocations",
                         threadIdx.x, 0, 0);
          trap_after_report();
        }
        unstaged_rows[threadIdx.x] = xla_address(ctx, pe, y);
        unstaged_weights[threadIdx.x] = reinterpret_cast<const float*>(xla_address(ctx, pe, w));
      }
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
      } else if (!kCopy && unstaged_rows[j] != nullptr) {  // the peer's own y
        weights[j] = unstaged_weights[j][slot];
        rows[j] = reinterpret_cast<const T*>(unstaged_rows[j] + size_t(slot) * row_bytes);
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
    finish_call(ctx, call);
    // Peers read this PE's y and weights where XLA keeps them: the call (and with it XLA's
    // hold on them) ends only once every peer is done with it.
    if (!kCopy && a.unstaged) {
      const Control* mine = control_of(ctx, me);
      for (int s = 0; s < R; ++s)
        wait_flag(ctx, &mine->done[pe_of(ctx, s)], call, "combine", "peer done reading y", s);
    }
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

// The rank_major reduce for T rows: 16-byte accesses where y's and the output's rows allow
// (H % kWide == 0; staged rows are 16-byte aligned).
template <typename T, bool kCopy>
cudaError_t launch_reduce_rows(const CombineArgs& a, size_t row_bytes, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  const int R = a.ctx.num_ranks;
  if (a.hidden % kWide == 0)
    return launch_for_sources<Reduce<T, kWide, kCopy>::template Of>(R, a.num_blocks, stream, a,
                                                                    row_bytes);
  return launch_for_sources<Reduce<T, 1, kCopy>::template Of>(R, a.num_blocks, stream, a,
                                                              row_bytes);
}

// f<T>() for the call's element type.
template <typename F>
cudaError_t for_element_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kBF16: return f(__nv_bfloat16{});
    case ElementType::kF16: return f(__half{});
    case ElementType::kF32: return f(float{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace jax_ep
