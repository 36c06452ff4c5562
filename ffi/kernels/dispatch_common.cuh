// What the dispatch paths share (included by dispatch_fused.cu and dispatch_pull.cu): the stage
// kernels that count each destination's rows and publish the counts, the offset tables every
// row's position comes from, and the call's closing counts and flags.
#pragma once

#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

// ------------------------------------------------------------------------------ stage

// Pull mode: this PE's ids and weights staged for the destinations (their rows' metadata),
// unless they read them in place; `thread` of `threads` taking part in each block, 16 bytes
// of each a thread where the arrays allow (one round of loads for the whole copy).
__device__ __forceinline__ void stage_ids(const DispatchArgs& a, int thread, int threads) {
  if (a.in_place) return;
  const PeerContext& ctx = a.ctx;
  const size_t n = size_t(a.num_tokens) * a.num_topk;
  int32_t* ids = region<int32_t>(ctx, ctx.rank, a.plan.meta_ids);
  float* weights = region<float>(ctx, ctx.rank, a.plan.meta_weights);
  const size_t first = size_t(blockIdx.x) * threads + thread, stride = size_t(gridDim.x) * threads;
  const bool wide = n % 4 == 0 && (reinterpret_cast<uintptr_t>(a.topk_idx) |
                                   reinterpret_cast<uintptr_t>(a.topk_weights)) % 16 == 0;
  if (wide) {
    for (size_t v = first; v < n / 4; v += stride) {
      const int4 i4 = reinterpret_cast<const int4*>(a.topk_idx)[v];
      const float4 w4 = reinterpret_cast<const float4*>(a.topk_weights)[v];
      reinterpret_cast<int4*>(ids)[v] = i4;
      reinterpret_cast<float4*>(weights)[v] = w4;
    }
    return;
  }
  for (size_t i = first; i < n; i += stride) {
    ids[i] = a.topk_idx[i];
    weights[i] = a.topk_weights[i];
  }
}

// The end of every stage kernel: pull mode stages this PE's tokens once (every destination
// reads the rows it needs) with their ids and weights (kIdsStaged: the kernel staged those
// already); then the last block raises ready[me].
template <bool kPull, bool kIdsStaged = false>
__device__ void finish_stage(const DispatchArgs& a, uint64_t call) {
  const PeerContext& ctx = a.ctx;
  const int T = a.num_tokens;
  if (!kPull) {  // push mode stages nothing: the rows go out once every count is known
    profile_end(ctx, kProfDispatchStage);
    if (last_block(ctx, 0) && threadIdx.x == 0) {
      const int me = pe_of(ctx, ctx.rank);
      for (int p = 0; p < ctx.num_ranks; ++p) {  // before ready: its release orders these
        Control* peer = control_of(ctx, p);
        peer->xla_out_x[me] = a.direct_out ? reinterpret_cast<uint64_t>(a.out_x) : 0;
        peer->xla_out_scales[me] = a.direct_out ? reinterpret_cast<uint64_t>(a.out_scales) : 0;
      }
      signal_all(ctx, Flag::kReady, call);
      profile_mark(ctx, kProfDispatchStage, kRetired);
    }
    return;
  }
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  char* rows = region<char>(ctx, ctx.rank, a.plan.rows);
  char* scales = region<char>(ctx, ctx.rank, a.plan.scales);
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  // the copy engines or the lean push's sources move the rows
  const bool stage_rows = !a.copy_engine && !a.in_place && !a.lean;
  for (int t = warp; t < T && stage_rows; t += warps) {
    copy_row(rows + t * stride, static_cast<const char*>(a.x) + t * a.x_row_bytes, a.x_row_bytes,
             lane, 32);
    if (a.scales != nullptr)
      copy_row(scales + t * scale_stride,
               reinterpret_cast<const char*>(a.scales) + t * a.scale_row_bytes,
               a.scale_row_bytes, lane, 32);
  }
  if (!kIdsStaged) stage_ids(a, threadIdx.x, kThreads);
  profile_end(ctx, kProfDispatchStage);
  // the lean push raises ready itself once this kernel is over (its block 0): the peers' stores
  // wait only for the tagged words, their metadata warps for ready
  if (a.lean) {
    allow_next_kernel();
    return;
  }
  if (last_block(ctx, 0) && threadIdx.x == 0) {
    const int me = pe_of(ctx, ctx.rank);
    const XlaInputs inputs =
        a.in_place ? XlaInputs{reinterpret_cast<uint64_t>(a.x), reinterpret_cast<uint64_t>(a.scales),
                               reinterpret_cast<uint64_t>(a.topk_idx),
                               reinterpret_cast<uint64_t>(a.topk_weights)}
                   : XlaInputs{0, 0, 0, 0};
    for (int p = 0; p < ctx.num_ranks; ++p)  // before ready: its release orders these
      control_of(ctx, p)->xla_in[me] = inputs;
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfDispatchStage, kRetired);
  }
}

