// Intranode dispatch (rank_major / expert_major) and cached dispatch. See intranode.h.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------------------ stage

// The end of every stage kernel: pull mode stages this PE's tokens once (every destination
// reads the rows it needs) with their ids and weights; then the last block raises ready[me].
template <bool kPull>
__device__ void finish_stage(const DispatchArgs& a, uint64_t call) {
  const PeerContext& ctx = a.ctx;
  const int T = a.num_tokens, K = a.num_topk;
  if (!kPull) {  // push mode stages nothing: the rows go out once every count is known
    profile_end(ctx, kProfDispatchStage);
    if (last_block(ctx, 0) && threadIdx.x == 0) {
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
  for (int t = warp; t < T && !a.copy_engine; t += warps) {  // the copy engines move the rows
    copy_row(rows + t * stride, static_cast<const char*>(a.x) + t * a.x_row_bytes, a.x_row_bytes,
             lane, 32);
    if (a.scales != nullptr)
      copy_row(scales + t * scale_stride,
               reinterpret_cast<const char*>(a.scales) + t * a.scale_row_bytes,
               a.scale_row_bytes, lane, 32);
  }
  int32_t* ids = region<int32_t>(ctx, ctx.rank, a.plan.meta_ids);
  float* weights = region<float>(ctx, ctx.rank, a.plan.meta_weights);
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < T * K; i += gridDim.x * kThreads) {
    ids[i] = a.topk_idx[i];
    weights[i] = a.topk_weights[i];
  }
  profile_end(ctx, kProfDispatchStage);
  if (last_block(ctx, 0) && threadIdx.x == 0) {
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
    __threadfence();
    if (atomicAdd(&control->stage_arrived, 1u) == gridDim.x - 1) {
      control->stage_arrived = 0;
      __threadfence();
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
    __threadfence();
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
  for (int t = begin + threadIdx.x; t < end; t += kThreads) {
    const uint32_t mask = rank_mask(a, t, L);
    for (int w = 0; w < R; ++w)
      if (mask >> w & 1) atomicAdd(&counts[w], 1);
  }
  __syncthreads();
  if (threadIdx.x < R) control->stage_counts[blockIdx.x * R + threadIdx.x] = counts[threadIdx.x];
  grid_barrier(ctx);

  // counts[w] <- tokens for w in the CTAs before this one; the last CTA publishes the totals
  if (threadIdx.x < R) {
    int before = 0, total = 0;
    for (int b = 0; b < int(gridDim.x); ++b) {
      const int n = __ldcg(&control->stage_counts[b * R + threadIdx.x]);  // other CTAs' writes
      if (b < int(blockIdx.x)) before += n;
      total += n;
    }
    counts[threadIdx.x] = before;
    if (blockIdx.x == gridDim.x - 1) {
      const size_t matrix = kPull ? a.plan.matrix : a.push.matrix;
      for (int p = 0; p < R; ++p)
        region<int32_t>(ctx, p, matrix)[size_t(ctx.rank) * R + threadIdx.x] = total;
    }
  }
  __syncthreads();
  const uint32_t below_lane = (1u << lane) - 1;
  for (int base = begin; base < end; base += kThreads) {
    const int t = base + threadIdx.x;
    const uint32_t mask = t < end ? rank_mask(a, t, L) : 0u;
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
      if (t < end) a.send_slot[size_t(t) * R + w] = slot;
    }
    __syncthreads();
    if (threadIdx.x < R)  // this round's tokens come before the next round's
      for (int v = 0; v < kWarps; ++v) counts[threadIdx.x] += warp_counts[v][threadIdx.x];
    __syncthreads();
  }
  finish_stage<kPull>(a, call);
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
// kPull: the pull gather, which may be the copy-engine path's (the push kernel never is).
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
  if (!last_block(ctx, counter)) return;
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
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, me)->epoch = call;
    profile_mark(ctx, profile_slot, kRetired);
  }
}

// Unused rows get zeros, and -1 / 0 metadata.
__device__ __forceinline__ void write_unused_row(const DispatchArgs& a, int i, int out_k,
                                                 int lane) {
  zero_row(static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes, a.x_row_bytes, lane, 32);
  if (a.scales != nullptr)
    zero_row(reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes,
             a.scale_row_bytes, lane, 32);
  for (int j = lane; j < out_k; j += 32) {
    a.out_topk_idx[size_t(i) * out_k + j] = -1;
    a.out_topk_weights[size_t(i) * out_k + j] = 0.f;
  }
  if (lane == 0) a.src_rank[i] = a.src_token[i] = a.src_k[i] = -1;
}

