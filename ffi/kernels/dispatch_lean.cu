// The lean push: rank_major's dispatch by the SMs wherever the XLA windows are open. The pull
// stage lists each destination's tokens and publishes the counts and ids (no rows); then one
// kernel in which every source stores its rows straight to their final row in each
// destination's output (where the destination published it, else its landing area) with no
// per-row record, fence or arrival counter, while kMetadataWarps warps of each block write
// this PE's rows' metadata from the sources' lists and ids. One pushed flag per source tells
// a destination that its rows are all there (docs/design.md, section 4.1).
#include <type_traits>

#include "kernels/dispatch_common.cuh"
#include "kernels/fp8.cuh"

namespace jax_ep {
namespace {

// Control::block_counter slot of the stores (the last block raises pushed[]).
constexpr int kCounterLeanPush = 7;
// Warps of each block that write the metadata before joining the stores: two cover a 2-rank
// DeepSeek-V3 output's ~8200 rows in two rounds at 64 CTAs.
constexpr int kMetadataWarps = 2;

// Lane q's row i (from source s, position `position` in its list for this PE): the source's
// token, then its ids and weights (over NVLink for a peer) become the row's local ids and
// weights and the handle's entries.
__device__ void write_row_metadata(const DispatchArgs& a, int i, int s, int position) {
  const PeerContext& ctx = a.ctx;
  const int K = a.num_topk;
  const int t = __ldcg(region<int32_t>(ctx, s, a.plan.lists) +
                       size_t(ctx.rank) * a.plan.list_len + position);
  write_local_ids(a, i, region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K,
                  region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K);
  a.src_rank[i] = s;
  a.src_token[i] = t;
  a.src_k[i] = -1;
}

// Warps `warp` of `warps` take this PE's output rows 32 at a time, lane q the q-th row's
// metadata; rows past the received ones get zeros (their scales too where `scales`). The
// sources' lists and ids are read once each source has raised ready for `call`.
__device__ void write_metadata(const DispatchArgs& a, const GatherTables& tb, uint64_t call,
                               int warp, int warps, bool scales) {
  const int R = a.ctx.num_ranks, L = a.num_experts / R, C = a.capacity, K = a.num_topk;
  const int lane = threadIdx.x % 32;
  if (lane < R)
    wait_flag(a.ctx, &control_of(a.ctx, a.ctx.rank)->ready[pe_of(a.ctx, lane)], call,
              "dispatch", "data staged", lane);
  __syncwarp();
  for (int j0 = warp * 32; j0 < C; j0 += warps * 32) {
    const int i = j0 + lane;
    bool unused = false;
    if (i < C) {
      int position = 0, local = 0;
      const int s = source_of_row<false>(tb, i, R, L, &position, &local);
      unused = s < 0;
      if (!unused) write_row_metadata(a, i, s, position);
    }
    for (uint32_t left = __ballot_sync(0xffffffffu, unused); left != 0; left &= left - 1)
      write_unused_row(a, j0 + __ffs(left) - 1, K, lane, scales);
  }
}

// Each destination's output as mapped here (`halves`: the low and high halves of its out_x
// and out_scales from Control::lean_out, 0 for its landing area) or its landing area; this
// PE's own output directly.
__device__ void load_targets(const DispatchArgs& a, const uint32_t* halves, char** rows,
                             char** scales) {
  const PeerContext& ctx = a.ctx;
  if (threadIdx.x >= ctx.num_ranks) return;
  const int r = threadIdx.x, pe = pe_of(ctx, r);
  if (r == ctx.rank) {
    rows[r] = static_cast<char*>(a.out_x);
    scales[r] = reinterpret_cast<char*>(a.out_scales);
    return;
  }
  const uint32_t* h = halves + 4 * r;
  const uint64_t x = tagged_pair_value(h, 0), sc = tagged_pair_value(h, 1);
  if (x != 0 && !xla_mapped(ctx, pe)) {  // published, not mapped here
    report_timeout(ctx, "dispatch", "a peer's output outside the mapped XLA allocations", r, 0,
                   0);
    trap_after_report();
  }
  rows[r] = x != 0 ? xla_address(ctx, pe, x) : region<char>(ctx, r, a.plan.rows);
  scales[r] = x != 0 ? (sc != 0 ? xla_address(ctx, pe, sc) : nullptr)
                     : region<char>(ctx, r, a.plan.scales);
}

// Bytes of a row one warp stores as one work item (half a round of copy_row's loads). Whole
// rows (14 KB in BF16 at DeepSeek-V3 shapes) made ~4 items per warp, so the last ones claimed
// kept a few warps storing long after the others had finished: 4 KB pieces took 5 µs of GPU
// time off a BF16 call and 2 off an FP8 one on 2×H100, 8 KB ones 3 and 1 (docs/design.md 4.1).
constexpr size_t kPieceBytes = 4096;

// Lane r < R: token t's row at destination r (-1: not sent there, or dropped past the
// capacity, which the destination counts); `first` writes it to the handle's send_slot.
__device__ __forceinline__ int destination_row(const DispatchArgs& a, const GatherTables& tb,
                                               const int32_t* positions, int R, int C, int t,
                                               bool first, int lane) {
  int row = -1;
  if (lane < R) {
    const int rank_in_list = positions[size_t(t) * R + lane];
    row = rank_in_list >= 0 ? tb.my_offset_at[lane] + rank_in_list : -1;
    if (row >= C) row = -1;
    if (first) a.send_slot[size_t(t) * R + lane] = row;
  }
  return row;
}

// Warps claim pieces of this PE's tokens (token-major, so that a token's pieces go out
// together); lane r turns the token's place in r's list into its row there (the piece-0 warp
// writes it to the handle's send_slot; -1 past the capacity) and the warp stores the piece
// into every destination holding one of the token's experts.
__device__ void push_rows(const DispatchArgs& a, const GatherTables& tb, char* const* rows,
                          char* const* scales) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, T = a.num_tokens, C = a.capacity;
  const int lane = threadIdx.x % 32;
  const int pieces = int((a.x_row_bytes + kPieceBytes - 1) / kPieceBytes);
  const int32_t* positions = region<int32_t>(ctx, ctx.rank, a.plan.positions);
  uint32_t* cursor = &control_of(ctx, ctx.rank)->work_cursor[kCursorDispatch];
  for (int item = claim_item(cursor, lane); item < T * pieces; item = claim_item(cursor, lane)) {
    const int t = item / pieces, piece = item % pieces;
    const int row = destination_row(a, tb, positions, R, C, t, piece == 0, lane);
    const size_t begin = size_t(piece) * kPieceBytes;
    const size_t bytes = a.x_row_bytes - begin < kPieceBytes ? a.x_row_bytes - begin : kPieceBytes;
    const char* x = static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes + begin;
    const char* x_scales = reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes;
    for (uint32_t left = __ballot_sync(0xffffffffu, row >= 0); left != 0; left &= left - 1) {
      const int r = __ffs(left) - 1;
      const size_t i = size_t(__shfl_sync(0xffffffffu, row, r));
      copy_row(rows[r] + i * a.x_row_bytes + begin, x, bytes, lane, 32);
      if (a.scales != nullptr && piece == 0)
        copy_row(scales[r] + i * a.scale_row_bytes, x_scales, a.scale_row_bytes, lane, 32);
    }
  }
}

// push_rows quantising on the way (DispatchArgs::quantize): a work item is kPieceBytes
// channels of a token (kPieceBytes of e4m3 out, of sizeof(T) times as many in); lane q takes
// its 16-channel chunks q, q + 32, ... (a 128-channel block's 8 chunks in 8 neighbouring
// lanes, fp8.cuh), two rounds of loads in flight, and stores each chunk's 16 bytes, and the
// block's scale from its first lane, into every destination holding one of the token's
// experts. Quantised once however many destinations.
template <typename T>
__device__ void push_rows_quantized(const DispatchArgs& a, const GatherTables& tb,
                                    char* const* rows, char* const* scales) {
  constexpr int kRounds = sizeof(T) == 2 ? 2 : 1;  // float rows: one round (registers)
  const PeerContext& ctx = a.ctx;
  const int T_ = a.num_tokens, H = int(a.x_row_bytes);  // e4m3: a byte a channel
  const int lane = threadIdx.x % 32;
  const int pieces = int((size_t(H) + kPieceBytes - 1) / kPieceBytes);
  const int32_t* positions = region<int32_t>(ctx, ctx.rank, a.plan.positions);
  uint32_t* cursor = &control_of(ctx, ctx.rank)->work_cursor[kCursorDispatch];
  for (int item = claim_item(cursor, lane); item < T_ * pieces; item = claim_item(cursor, lane)) {
    const int t = item / pieces, piece = item % pieces;
    const int row = destination_row(a, tb, positions, ctx.num_ranks, a.capacity, t, piece == 0,
                                    lane);
    const uint32_t targets = __ballot_sync(0xffffffffu, row >= 0);
    if (targets == 0) continue;
    // chunks [begin, end) of the row: a multiple of 8 (H and kPieceBytes are of 128)
    const int begin = piece * int(kPieceBytes / 16);
    const int end = min(H / 16, begin + int(kPieceBytes / 16));
    const int4* x = reinterpret_cast<const int4*>(static_cast<const T*>(a.x) + size_t(t) * H);
    for (int c0 = begin + lane; c0 - lane < end; c0 += 32 * kRounds) {
      int4 raw[kRounds][sizeof(T)];
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int c = c0 + 32 * u;
#pragma unroll
        for (int i = 0; i < int(sizeof(T)); ++i)
          raw[u][i] = c < end ? __ldg(x + size_t(c) * sizeof(T) + i) : int4{0, 0, 0, 0};
      }
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int c = c0 + 32 * u;
        float v[16];
        unpack16<T>(raw[u], v);
        int4 packed;
        const float scale = quantize16(v, a.ue8m0, &packed);
        for (uint32_t left = targets; left != 0; left &= left - 1) {
          const int r = __ffs(left) - 1;
          const size_t i = size_t(__shfl_sync(0xffffffffu, row, r));
          if (c >= end) continue;
          reinterpret_cast<int4*>(rows[r] + i * a.x_row_bytes)[c] = packed;
          if ((c & 7) == 0 && scales[r] != nullptr)
            reinterpret_cast<float*>(scales[r] + i * a.scale_row_bytes)[c / 8] = scale;
        }
      }
    }
  }
}