// Block 0 of the stage zeroes what the kernels after it count into: tokens per local expert
// (rank_major receives count them with atomics; one op fewer per call than a memset) and the
// fused kernel's chunk cursors.
__device__ __forceinline__ void reset_call_state(const DispatchArgs& a) {
  if (blockIdx.x != 0) return;
  Control* mine = control_of(a.ctx, a.ctx.rank);
  for (int q = threadIdx.x; q < kMaxStageRanks; q += kThreads) mine->chunk_cursor[q] = 0;
  const int L = a.num_experts / a.ctx.num_ranks;
  for (int l = threadIdx.x; l < L; l += kThreads) a.tokens_per_expert[l] = 0;
}

// The start of every stage kernel: after the previous kernel (launched to overlap its drain),
// the call's counters reset and the call entered; returns the call number.
__device__ __forceinline__ uint64_t enter_stage(const DispatchArgs& a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchStage, kEnter);
  reset_cursor(ctx, kCursorDispatch);  // for the push that follows
  reset_call_state(a);
  enter_call(ctx, call, "dispatch");
  profile_mark(ctx, kProfDispatchStage, kWaited);
  return call;
}

// All CTAs of the grid (co-resident: a cooperative launch) meet here; GPU scope, reusable; a
// block that never arrives ends in a timeout report, not a hang.
__device__ void grid_barrier(const PeerContext& ctx) {
  Control* control = control_of(ctx, ctx.rank);
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* generation = &control->stage_generation;
    const unsigned seen = *generation;
    fence_acq_rel_gpu();
    if (atomicAdd(&control->stage_arrived, 1u) == gridDim.x - 1) {
      control->stage_arrived = 0;
      fence_acq_rel_gpu();
      atomicAdd(&control->stage_generation, 1u);
    } else {
      const uint64_t start = global_timer_ns();
      while (*generation == seen) {
        if (global_timer_ns() - start > ctx.timeout_ns) {  // a block never arrived
          report_timeout(ctx, "dispatch", "the other blocks of its own stage kernel",
                         ctx.rank, seen + 1ull, *generation);
          trap_after_report();
        }
      }
    }
    fence_acq_rel_gpu();
  }
  __syncthreads();
}