template <bool kExpertMajor>
__global__ void __launch_bounds__(kThreads) dispatch_gather(DispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchGather, kEnter);
  wait_all_ready(ctx, call, "dispatch");
  profile_mark(ctx, kProfDispatchGather, kWaited);
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, K = a.num_topk;
  const int E = a.num_experts, L = E / R, C = a.capacity;
  extern __shared__ int32_t tables[];
  GatherTables tb;
  build_tables<kExpertMajor>(a, region<int32_t>(ctx, me, a.plan.matrix), tables, tb);

  // Rows of the output: warp w takes rows w, w + warps, ... (so that the grid goes through the
  // rows in order, as the copy engines land them), 32 at a time: lane r finds the r-th row's
  // source and token, so that the list entries of 32 rows (the sources', over NVLink for a
  // peer) take one round trip, not one in front of every copy. Each row's ids and weights
  // (the source's too) are loaded before its copy, so their round trip overlaps the copy.
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  const int out_k = kExpertMajor ? 1 : K;
  // Copy-engine dispatch, rank_major: our own rows (in x already) first, while the peers'
  // chunks land; the rotation keeps every output row visited once (our rows may all lie past
  // the capacity).
  const int rotate = a.copy_engine && !kExpertMajor && C > 0 ? tb.src_offset[me] % C : 0;
  for (int j0 = warp; j0 < C; j0 += 32 * warps) {
    const int j = j0 + lane * warps;
    int my_i = -1, my_s = -1, my_t = -1, my_k = -1, my_local = -1;
    if (j < C) {
      my_i = j + rotate < C ? j + rotate : j + rotate - C;
      int position = 0;
      my_s = source_of_row<kExpertMajor>(tb, my_i, R, L, &position, &my_local);
      if (my_s >= 0 && kExpertMajor) {
        const int pair = region<int32_t>(ctx, my_s, a.plan.lists)[size_t(me * L + my_local) *
                                                                   a.plan.list_len + position];
        my_t = pair / K;
        my_k = pair % K;
      } else if (my_s >= 0) {
        my_t = region<int32_t>(ctx, my_s, a.plan.lists)[size_t(me) * a.plan.list_len + position];
      }
    }
    for (int r = 0; r < 32; ++r) {
      const int i = __shfl_sync(0xffffffffu, my_i, r);
      if (i < 0) break;  // past the capacity, and so are the later lanes' rows
      const int s = __shfl_sync(0xffffffffu, my_s, r);
      if (s < 0) {
        write_unused_row(a, i, out_k, lane);
        continue;
      }
      const int t = __shfl_sync(0xffffffffu, my_t, r), k = __shfl_sync(0xffffffffu, my_k, r);
      const int local = __shfl_sync(0xffffffffu, my_local, r);
      const int32_t* ids = region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K;
      const float* weights = region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K;
      // lane j's id and weight (expert_major: lane 0's weight of pair k), used after the copy
      const int e = !kExpertMajor && lane < K ? ids[lane] : -1;
      const bool weighs = kExpertMajor ? lane == 0 : lane < K;
      const float w = weighs ? weights[kExpertMajor ? k : lane] : 0.f;
      char* out_row = static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes;
      char* out_scales = reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes;
      if (a.copy_engine) {
        const char* row = static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes;
        const char* row_scales = reinterpret_cast<const char*>(a.scales) +
                                 size_t(t) * a.scale_row_bytes;
        if (s != me) {  // in our landing area once its chunk is flagged
          wait_landed(ctx, s, t / a.copy_chunk_rows, lane, "dispatch");
          const size_t landed = size_t(s) * T + t;
          row = region<char>(ctx, me, a.plan.rows) + landed * a.x_row_bytes;
          row_scales = region<char>(ctx, me, a.plan.scales) + landed * a.scale_row_bytes;
        }
        // L1 may hold the area's previous call: the copy engine wrote around it
        copy_row<true>(out_row, row, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row<true>(out_scales, row_scales, a.scale_row_bytes, lane, 32);
      } else {
        copy_row(out_row, region<char>(ctx, s, a.plan.rows) + t * stride, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row(out_scales, region<char>(ctx, s, a.plan.scales) + t * scale_stride,
                   a.scale_row_bytes, lane, 32);
      }
      if (kExpertMajor) {
        if (lane == 0) {
          a.out_topk_idx[i] = local;
          a.out_topk_weights[i] = w;
        }
      } else {
        for (int jk = lane; jk < K; jk += 32) {  // beyond 32 ids: loaded here
          const int id = jk == lane ? e : ids[jk];
          const bool here = valid_expert(id, E) && id / L == me;
          a.out_topk_idx[size_t(i) * K + jk] = here ? id % L : -1;
          a.out_topk_weights[size_t(i) * K + jk] = here ? (jk == lane ? w : weights[jk]) : 0.f;
          if (here) atomicAdd(&a.tokens_per_expert[id % L], 1);
        }
      }
      if (lane == 0) {
        a.src_rank[i] = s;
        a.src_token[i] = t;
        a.src_k[i] = k;
        if (kExpertMajor) a.pair_row[(size_t(s) * T + t) * K + k] = i;
      }
    }
  }

  // Where this PE's own tokens landed (the handle's send_slot), -1 when dropped.
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < T * (kExpertMajor ? K : R);
       i += gridDim.x * kThreads) {
    const int rank_in_list = a.send_slot[i];
    if (rank_in_list >= 0) a.send_slot[i] = destination_row<kExpertMajor>(a, tb, i, rank_in_list);
  }
  profile_end(ctx, kProfDispatchGather);
  finish_dispatch<kExpertMajor, true>(a, tb, call, 1, kProfDispatchGather);
}