// Quantized: void moves the rows as they are; else their element type, quantised on the way
// (a kernel of its own, so that the default one keeps its registers).
template <typename Quantized>
__global__ void __launch_bounds__(kThreads) dispatch_lean(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  wait_previous_kernel();  // the stage: this PE's places, lists and staged ids are written
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchGather, kEnter);
  const int R = ctx.num_ranks, me = ctx.rank;
  Control* mine = control_of(ctx, me);
  const bool scales_out = a.scales != nullptr || !std::is_void_v<Quantized>;
  __shared__ int32_t matrix[kMaxStageRanks * kMaxStageRanks];
  __shared__ uint32_t halves[kMaxStageRanks * 4];
  __shared__ int32_t tables[2 * kMaxStageRanks + 1];
  __shared__ char* rows[kMaxStageRanks];
  __shared__ char* scales[kMaxStageRanks];
  // every word in one round of loads (a thread each), not one dependent load after another
  const uint32_t tag = uint32_t(call);
  for (int i = threadIdx.x; i < R * R + 4 * R; i += kThreads) {
    if (i < R * R) {
      matrix[i] = int32_t(wait_tagged(ctx, &mine->lean_totals[i / R][i % R], tag, "dispatch",
                                      "a source's row counts", i / R));
    } else {
      const int j = i - R * R, r = j / 4;
      halves[j] = r == me ? 0u
                          : wait_tagged(ctx, &mine->lean_out[r][j % 4], tag, "dispatch",
                                        "a destination's output address", r);
    }
  }
  __syncthreads();
  GatherTables tb;
  build_tables<false>(a, matrix, tables, tb);
  load_targets(a, halves, rows, scales);
  __syncthreads();
  profile_mark(ctx, kProfDispatchGather, kWaited);
  // ready covers only what the peers' metadata warps read (this PE's lists and staged ids), so
  // it goes out here, from one warp that has nothing else to wait for yet (in place, a
  // metadata warp, which waits for the peers' ready next): the stage kernel ends without a
  // closing block, and no block's stores wait for its system fence
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfDispatchStage, kRetired);
  }
  const int warp_in_block = threadIdx.x / 32;
  // Where this PE published its output the peers' rows land in place: the metadata first, on
  // a few warps, beside the others' stores. Else every warp stores first, so that no block
  // holds back this PE's pushed flag while waiting for a peer's.
  if (a.direct_out && warp_in_block < kMetadataWarps)
    write_metadata(a, tb, call, blockIdx.x * kMetadataWarps + warp_in_block,
                   gridDim.x * kMetadataWarps, scales_out);
  if constexpr (std::is_void_v<Quantized>)
    push_rows(a, tb, rows, scales);
  else
    push_rows_quantized<Quantized>(a, tb, rows, scales);
  // In place, nothing is left after the stores: the call's closing block raises pushed[] (one
  // block counter and one fence per block fewer). Else the landing areas are copied out after
  // every source's flag, so the flag goes out first.
  if (!a.direct_out) {
    if (last_block_on(&mine->block_counter[kCounterLeanPush]) && threadIdx.x == 0)
      signal_all(ctx, Flag::kPushed, call);
    write_metadata(a, tb, call, blockIdx.x * kWarps + warp_in_block, gridDim.x * kWarps,
                   scales_out);
    // the peers' rows from the landing area, once each source's flag has come
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * kWarps + warp_in_block, warps = gridDim.x * kWarps;
    for (int s = 0; s < R; ++s) {
      if (s == me) continue;
      const int begin = min(tb.src_offset[s], a.capacity);
      const int end = min(tb.src_offset[s + 1], a.capacity);
      if (begin >= end) continue;
      if (lane == 0)
        wait_flag(ctx, &mine->pushed[pe_of(ctx, s)], call, "dispatch", "rows pushed", s);
      __syncwarp();
      for (int i = begin + warp; i < end; i += warps) {
        // L1 may hold the area's previous call: the peer wrote around it
        copy_row<true>(static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes,
                       region<char>(ctx, me, a.plan.rows) + size_t(i) * a.x_row_bytes,
                       a.x_row_bytes, lane, 32);
        if (scales_out)
          copy_row<true>(reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes,
                         region<char>(ctx, me, a.plan.scales) + size_t(i) * a.scale_row_bytes,
                         a.scale_row_bytes, lane, 32);
      }
    }
  }
  profile_end(ctx, kProfDispatchGather);
  finish_dispatch<false, true>(a, tb, call, 1, kProfDispatchGather);
}

}  // namespace

cudaError_t launch_dispatch_lean(const DispatchArgs& a, cudaStream_t stream) {
  cudaError_t status = launch_stage<false, true>(a, stream);
  if (status != cudaSuccess) return status;
  // every block resident: a block waiting for a peer's rows must not keep this PE's own
  // stores from a CTA slot
  const int blocks = std::min(a.num_blocks, multiprocessors());
  if (!a.quantize) return launch_after_previous(dispatch_lean<void>, blocks, kThreads, 0, stream, a);
  switch (a.x_type) {
    case ElementType::kBF16:
      return launch_after_previous(dispatch_lean<__nv_bfloat16>, blocks, kThreads, 0, stream, a);
    case ElementType::kF16:
      return launch_after_previous(dispatch_lean<__half>, blocks, kThreads, 0, stream, a);
    case ElementType::kF32:
      return launch_after_previous(dispatch_lean<float>, blocks, kThreads, 0, stream, a);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_ep