// rank_major stage spread over the whole grid (the per-destination scan of dispatch_stage
// gives each destination one CTA, i.e. R CTAs at work). CTA b takes a contiguous range of
// tokens: counts its tokens per destination, meets the others at a grid barrier, then ranks
// its tokens in each destination's list after the counts of the CTAs before it. Needs
// R <= kMaxStageRanks and a co-resident grid of at most kMaxStageBlocks CTAs.
template <bool kPull>
__global__ void __launch_bounds__(kThreads) dispatch_stage_ranks(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_stage(a);
  const int R = ctx.num_ranks, T = a.num_tokens, L = a.num_experts / R;
  const int span = (T + gridDim.x - 1) / gridDim.x;
  const int begin = min(T, int(blockIdx.x) * span), end = min(T, begin + span);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Control* control = control_of(ctx, ctx.rank);
  __shared__ int counts[kMaxStageRanks];
  __shared__ int warp_counts[kWarps][kMaxStageRanks];
  if (threadIdx.x < kMaxStageRanks) counts[threadIdx.x] = 0;
  __syncthreads();
  // The ids' copy needs no count: the threads past a block's span of tokens (the same in
  // every block, so that the blocks split the copy evenly) do it beside the count; where
  // every thread counts, all of them do it after the count, before the barrier.
  const int spare = kThreads - span;
  if (kPull && spare > 0 && int(threadIdx.x) >= span) stage_ids(a, threadIdx.x - span, spare);
  uint32_t first_mask = 0;  // this thread's first token's (the only one where T <= grid * 512)
  for (int t = begin + threadIdx.x; t < end; t += kThreads) {
    const uint32_t mask = rank_mask(a, t, L);
    if (t < begin + kThreads) first_mask = mask;
    for (int w = 0; w < R; ++w)
      if (mask >> w & 1) atomicAdd(&counts[w], 1);
  }
  __syncthreads();
  if (threadIdx.x < R) control->stage_counts[blockIdx.x * R + threadIdx.x] = counts[threadIdx.x];
  if (kPull && spare <= 0) stage_ids(a, threadIdx.x, kThreads);
  grid_barrier(ctx);

  // counts[w] <- tokens for w in the CTAs before this one; the last CTA publishes the totals.
  // Warp w sums destination w's counts, a lane a CTA: one round of loads, not one per CTA.
  for (int w = warp; w < R; w += kWarps) {
    int before = 0, total = 0;
    for (int b = lane; b < int(gridDim.x); b += 32) {
      const int n = __ldcg(&control->stage_counts[b * R + w]);  // other CTAs' writes
      if (b < int(blockIdx.x)) before += n;
      total += n;
    }
    before = __reduce_add_sync(0xffffffffu, before);
    total = __reduce_add_sync(0xffffffffu, total);
    if (lane == 0) counts[w] = before;
    if (blockIdx.x == gridDim.x - 1 && lane < R) {
      if (kPull && a.lean) {
        store_relaxed(&control_of(ctx, lane)->lean_totals[ctx.rank][w],
                      uint64_t(uint32_t(call)) << 32 | uint32_t(total));
      } else {
        const size_t matrix = kPull ? a.plan.matrix : a.push.matrix;
        region<int32_t>(ctx, lane, matrix)[size_t(ctx.rank) * R + w] = total;
      }
    }
  }
  if (kPull && a.lean && blockIdx.x == gridDim.x - 1 && threadIdx.x < R) {
    // where this PE's rows go this call, tagged as the totals (0: the landing area)
    const uint64_t x = a.direct_out ? reinterpret_cast<uint64_t>(a.out_x) : 0;
    const uint64_t scales = a.direct_out ? reinterpret_cast<uint64_t>(a.out_scales) : 0;
    store_tagged_pair(control_of(ctx, threadIdx.x)->lean_out[ctx.rank], call, x, scales);
  }
  __syncthreads();
  const uint32_t below_lane = (1u << lane) - 1;
  // the lean push reads the places while it writes send_slot (a token's pieces, other warps)
  int32_t* positions =
      kPull && a.lean ? region<int32_t>(ctx, ctx.rank, a.plan.positions) : a.send_slot;
  for (int base = begin; base < end; base += kThreads) {
    const int t = base + threadIdx.x;
    const uint32_t mask = t >= end ? 0u : base == begin ? first_mask : rank_mask(a, t, L);
    for (int w = 0; w < R; ++w) {  // this round's tokens per warp and destination
      const uint32_t hits = __ballot_sync(0xffffffffu, mask >> w & 1);
      if (lane == 0) warp_counts[warp][w] = __popc(hits);
    }
    __syncthreads();
    for (int w = 0; w < R; ++w) {
      const bool hit = mask >> w & 1;
      const uint32_t hits = __ballot_sync(0xffffffffu, hit);
      int slot = -1;
      if (hit) {
        slot = counts[w] + __popc(hits & below_lane);
        for (int v = 0; v < warp; ++v) slot += warp_counts[v][w];
        if (kPull)
          region<int32_t>(ctx, ctx.rank, a.plan.lists)[size_t(w) * a.plan.list_len + slot] = t;
      }
      if (t < end) positions[size_t(t) * R + w] = slot;
    }
    __syncthreads();
    if (threadIdx.x < R)  // this round's tokens come before the next round's
      for (int v = 0; v < kWarps; ++v) counts[threadIdx.x] += warp_counts[v][threadIdx.x];
    __syncthreads();
  }
  finish_stage<kPull, /*kIdsStaged=*/true>(a, call);
}