// ------------------------------------------------------------------------------ push mode

// Copies one row to every non-null destination, reading it once; the lanes of a warp stride
// through it with the widest access all addresses allow. kFromPeer: the row was written by
// another PE during this kernel (loads bypass L1).
// 4 loads in flight per lane: 8 or 16 were no faster, and made the push kernel spill
// registers.
template <int kSources, bool kFromPeer = false, int kInFlight = 4>
__device__ __forceinline__ void broadcast_row(char* (&dsts)[kSources], const char* src,
                                              size_t bytes, int lane) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
#pragma unroll
  for (int j = 0; j < kSources; ++j) bits |= reinterpret_cast<uintptr_t>(dsts[j]);
  if ((bits & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const size_t n = bytes / 16;
    for (size_t i = lane; i < n; i += 32 * kInFlight) {
      int4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n) v[u] = kFromPeer ? __ldcg(s + i + u * 32) : s[i + u * 32];
#pragma unroll
      for (int j = 0; j < kSources; ++j) {
        if (dsts[j] == nullptr) continue;
        int4* d = reinterpret_cast<int4*>(dsts[j]);
#pragma unroll
        for (int u = 0; u < kInFlight; ++u)
          if (i + u * 32 < n) d[i + u * 32] = v[u];
      }
    }
  } else {
    for (size_t i = lane; i < bytes; i += 32) {
      const char v = kFromPeer ? __ldcg(src + i) : src[i];
#pragma unroll
      for (int j = 0; j < kSources; ++j)
        if (dsts[j] != nullptr) dsts[j][i] = v;
    }
  }
}

// The fused kernels' loop, one per warp: pushing this PE's tokens and consuming the chunks
// that have arrived here interleave at warp granularity. Each warp holds at most one chunk,
// taken in order from one of `ranges` chunk ranges with a fetch-and-add (no contended
// compare-and-swap: an in-order claim serialised 2048 claims to ~0.4 µs each); between its
// pushes it checks whether that chunk is complete (arrival counters) and consumes it, so the
// copy-out of a peer's rows runs while every PE is still pushing instead of after the last
// push. A warp holding a chunk keeps pushing, and it waits only once every token is claimed,
// for rows that running warps (here or on the peers) are pushing: nothing needs the whole grid
// resident. Tokens are claimed from the dispatch work counter by whichever warp is free:
// roughly in ascending order (destinations' chunks fill up progressively), and warps whose
// stores drain faster take more tokens (with a static split the last CTA finished ~80 µs after
// the first, 2×H200).
//   Path::range(q) -> {begin, end} chunk indices of range q;
//   Path::needed(c) -> arrivals that complete chunk c (0: complete already);
//   Path::consume(c, lane), Path::push(t, lane), Path::peer(c) (for a timeout report).
template <typename Path>
__device__ __forceinline__ void fused_loop(const DispatchArgs& a, Path& path, int ranges) {
  const PeerContext& ctx = a.ctx;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32;
  Control* mine = control_of(ctx, ctx.rank);
  uint32_t* token_cursor = &mine->work_cursor[kCursorDispatch];
  uint32_t* arrivals = mine->arrivals;
  int t = claim_item(token_cursor, lane);
  int chunk = -1, needed = 0;  // the chunk this warp holds, and the arrivals that complete it
  int next_range = (warp + ctx.rank + 1) % ranges;  // ranges tried round-robin from here
  bool ranges_left = true;
  uint64_t idle_since = 0;
  while (true) {
    // 1. Hold a chunk: the next one of the first range that has any left.
    for (int k = 0; k < ranges && chunk < 0 && ranges_left; ++k) {
      const int q = next_range;
      next_range = (next_range + 1) % ranges;
      const int2 range = path.range(q);
      if (range.x >= range.y) continue;
      uint32_t taken = 0;
      if (lane == 0) {
        // Peek first, so that exhausted ranges are not incremented by every warp forever.
        taken = *reinterpret_cast<volatile uint32_t*>(&mine->chunk_cursor[q]);
        if (range.x + int(taken) < range.y) taken = atomicAdd(&mine->chunk_cursor[q], 1u);
      }
      const int c = range.x + int(__shfl_sync(0xffffffffu, taken, 0));
      if (c >= range.y) continue;
      chunk = c;
      needed = path.needed(c, lane);
    }
    if (chunk < 0) ranges_left = false;  // every range is exhausted: nothing more to hold
    // 2. Consume it once complete.
    if (chunk >= 0) {
      uint32_t complete = needed == 0;
      if (lane == 0 && !complete) complete = load_acquire_u32(&arrivals[chunk]) >= uint32_t(needed);
      if (__shfl_sync(0xffffffffu, complete, 0)) {
        __syncwarp();  // lane 0's acquire orders every lane's reads of the rows
        // Every row of this chunk has arrived for this call: its counter is free for the next.
        if (lane == 0 && needed > 0) arrivals[chunk] = 0;
        path.consume(chunk, lane);
        chunk = -1;
        idle_since = 0;
        continue;
      }
    }
    // 3. Otherwise push the next token of ours.
    if (t < a.num_tokens) {
      path.push(t, lane);
      t = claim_item(token_cursor, lane);
      idle_since = 0;
      continue;
    }
    if (chunk < 0) break;  // nothing held, nothing to push, no chunk left
    // 4. Every token is claimed and the held chunk's rows are still arriving: wait, bounded.
    if (lane == 0) {
      const uint64_t now = global_timer_ns();
      if (idle_since == 0) idle_since = now;
      if (now - idle_since > ctx.timeout_ns) {
        report_timeout(ctx, "dispatch", "rows of an output chunk", path.peer(chunk),
                       uint64_t(needed), uint64_t(load_acquire_u32(&arrivals[chunk])));
        trap_after_report();
      }
    }
    __nanosleep(200);
  }
}

