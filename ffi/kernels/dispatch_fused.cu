// The fused push dispatch (the default data path): each PE stores its rows into the
// receivers' regions over NVLink and, in the same kernel, moves the chunks that have arrived in
// its own region into the output (rank_major: rows in place; expert_major: a token once per
// rank, expanded to its pairs' rows on arrival). docs/design.md, sections 4.1 and 4.5.
#include <type_traits>

#include "kernels/dispatch_common.cuh"
#include "kernels/push_loop.cuh"

namespace jax_ep {
namespace {

// ------------------------------------------------------------------------------ push mode

// ---- rank_major: rows go straight to their final position, in the receiver's push region
// over NVLink (moved out by the receiver once their chunk has arrived) or in our own output.

// The receivers' outputs where they published them (Control::xla_out_x), as mapped here;
// nullptr where the rows go through the receiver's push region. Read once per block.
template <int kSources>
struct DirectOutputs {
  char* x[kSources];
  char* scales[kSources];
};

template <int kSources>
__device__ void load_direct_outputs(const DispatchArgs& a, DirectOutputs<kSources>* direct) {
  const PeerContext& ctx = a.ctx;
  if (threadIdx.x < kSources) {
    const int r = threadIdx.x;
    char *x = nullptr, *scales = nullptr;
    if (r < ctx.num_ranks && r != ctx.rank) {
      const int pe = pe_of(ctx, r);
      const Control* mine = control_of(ctx, ctx.rank);
      const uint64_t out = *reinterpret_cast<const volatile uint64_t*>(&mine->xla_out_x[pe]);
      const uint64_t sc = *reinterpret_cast<const volatile uint64_t*>(&mine->xla_out_scales[pe]);
      if (out != 0) {
        if (!xla_mapped(ctx, pe)) {  // published, not mapped here
          report_timeout(ctx, "dispatch", "a peer's output outside the mapped XLA allocations",
                         r, 0, 0);
          trap_after_report();
        }
        x = xla_address(ctx, pe, out);
        scales = xla_address(ctx, pe, sc);
      }
    }
    direct->x[r] = x;
    direct->scales[r] = scales;
  }
  __syncthreads();
}

// Where token t's row goes: for each destination rank, its output row's address in the
// receiver's push region (or in our own output when we are the receiver), and the chunk of the
// receiver's output it lands in (-1: not sent). Writes the metadata record of every
// destination row and the row index into send_slot. All lanes of the warp call it.
template <int kSources>
__device__ __forceinline__ void token_destinations(const DispatchArgs& a, const GatherTables& tb,
                                                   const DirectOutputs<kSources>& direct, int t,
                                                   int lane, char* (&rows)[kSources],
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
    } else if (direct.x[r] != nullptr) {  // straight into the receiver's output
      rows[r] = direct.x[r] + size_t(row) * a.x_row_bytes;
      scales[r] = direct.scales[r] + size_t(row) * a.scale_row_bytes;
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
    write_unused_row(a, i, K, lane, a.scales != nullptr);
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
  if (s != me && !a.direct_out) {  // rows a peer wrote, possibly during this kernel: bypass L1
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
// Token t's row (and its scales) from x to every non-null destination by the whole warp, made
// visible system-wide by lane 0's fence (every lane's stores precede it), before the arrival
// counters the caller's lane 0 bumps next.
template <int kSources>
__device__ __forceinline__ void store_token(const DispatchArgs& a, int t, char* (&rows)[kSources],
                                            char* (&scales)[kSources], int lane) {
  broadcast_row(rows, static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes,
                a.x_row_bytes, lane);
  if (a.scales != nullptr)
    broadcast_row(scales, reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes,
                  a.scale_row_bytes, lane);
  __syncwarp();
  if (lane == 0) fence_acq_rel_system();
}

template <int kSources>
struct RankMajorPush {
  const DispatchArgs& a;
  const GatherTables& tb;
  const DirectOutputs<kSources>& direct;
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
    token_destinations<kSources>(a, tb, direct, t, lane, rows, scales, landed);
    store_token(a, t, rows, scales, lane);
    if (lane == 0) {
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
          write_unused_row(a, base + __ffs(left) - 1, 1, lane, a.scales != nullptr);
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
    store_token(a, t, rows, scales, lane);
    if (lane == 0) {
      const int chunk = me * per_source() + t / a.chunk_rows;
      for (int r = 0; r < R; ++r)  // every peer counts the token, sent to it or not
        if (r != me) atomicAdd_system(&control_of(ctx, r)->arrivals[chunk], 1u);
    }
  }
};

template <bool kExpertMajor, int kSources>
__global__ void __launch_bounds__(kThreads) dispatch_fused(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfDispatchFused, "dispatch");
  extern __shared__ int32_t tables[];
  GatherTables tb;
  build_tables<kExpertMajor>(a, region<int32_t>(ctx, ctx.rank, a.push.matrix), tables, tb);
  Control* mine = control_of(ctx, ctx.rank);
  const PushCursors cursors{&mine->work_cursor[kCursorDispatch], mine->chunk_cursor};
  const char* what = "rows of an output chunk";
  if constexpr (kExpertMajor) {
    ExpertMajorPush<kSources> path{a, tb};
    push_loop(ctx, path, a.num_tokens, cursors, ctx.num_ranks, "dispatch", what);
  } else {
    __shared__ DirectOutputs<kSources> direct;
    load_direct_outputs<kSources>(a, &direct);
    RankMajorPush<kSources> path{a, tb, direct};
    push_loop(ctx, path, a.num_tokens, cursors, ctx.num_ranks, "dispatch", what);
  }
  profile_end(ctx, kProfDispatchFused);
  finish_dispatch<kExpertMajor>(a, tb, call, 7, kProfDispatchFused);
}

// kSources: destinations of one token (ranks, or top-k slots) rounded up, so that the push's
// per-destination arrays stay in registers (sized kMaxSources, they spilled).
template <bool kExpertMajor, int kSources>
cudaError_t launch_fused(const DispatchArgs& a, size_t tables, cudaStream_t stream) {
  auto kernel = dispatch_fused<kExpertMajor, kSources>;
  // The kernel's shared memory is allowed before the first launch: a refusal after the stage
  // (which signals the peers) would leave the call half done on every PE.
  if (tables > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(tables));
    if (status != cudaSuccess) return status;
  }
  const cudaError_t status = launch_stage<kExpertMajor, false>(a, stream);
  if (status != cudaSuccess) return status;
  return launch_after_previous(kernel, a.num_blocks, kThreads, tables, stream, a);
}

}  // namespace

cudaError_t launch_dispatch_fused(const DispatchArgs& a, size_t tables, cudaStream_t stream) {
  const int sources = a.expert_major ? a.num_topk : a.ctx.num_ranks;
  auto launch = [&](auto expert_major) {
    constexpr bool kEM = decltype(expert_major)::value;
    if (sources <= 2) return launch_fused<kEM, 2>(a, tables, stream);
    if (sources <= 4) return launch_fused<kEM, 4>(a, tables, stream);
    if (sources <= 8) return launch_fused<kEM, 8>(a, tables, stream);
    return launch_fused<kEM, kMaxSources>(a, tables, stream);
  };
  return a.expert_major ? launch(std::true_type{}) : launch(std::false_type{});
}

}  // namespace jax_ep