// expert_major stage spread over the whole grid, the pairs' twin of dispatch_stage_ranks
// (one CTA per expert, each scanning all T*K pairs, took 48 us of a 390 us dispatch at
// DeepSeek-V3 shapes). CTA b takes a contiguous range of pairs: counts them per expert in
// shared memory, meets the others at a grid barrier, then ranks each pair in its expert's list
// after the CTAs before it, a warp at a time in pair order (within a warp: __match_any_sync).
// Needs a co-resident grid of at most kStageCounts / E CTAs and E ints of shared memory.
template <bool kPull>
__global__ void __launch_bounds__(kThreads) dispatch_stage_experts(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_stage(a);
  const int R = ctx.num_ranks, T = a.num_tokens, K = a.num_topk, E = a.num_experts;
  // the pairs that reach this PE overwrite theirs in the kernel after this
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < R * T * K; i += gridDim.x * kThreads)
    a.pair_row[i] = -1;
  const int n = T * K, span = (n + gridDim.x - 1) / gridDim.x;
  const int begin = min(n, int(blockIdx.x) * span), end = min(n, begin + span);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Control* control = control_of(ctx, ctx.rank);
  extern __shared__ int32_t counts[];  // [E]
  for (int e = threadIdx.x; e < E; e += kThreads) counts[e] = 0;
  __syncthreads();
  for (int i = begin + threadIdx.x; i < end; i += kThreads) {
    const int e = a.topk_idx[i];
    if (valid_expert(e, E)) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads)
    control->stage_counts[blockIdx.x * E + e] = counts[e];
  grid_barrier(ctx);

  // counts[e] <- pairs for e in the CTAs before this one; the last CTA publishes the totals
  const size_t matrix = kPull ? a.plan.matrix : a.push.matrix;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int before = 0, total = 0;
    for (int b = 0; b < int(gridDim.x); ++b) {
      const int c = __ldcg(&control->stage_counts[b * E + e]);  // other CTAs' writes
      if (b < int(blockIdx.x)) before += c;
      total += c;
    }
    counts[e] = before;
    if (blockIdx.x == gridDim.x - 1)
      for (int p = 0; p < R; ++p) region<int32_t>(ctx, p, matrix)[size_t(ctx.rank) * E + e] = total;
  }
  __syncthreads();
  const uint32_t below_lane = (1u << lane) - 1;
  for (int base = begin; base < end; base += kThreads) {
    const int i = base + threadIdx.x;
    const int e = i < end ? a.topk_idx[i] : -1;
    const bool valid = i < end && valid_expert(e, E);
    const uint32_t same = __match_any_sync(0xffffffffu, valid ? e : -1);
    for (int v = 0; v < kWarps; ++v) {  // warps in pair order: the lists stay sorted by pair
      if (warp == v) {
        const int slot = valid ? counts[e] + __popc(same & below_lane) : -1;
        __syncwarp();  // every lane has read counts before the group's first lane adds to it
        if (valid && lane == __ffs(same) - 1) counts[e] += __popc(same);
        if (i < end) a.send_slot[i] = slot;  // -1: a masked pair
        if (kPull && valid)
          region<int32_t>(ctx, ctx.rank, a.plan.lists)[size_t(e) * a.plan.list_len + slot] = i;
      }
      __syncthreads();
    }
  }
  finish_stage<kPull>(a, call);
}