// ---- rank_major: rows go straight to their final position, in the receiver's push region
// over NVLink (moved out by the receiver once their chunk has arrived) or in our own output.

// Where token t's row goes: for each destination rank, its output row's address in the
// receiver's push region (or in our own output when we are the receiver), and the chunk of the
// receiver's output it lands in (-1: not sent). Writes the metadata record of every
// destination row and the row index into send_slot. All lanes of the warp call it.
template <int kSources>
__device__ __forceinline__ void token_destinations(const DispatchArgs& a, const GatherTables& tb,
                                                   int t, int lane, char* (&rows)[kSources],
                                                   char* (&scales)[kSources],
                                                   int (&landed)[kSources]) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, me = ctx.rank, K = a.num_topk;
  const int E = a.num_experts, L = E / R;
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
#pragma unroll
  for (int r = 0; r < kSources; ++r) {  // compile-time indices: registers
    rows[r] = scales[r] = nullptr;
    landed[r] = -1;
    if (r >= R) continue;
    const int entry = t * R + r;
    const int rank_in_list = a.send_slot[entry];
    if (rank_in_list < 0) continue;  // no expert there
    const int row = destination_row<false>(a, tb, entry, rank_in_list);
    __syncwarp();
    if (lane == 0) a.send_slot[entry] = row;
    if (row < 0) continue;  // dropped at the destination's capacity
    landed[r] = row / a.chunk_rows;
    // the metadata record: token, then local ids and weights for that destination
    char* meta = region<char>(ctx, r, a.push.meta) + size_t(row) * a.push.meta_stride;
    int32_t* ids = reinterpret_cast<int32_t*>(meta) + 1;
    float* weights = reinterpret_cast<float*>(ids + K);
    if (lane == 0) reinterpret_cast<int32_t*>(meta)[0] = t;
    for (int kk = lane; kk < K; kk += 32) {
      const int e = a.topk_idx[size_t(t) * K + kk];
      const bool here = valid_expert(e, E) && e / L == r;
      ids[kk] = here ? e % L : -1;
      weights[kk] = here ? a.topk_weights[size_t(t) * K + kk] : 0.f;
    }
    if (r == me) {
      rows[r] = static_cast<char*>(a.out_x) + size_t(row) * a.x_row_bytes;
      scales[r] = reinterpret_cast<char*>(a.out_scales) + size_t(row) * a.scale_row_bytes;
    } else {
      rows[r] = region<char>(ctx, r, a.push.rows) + size_t(row) * stride;
      scales[r] = region<char>(ctx, r, a.push.scales) + size_t(row) * scale_stride;
    }
  }
}

// Output row i: rows that peers pushed into this PE's region are moved to the output (this
// PE's own rows are there already); metadata outputs for every used row; unused rows get
// zeros and -1.
__device__ __forceinline__ void receive_row(const DispatchArgs& a, const GatherTables& tb, int i,
                                            int lane) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, me = ctx.rank, K = a.num_topk, L = a.num_experts / R;
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  int position = 0, local = -1;
  const int s = source_of_row<false>(tb, i, R, L, &position, &local);
  if (s < 0) {
    write_unused_row(a, i, K, lane);
    return;
  }
  // The row's metadata record, loaded before the copy so that its round trip overlaps it
  // (bypassing L1 like the row: a peer may have written it during this kernel).
  const char* meta = region<char>(ctx, me, a.push.meta) + size_t(i) * a.push.meta_stride;
  const int32_t* ids = reinterpret_cast<const int32_t*>(meta) + 1;
  const float* weights = reinterpret_cast<const float*>(ids + K);
  const int id = lane < K ? __ldcg(ids + lane) : -1;
  const float weight = lane < K ? __ldcg(weights + lane) : 0.f;
  const int token = lane == 0 ? __ldcg(reinterpret_cast<const int32_t*>(meta)) : -1;
  if (s != me) {  // rows a peer wrote, possibly during this kernel: bypass L1
    copy_row<true>(static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes,
                   region<char>(ctx, me, a.push.rows) + size_t(i) * stride, a.x_row_bytes, lane,
                   32);
    if (a.scales != nullptr)
      copy_row<true>(reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes,
                     region<char>(ctx, me, a.push.scales) + size_t(i) * scale_stride,
                     a.scale_row_bytes, lane, 32);
  }
  for (int j = lane; j < K; j += 32) {  // ids past the 32nd are loaded here
    const int e = j == lane ? id : __ldcg(ids + j);
    a.out_topk_idx[size_t(i) * K + j] = e;
    a.out_topk_weights[size_t(i) * K + j] = j == lane ? weight : __ldcg(weights + j);
    if (e >= 0) atomicAdd(&a.tokens_per_expert[e], 1);
  }
  if (lane == 0) {
    a.src_rank[i] = s;
    a.src_token[i] = token;
    a.src_k[i] = -1;
  }
}