// Block w (a destination rank, or an expert) lists this PE's tokens (or (token, k) pairs)
// for w in order, writes each one's rank in that list to send_slot, and publishes the count
// in every peer's matrix. Then all blocks stage the tokens, ids and weights for the peers.
template <bool kExpertMajor, bool kPull>
__global__ void __launch_bounds__(kThreads) dispatch_stage(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_stage(a);
  const int R = ctx.num_ranks, T = a.num_tokens, K = a.num_topk, E = a.num_experts;
  const int L = E / R;
  const int W = kExpertMajor ? E : R;
  const int n = kExpertMajor ? T * K : T;
  if (kExpertMajor)  // the pairs that reach this PE overwrite theirs in the kernel after this
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < R * T * K; i += gridDim.x * kThreads)
      a.pair_row[i] = -1;

  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  for (int w = blockIdx.x; w < W; w += gridDim.x) {
    int32_t* list = kPull ? region<int32_t>(ctx, ctx.rank, a.plan.lists) +
                                size_t(w) * a.plan.list_len
                          : nullptr;
    int running = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      int hit = 0;
      if (i < n) {
        if (kExpertMajor) {
          const int e = a.topk_idx[i];
          hit = e == w;
          if (w == 0 && !valid_expert(e, E)) a.send_slot[i] = -1;  // masked pairs
        } else {
          for (int k = 0; k < K; ++k) {
            const int e = a.topk_idx[size_t(i) * K + k];
            hit |= valid_expert(e, E) && e / L == w;
          }
        }
      }
      int position, total;
      Scan(scan_storage).ExclusiveSum(hit, position, total);
      if (i < n) {
        if (kPull && hit) list[running + position] = i;
        if (kExpertMajor) {
          if (hit) a.send_slot[i] = running + position;
        } else {
          a.send_slot[size_t(i) * R + w] = hit ? running + position : -1;
        }
      }
      running += total;
      __syncthreads();  // scan_storage is reused
    }
    const size_t matrix = kPull ? a.plan.matrix : a.push.matrix;
    for (int p = threadIdx.x; p < R; p += kThreads)
      region<int32_t>(ctx, p, matrix)[size_t(ctx.rank) * W + w] = running;
  }
  finish_stage<kPull>(a, call);
}

// ------------------------------------------------------------------------------ gather

struct GatherTables {
  // rank_major: src_offset[s] (R + 1 entries) and my_offset_at[r] (R entries).
  // expert_major: pairs[e], base[e] (start of e's group at its rank + my prefix there),
  //               group_start[l] (my groups) and src_offset[l][s] ((R + 1) per local expert).
  int32_t* src_offset;
  int32_t* my_offset_at;
  int32_t* pairs;
  int32_t* base;
  int32_t* group_start;
};