// One chunk range per source: its rows are contiguous, so a peer's chunks do not queue behind
// our own.
template <int kSources>
struct RankMajorPush {
  const DispatchArgs& a;
  const GatherTables& tb;
  __device__ int2 range(int q) const {
    const int chunks = (a.capacity + a.chunk_rows - 1) / a.chunk_rows;
    return {begin(q), q + 1 < a.ctx.num_ranks ? begin(q + 1) : chunks};
  }
  __device__ int begin(int q) const {
    if (q == 0) return 0;
    return (min(tb.src_offset[q], a.capacity) + a.chunk_rows - 1) / a.chunk_rows;
  }
  __device__ int needed(int c, int lane) const {  // rows of the chunk that some PE sends
    const int first = c * a.chunk_rows, last = min(a.capacity, first + a.chunk_rows);
    int used = 0, position, local;
    for (int i = first + lane; i < last; i += 32)
      used += source_of_row<false>(tb, i, a.ctx.num_ranks, 1, &position, &local) >= 0;
    return __reduce_add_sync(0xffffffffu, used);
  }
  __device__ void consume(int c, int lane) const {
    const int first = c * a.chunk_rows, last = min(a.capacity, first + a.chunk_rows);
    for (int i = first; i < last; ++i) receive_row(a, tb, i, lane);
  }
  // Token t's row once per destination, straight to its final position; the warp reads the
  // row once and stores it to all of its destinations, then bumps each destination's arrival
  // counter of the chunk its row landed in, after a system-scope fence.
  __device__ void push(int t, int lane) const {
    char* rows[kSources];
    char* scales[kSources];
    int landed[kSources];  // chunk of the destination's output each row landed in, or -1
    token_destinations<kSources>(a, tb, t, lane, rows, scales, landed);
    broadcast_row(rows, static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes,
                  a.x_row_bytes, lane);
    if (a.scales != nullptr)
      broadcast_row(scales,
                    reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes,
                    a.scale_row_bytes, lane);
    __syncwarp();  // every lane's stores of this token precede lane 0's fence
    if (lane == 0) {
      __threadfence_system();
#pragma unroll
      for (int r = 0; r < kSources; ++r)
        if (landed[r] >= 0) atomicAdd_system(&control_of(a.ctx, r)->arrivals[landed[r]], 1u);
    }
  }
  __device__ int peer(int c) const {
    int position, local;
    return source_of_row<false>(tb, c * a.chunk_rows, a.ctx.num_ranks, 1, &position, &local);
  }
};

// ---- expert_major: a token's row crosses NVLink once per peer that has any of its pairs,
// into the peer's staging slot me*T + t with a record of the rows of the token's pairs there;
// the peer expands each arrived token to those rows (reading it from its own memory, ~8x
// NVLink's bandwidth), chunk by chunk of a source's tokens while the pushes go on. This PE's
// own pairs go straight to their rows. A sender counts every token of a chunk into each peer's
// counter, and writes its record's header, sent or not (a header of 0: nothing sent; a stale
// record, or other data left in the region by other calls, is never trusted), so a chunk is
// complete at chunk-size arrivals.
struct PairEntry {
  int32_t row, id;  // the pair's output row here and local expert (-1: not a pair here)
  float weight;
};
constexpr size_t kPairRecordHeader = 4;  // 1: the token was sent here this call, 0: not

// Output rows per item of the expert_major pass that zeroes the unused rows.
constexpr int kZeroChunkRows = 64;

template <int kSources>
struct ExpertMajorPush {
  const DispatchArgs& a;
  const GatherTables& tb;
  // Chunks [q*P, (q+1)*P) are source q's tokens, chunk_rows each (P per source); ours are
  // never received: our range instead numbers the unused-row pass's items from R*P.
  __device__ int per_source() const { return (a.num_tokens + a.chunk_rows - 1) / a.chunk_rows; }
  __device__ int2 range(int q) const {
    const int P = per_source(), end = a.ctx.num_ranks * P;
    if (q == a.ctx.rank) return {end, end + (a.capacity + kZeroChunkRows - 1) / kZeroChunkRows};
    return {q * P, (q + 1) * P};
  }
  __device__ int needed(int c, int) const {
    const int P = per_source();
    if (c >= a.ctx.num_ranks * P) return 0;
    return min(a.chunk_rows, a.num_tokens - (c % P) * a.chunk_rows);
  }
  __device__ int peer(int c) const { return c / per_source(); }
  __device__ char* record(int r, size_t slot) const {
    return region<char>(a.ctx, r, a.push.meta) + slot * a.push.meta_stride;
  }

  __device__ void consume(int c, int lane) const {
    const int P = per_source(), R = a.ctx.num_ranks;
    if (c >= R * P) {  // unused output rows (alignment padding, past the groups): zeros, -1
      const int first = (c - R * P) * kZeroChunkRows;
      const int last = min(a.capacity, first + kZeroChunkRows);
      for (int base = first; base < last; base += 32) {  // a row per lane looks itself up
        int position, local;
        const int i = base + lane;
        const bool unused =
            i < last && source_of_row<true>(tb, i, R, a.num_experts / R, &position, &local) < 0;
        for (uint32_t left = __ballot_sync(0xffffffffu, unused); left != 0; left &= left - 1)
          write_unused_row(a, base + __ffs(left) - 1, 1, lane);
      }
      return;
    }
    const int s = c / P, T = a.num_tokens, K = a.num_topk, me = a.ctx.rank;
    const int first = (c % P) * a.chunk_rows, last = min(T, first + a.chunk_rows);
    for (int t = first; t < last; ++t) {
      const size_t slot = size_t(s) * T + t;
      const char* rec = record(me, slot);
      if (__ldcg(reinterpret_cast<const uint32_t*>(rec)) == 0) continue;  // not sent to us
      const PairEntry* entries = reinterpret_cast<const PairEntry*>(rec + kPairRecordHeader);
      int row = -1, id = -1;
      float weight = 0.f;
      if (lane < K) {
        row = __ldcg(&entries[lane].row);
        id = __ldcg(&entries[lane].id);
        weight = __ldcg(&entries[lane].weight);
      }
      char* rows[kSources];
      char* scales[kSources];
#pragma unroll
      for (int j = 0; j < kSources; ++j) {
        const int rj = __shfl_sync(0xffffffffu, row, j);
        const bool valid = rj >= 0 && rj < a.capacity;
        rows[j] = valid ? static_cast<char*>(a.out_x) + size_t(rj) * a.x_row_bytes : nullptr;
        scales[j] = valid ? reinterpret_cast<char*>(a.out_scales) + size_t(rj) * a.scale_row_bytes
                          : nullptr;
      }
      broadcast_row<kSources, true>(
          rows, region<char>(a.ctx, me, a.push.rows) + slot * row_stride(a.x_row_bytes),
          a.x_row_bytes, lane);
      if (a.scales != nullptr)
        broadcast_row<kSources, true>(
            scales,
            region<char>(a.ctx, me, a.push.scales) + slot * row_stride(a.scale_row_bytes),
            a.scale_row_bytes, lane);
      if (lane < K && row >= 0 && row < a.capacity) {
        a.out_topk_idx[row] = id;
        a.out_topk_weights[row] = weight;
        a.src_rank[row] = s;
        a.src_token[row] = t;
        a.src_k[row] = lane;
        a.pair_row[slot * K + lane] = row;
      }
    }
  }