__device__ __forceinline__ int aligned(int n, int alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// Largest index j in [0, n) with table[j] <= value (table ascending, table[0] <= value).
__device__ __forceinline__ int last_at_most(const int32_t* table, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Offsets of every row from the count matrix M[s * W + w] (identical on every PE).
template <bool kExpertMajor>
__device__ void build_tables(const DispatchArgs& a, const int32_t* M, int32_t* tables,
                             GatherTables& tb) {
  const int R = a.ctx.num_ranks, me = a.ctx.rank, E = a.num_experts, L = E / R;
  const int W = kExpertMajor ? E : R;
  if (kExpertMajor) {
    tb.pairs = tables;
    tb.base = tb.pairs + E;
    tb.group_start = tb.base + E;
    tb.src_offset = tb.group_start + L;
    // pairs per expert and this PE's prefix inside each expert's group
    for (int e = threadIdx.x; e < E; e += kThreads) {
      int total = 0, before_me = 0;
      for (int s = 0; s < R; ++s) {
        if (s == me) before_me = total;
        total += M[s * W + e];
      }
      tb.pairs[e] = total;
      tb.base[e] = before_me;
    }
    __syncthreads();
    // group starts of every rank's experts, added into base
    for (int r = threadIdx.x; r < R; r += kThreads) {
      int start = 0;
      for (int l = 0; l < L; ++l) {
        tb.base[r * L + l] += start;
        if (r == me) tb.group_start[l] = start;
        start += aligned(tb.pairs[r * L + l], a.alignment);
      }
    }
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += kThreads) {
      int offset = tb.group_start[l];
      for (int s = 0; s < R; ++s) {
        tb.src_offset[l * (R + 1) + s] = offset;
        offset += M[s * W + me * L + l];
      }
      tb.src_offset[l * (R + 1) + R] = offset;
    }
  } else {
    tb.src_offset = tables;
    tb.my_offset_at = tables + R + 1;
    if (threadIdx.x == 0) {
      int offset = 0;
      for (int s = 0; s < R; ++s) {
        tb.src_offset[s] = offset;
        offset += M[s * W + me];
      }
      tb.src_offset[R] = offset;
    }
    for (int r = threadIdx.x; r < R; r += kThreads) {
      int offset = 0;
      for (int s = 0; s < me; ++s) offset += M[s * W + r];
      tb.my_offset_at[r] = offset;
    }
  }
  __syncthreads();
}

// Which source PE row i of this PE's output comes from (-1: unused row), its position in that
// source's list for us, and (expert_major) its local expert.
template <bool kExpertMajor>
__device__ __forceinline__ int source_of_row(const GatherTables& tb, int i, int R, int L,
                                             int* position, int* local) {
  if (kExpertMajor) {
    const int l = last_at_most(tb.group_start, L, i);
    const int32_t* offsets = tb.src_offset + l * (R + 1);
    if (i < tb.group_start[l] || i >= offsets[R]) return -1;
    const int s = last_at_most(offsets, R, i);  // the last such source: empty ones are skipped
    *position = i - offsets[s];
    *local = l;
    return s;
  }
  if (i >= tb.src_offset[R]) return -1;
  const int s = last_at_most(tb.src_offset, R, i);
  *position = i - tb.src_offset[s];
  return s;
}

// Row index at the destination of this PE's k-th pair (expert_major) or of its token for
// rank r (rank_major), from its rank in the list; -1 when past the capacity.
template <bool kExpertMajor>
__device__ __forceinline__ int destination_row(const DispatchArgs& a, const GatherTables& tb,
                                               int entry, int rank_in_list) {
  const int row = kExpertMajor ? tb.base[a.topk_idx[entry]] + rank_in_list
                               : tb.my_offset_at[entry % a.ctx.num_ranks] + rank_in_list;
  return row < a.capacity ? row : -1;
}

// Counts of the output; the last block then releases the peers and closes the call.
// kPull: the pull gather, which may be the copy-engine path's, or the lean push (the fused
// push kernel never is).
template <bool kExpertMajor, bool kPull = false>
__device__ void finish_dispatch(const DispatchArgs& a, const GatherTables& tb, uint64_t call,
                                int counter, int profile_slot) {
  const PeerContext& ctx = a.ctx;
  const int me = ctx.rank, L = a.num_experts / ctx.num_ranks, C = a.capacity;
  if (blockIdx.x == 0 && kExpertMajor) {
    for (int l = threadIdx.x; l < L; l += kThreads) {
      const int start = tb.group_start[l], n = tb.pairs[me * L + l];
      const int end = start + aligned(n, a.alignment);
      a.group_sizes[l] = max(0, min(end, C) - min(start, C));
      a.tokens_per_expert[l] = max(0, min(n, C - start));
    }
  }
  // The last block: its threads share the per-expert work (one thread walking L = 256 experts,
  // a dependent L2 round trip each, held the call's end ~14 us on one H100), thread 0 closes.
  if (!last_block(ctx, counter, /*reads_blocks=*/true)) return;
  __shared__ int totals[2];  // expert_major: received, dropped
  if (threadIdx.x == 0) totals[0] = totals[1] = 0;
  __syncthreads();
  if (kExpertMajor) {
    int received = 0, dropped = 0;
    for (int l = threadIdx.x; l < L; l += kThreads) {  // block 0 wrote them (ordered by last_block)
      received += __ldcg(a.group_sizes + l);
      dropped += tb.pairs[me * L + l] - __ldcg(a.tokens_per_expert + l);
    }
    if (received != 0) atomicAdd(&totals[0], received);
    if (dropped != 0) atomicAdd(&totals[1], dropped);
  } else {
    for (int l = threadIdx.x; l < L; l += kThreads)
      a.group_sizes[l] = __ldcg(a.tokens_per_expert + l);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (kExpertMajor) {
      *a.num_received = totals[0];
      *a.num_dropped = totals[1];
    } else {
      const int total = tb.src_offset[ctx.num_ranks];
      *a.num_received = min(total, C);
      *a.num_dropped = max(total - C, 0);
    }
    if (kPull && a.copy_engine) close_copy_engine_call(ctx, a.copy_chunks, "dispatch");
    if (kPull && a.lean) {
      // Every block has arrived, so this PE's accesses of the call are over: one fence
      // releases its rows (pushed, where its output is published) and its done; then, before
      // the kernel ends, every source's rows here (in place, they landed unseen).
      if (a.direct_out) signal_all(ctx, Flag::kPushed, call);
      finish_call(ctx, call, /*fenced=*/a.direct_out);
      const Control* mine = control_of(ctx, ctx.rank);
      for (int s = 0; s < ctx.num_ranks; ++s)
        wait_flag(ctx, &mine->pushed[pe_of(ctx, s)], call, "dispatch", "rows pushed", s);
    } else {
      finish_call(ctx, call);
    }
    // Peers read this PE's inputs where XLA keeps them: the call (and with it XLA's hold on
    // them) ends only once every peer is done with them.
    if (kPull && a.in_place) {
      const Control* mine = control_of(ctx, ctx.rank);
      for (int s = 0; s < ctx.num_ranks; ++s)
        wait_flag(ctx, &mine->done[pe_of(ctx, s)], call, "dispatch", "peer done reading x", s);
    }
    profile_mark(ctx, profile_slot, kRetired);
  }
}

// Unused rows get zeros, and -1 / 0 metadata; `scales`: the output has scales.
__device__ __forceinline__ void write_unused_row(const DispatchArgs& a, int i, int out_k,
                                                 int lane, bool scales) {
  zero_row(static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes, a.x_row_bytes, lane, 32);
  if (scales)
    zero_row(reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes,
             a.scale_row_bytes, lane, 32);
  for (int j = lane; j < out_k; j += 32) {
    a.out_topk_idx[size_t(i) * out_k + j] = -1;
    a.out_topk_weights[size_t(i) * out_k + j] = 0.f;
  }
  if (lane == 0) a.src_rank[i] = a.src_token[i] = a.src_k[i] = -1;
}

// The stage kernel: spread over a co-resident grid when it can (rank_major: R <= 32;
// expert_major: E ints of shared memory and kStageCounts / E CTAs).
template <bool kExpertMajor, bool kPull>
cudaError_t launch_stage(const DispatchArgs& a, cudaStream_t stream) {
  const int W = kExpertMajor ? a.num_experts : a.ctx.num_ranks;
  if (!kExpertMajor && a.ctx.num_ranks <= kMaxStageRanks) {
    const int grid = std::min({a.num_blocks, multiprocessors(), kMaxStageBlocks});
    // cooperative: the grid barrier needs every block resident, whatever else runs beside
    DispatchArgs args = a;
    void* params[] = {&args};
    return launch_grid_after_previous(
        reinterpret_cast<const void*>(dispatch_stage_ranks<kPull>), grid, kThreads, 0, stream,
        params, /*cooperative=*/true);
  }
  const size_t counts_bytes = sizeof(int32_t) * a.num_experts;
  if (kExpertMajor && a.num_experts <= kStageCounts && counts_bytes <= 48 * 1024) {
    const int grid = std::min({a.num_blocks, multiprocessors(), kMaxStageBlocks,
                               kStageCounts / a.num_experts});
    DispatchArgs args = a;
    void* params[] = {&args};
    return launch_grid_after_previous(
        reinterpret_cast<const void*>(dispatch_stage_experts<kPull>), grid, kThreads,
        counts_bytes, stream, params, /*cooperative=*/true);
  }
  return launch_after_previous(dispatch_stage<kExpertMajor, kPull>, std::max(W, a.num_blocks),
                               kThreads, 0, stream, a);
}

}  // namespace
}  // namespace jax_ep