  // Lane k < K takes pair (t, k): its row, rank and metadata load in parallel (a loop over
  // k on one lane made K dependent round trips per token).
  __device__ void push(int t, int lane) const {
    const PeerContext& ctx = a.ctx;
    const int R = ctx.num_ranks, me = ctx.rank, K = a.num_topk, E = a.num_experts, L = E / R;
    const size_t slot = size_t(me) * a.num_tokens + t;
    int row = -1, rank = -1, id = -1;  // rank -1: no pair here (masked, dropped, or k >= K)
    float weight = 0.f;
    if (lane < K) {
      const int entry = t * K + lane;
      const int rank_in_list = a.send_slot[entry];
      if (rank_in_list >= 0) {  // not masked
        const int e = a.topk_idx[entry];
        row = destination_row<true>(a, tb, entry, rank_in_list);
        a.send_slot[entry] = row;  // -1: dropped at the destination's capacity
        if (row >= 0) {
          rank = e / L;
          id = e % L;
          weight = a.topk_weights[entry];
        }
      }
    }
    if (rank == me) {  // our own pair: straight to its row, with its metadata
      a.out_topk_idx[row] = id;
      a.out_topk_weights[row] = weight;
      a.src_rank[row] = me;
      a.src_token[row] = t;
      a.src_k[row] = lane;
      a.pair_row[slot * K + lane] = row;
    }
    // the token's first kept pair on each peer: its lane sends the data there
    const uint32_t same_rank = __match_any_sync(0xffffffffu, rank);
    const bool first = rank >= 0 && rank != me && lane == __ffs(same_rank) - 1;
    const uint32_t firsts = __ballot_sync(0xffffffffu, first);
    // each reached peer's record: the rows of the token's pairs there (-1 for the others)
    for (uint32_t left = firsts; left != 0; left &= left - 1) {
      const int peer = __shfl_sync(0xffffffffu, rank, __ffs(left) - 1);
      char* rec = record(peer, slot);
      PairEntry* entries = reinterpret_cast<PairEntry*>(rec + kPairRecordHeader);
      if (lane < K)
        entries[lane] = rank == peer ? PairEntry{row, id, weight} : PairEntry{-1, -1, 0.f};
      if (lane == 0) *reinterpret_cast<uint32_t*>(rec) = 1;
    }
    uint32_t reached = 1u << me;  // the peers this token does not reach get a header of 0
    for (uint32_t left = firsts; left != 0; left &= left - 1)
      reached |= 1u << __shfl_sync(0xffffffffu, rank, __ffs(left) - 1);
    for (int r = lane; r < R; r += 32)
      if (!(reached >> r & 1u)) *reinterpret_cast<uint32_t*>(record(r, slot)) = 0;
    char* rows[kSources];
    char* scales[kSources];
#pragma unroll
    for (int j = 0; j < kSources; ++j) {  // compile-time indices: registers
      const int rj = __shfl_sync(0xffffffffu, rank, j), row_j = __shfl_sync(0xffffffffu, row, j);
      rows[j] = scales[j] = nullptr;
      if (rj == me) {
        rows[j] = static_cast<char*>(a.out_x) + size_t(row_j) * a.x_row_bytes;
        scales[j] = reinterpret_cast<char*>(a.out_scales) + size_t(row_j) * a.scale_row_bytes;
      } else if (firsts >> j & 1u) {
        rows[j] = region<char>(ctx, rj, a.push.rows) + slot * row_stride(a.x_row_bytes);
        scales[j] = region<char>(ctx, rj, a.push.scales) + slot * row_stride(a.scale_row_bytes);
      }
    }
    broadcast_row(rows, static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes,
                  a.x_row_bytes, lane);
    if (a.scales != nullptr)
      broadcast_row(scales,
                    reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes,
                    a.scale_row_bytes, lane);
    __syncwarp();  // every lane's stores of this token precede lane 0's fence
    if (lane == 0) {
      __threadfence_system();
      const int chunk = me * per_source() + t / a.chunk_rows;
      for (int r = 0; r < R; ++r)  // every peer counts the token, sent to it or not
        if (r != me) atomicAdd_system(&control_of(ctx, r)->arrivals[chunk], 1u);
    }
  }
};

template <bool kExpertMajor, int kSources>
__global__ void __launch_bounds__(kThreads) dispatch_fused(DispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchFused, kEnter);
  wait_all_ready(ctx, call, "dispatch");
  profile_mark(ctx, kProfDispatchFused, kWaited);
  extern __shared__ int32_t tables[];
  GatherTables tb;
  build_tables<kExpertMajor>(a, region<int32_t>(ctx, ctx.rank, a.push.matrix), tables, tb);
  if constexpr (kExpertMajor) {
    ExpertMajorPush<kSources> path{a, tb};
    fused_loop(a, path, ctx.num_ranks);
  } else {
    RankMajorPush<kSources> path{a, tb};
    fused_loop(a, path, ctx.num_ranks);
  }
  profile_end(ctx, kProfDispatchFused);
  finish_dispatch<kExpertMajor>(a, tb, call, 7, kProfDispatchFused);
}

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
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCachedGather, kEnter);
  wait_all_ready(ctx, call, "cached_dispatch");
  profile_mark(ctx, kProfCachedGather, kWaited);
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
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, ctx.rank)->epoch = call;
    profile_mark(ctx, kProfCachedGather, kRetired);
  }
}

// expert_major: each (source, token) row with pairs here is loaded once (over NVLink for a
// peer's) and stored to every pair's row; rows of no pair get zeros.
template <int kSources>
__global__ void __launch_bounds__(kThreads) gather_pairs(CachedDispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfCachedGather, kEnter);
  wait_all_ready(ctx, call, "cached_dispatch");
  profile_mark(ctx, kProfCachedGather, kWaited);
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
    signal_all(ctx, Flag::kDone, call);
    control_of(ctx, ctx.rank)->epoch = call;
    profile_mark(ctx, kProfCachedGather, kRetired);
  }
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 1;
  }();
  return count;
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
    return launch_cooperative_after_previous(
        reinterpret_cast<const void*>(dispatch_stage_ranks<kPull>), grid, kThreads, 0, stream,
        params);
  }
  const size_t counts_bytes = sizeof(int32_t) * a.num_experts;
  if (kExpertMajor && a.num_experts <= kStageCounts && counts_bytes <= 48 * 1024) {
    const int grid = std::min({a.num_blocks, multiprocessors(), kMaxStageBlocks,
                               kStageCounts / a.num_experts});
    DispatchArgs args = a;
    void* params[] = {&args};
    return launch_cooperative_after_previous(
        reinterpret_cast<const void*>(dispatch_stage_experts<kPull>), grid, kThreads,
        counts_bytes, stream, params);
  }
  return launch_after_previous(dispatch_stage<kExpertMajor, kPull>, std::max(W, a.num_blocks),
                               kThreads, 0, stream, a);
}

// kSources: destinations of one token (ranks, or top-k slots) rounded up, so that the push's
// per-destination arrays stay in registers (sized kMaxSources, they spilled).
template <bool kExpertMajor, int kSources>
cudaError_t launch_dispatch_mode(const DispatchArgs& a, size_t tables, cudaStream_t stream) {
  cudaError_t status = cudaSuccess;
  auto allow_tables = [&](auto kernel, size_t bytes) {
    if (bytes > 48 * 1024)
      status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes));
    return status == cudaSuccess;
  };
  // Every kernel's shared memory is allowed before the first launch: a refusal after the
  // stage (which signals the peers) would leave the call half done on every PE.
  if (a.fused) {
    if (!allow_tables(dispatch_fused<kExpertMajor, kSources>, tables)) return status;
    if ((status = launch_stage<kExpertMajor, false>(a, stream)) != cudaSuccess) return status;
    return launch_after_previous(dispatch_fused<kExpertMajor, kSources>, a.num_blocks, kThreads,
                                 tables, stream, a);
  }
  if (!allow_tables(dispatch_gather<kExpertMajor>, tables)) return status;
  if (a.copy_engine && (status = enqueue_dispatch_copies(a, stream)) != cudaSuccess)
    return status;
  if ((status = launch_stage<kExpertMajor, true>(a, stream)) != cudaSuccess) return status;
  status = launch_after_previous(dispatch_gather<kExpertMajor>, a.num_blocks, kThreads, tables,
                                 stream, a);
  if (status == cudaSuccess && a.copy_engine) status = copy_engine_join(a.ctx, stream);
  return status;
}

}  // namespace

// Copy-engine dispatch, before the stage: this PE's x (and scales) to every peer's landing
// slot for us, chunk-major, so that every peer's first chunk is under way before anyone's
// second.
void add_dispatch_transfers(const DispatchArgs& a, CopySequence& sequence) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, T = a.num_tokens;
  for (int c = 0; c < a.copy_chunks; ++c) {
    const int first = c * a.copy_chunk_rows, rows = std::min(a.copy_chunk_rows, T - first);
    const size_t landing = size_t(ctx.rank) * T + first;
    const CopyPiece pieces[2] = {
        {a.plan.rows + landing * a.x_row_bytes,
         static_cast<const char*>(a.x) + size_t(first) * a.x_row_bytes, rows * a.x_row_bytes},
        {a.plan.scales + landing * a.scale_row_bytes,
         reinterpret_cast<const char*>(a.scales) + size_t(first) * a.scale_row_bytes,
         a.scales != nullptr ? rows * a.scale_row_bytes : 0},
    };
    for (int step = 1; step < R; ++step)
      sequence.add_transfer((ctx.rank + step) % R, c, /*after_kernel=*/-1, pieces, 2);
  }
}

// The guard, then the transfers above.
cudaError_t enqueue_dispatch_copies(const DispatchArgs& a, cudaStream_t stream) {
  cudaError_t status = copy_engine_guard(a.ctx, /*combine=*/false, stream);
  if (status != cudaSuccess) return status;
  CopySequence sequence;
  add_dispatch_transfers(a, sequence);
  return copy_engine_run(a.ctx, sequence, stream);
}

int max_block_shared_memory() {
  static const int bytes = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return n;
  }();
  return bytes;
}

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  DispatchArgs a = args;
  const int R = a.ctx.num_ranks, E = a.num_experts;
  // Rows per arrival counter (fused mode): output rows (rank_major, at least 4) or a source's
  // tokens (expert_major, as few as one: a token expands to ~K/R rows, and the last tokens to
  // arrive are expanded by as many warps as there are tokens); small chunks, so that the
  // copy-out of the last rows to arrive (one warp per chunk) is short, at most kMaxChunks
  // counters (expert_major: R per-source ranges, rounded up each).
  const int64_t rows = a.expert_major ? int64_t(R) * a.num_tokens : a.capacity;
  const int64_t counters = a.expert_major ? kMaxChunks - R : kMaxChunks;
  const int64_t least = a.expert_major ? 1 : 4;
  a.chunk_rows = static_cast<int>(std::max<int64_t>(least, (rows + counters - 1) / counters));
  if (a.copy_engine)
    copy_chunking(a.num_tokens, a.x_row_bytes, kDispatchCopyChunkMB, &a.copy_chunk_rows,
                  &a.copy_chunks);
  if (a.source_slots) return launch_dispatch_slots(a, stream);
  const size_t tables = dispatch_table_bytes(R, E, a.expert_major);
  const int sources = a.expert_major ? a.num_topk : R;
  auto launch = [&](auto expert_major) {
    constexpr bool kEM = decltype(expert_major)::value;
    if (sources <= 2) return launch_dispatch_mode<kEM, 2>(a, tables, stream);
    if (sources <= 4) return launch_dispatch_mode<kEM, 4>(a, tables, stream);
    if (sources <= 8) return launch_dispatch_mode<kEM, 8>(a, tables, stream);
    return launch_dispatch_mode<kEM, kMaxSources>(a, tables, stream);
  };
  return a.expert_major ? launch(std::true_type{}) : launch(std::false_type{});
}

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
