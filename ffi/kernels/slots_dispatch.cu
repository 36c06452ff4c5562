// Dispatch in the source_slots layout: row s*T + t of the output holds source s's token t.
// Every source's copy engines land all of its rows in its peers' landing areas
// (add_dispatch_transfers), so the CTAs only publish the routing, copy rows locally into
// their fixed places and write each row's metadata: no per-destination scan, no token lists.
// By the SMs (path "fused"): a row's place needs no peer's counts, so each source stores its
// rows into every destination as soon as the call starts: straight into the destination's
// output where it published one (the XLA windows), else into its landing area.
#include <algorithm>

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

// Control::block_counter slot of the SM path's stores (the last block raises pushed[]).
constexpr int kCounterSlotsPush = 6;
// Warps of each block that write the rows' metadata while the others store (SM path, output
// published): two of them cover a 2-rank DeepSeek-V3 output's 8192 rows in two rounds at 64 CTAs.
constexpr int kMetadataWarps = 2;

// Publishes this PE's ids and weights (the receivers read them for their rows' metadata),
// writes send_slot (token t is row me*T + t at every rank holding one of its experts) and
// zeroes what the gather counts into; the last block raises ready.
__global__ void __launch_bounds__(kThreads) slots_stage(DispatchArgs a) {
  wait_previous_kernel();  // launched to overlap the previous kernel's drain
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchStage, kEnter);
  enter_call(ctx, call, "dispatch");
  profile_mark(ctx, kProfDispatchStage, kWaited);
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, K = a.num_topk;
  const int L = a.num_experts / R;
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += kThreads) a.tokens_per_expert[l] = 0;
    if (threadIdx.x == 0) *a.num_received = *a.num_dropped = 0;
  }
  reset_cursor(ctx, kCursorDispatch);  // the SM path's tokens
  int32_t* ids = region<int32_t>(ctx, me, a.plan.meta_ids);
  float* weights = region<float>(ctx, me, a.plan.meta_weights);
  const int thread = blockIdx.x * kThreads + threadIdx.x, threads = gridDim.x * kThreads;
  for (int i = thread; i < T * K; i += threads) {
    ids[i] = a.topk_idx[i];
    weights[i] = a.topk_weights[i];
  }
  for (int t = thread; t < T; t += threads) {
    const uint32_t mask = rank_mask(a, t, L);
    for (int r = 0; r < R; ++r) a.send_slot[size_t(t) * R + r] = mask >> r & 1 ? me * T + t : -1;
  }
  profile_end(ctx, kProfDispatchStage);
  if (last_block(ctx, 0) && threadIdx.x == 0) {
    const int pe = pe_of(ctx, me);
    for (int p = 0; p < R; ++p) {  // before ready: its release orders these
      Control* peer = control_of(ctx, p);
      peer->xla_out_x[pe] = a.direct_out ? reinterpret_cast<uint64_t>(a.out_x) : 0;
      peer->xla_out_scales[pe] = a.direct_out ? reinterpret_cast<uint64_t>(a.out_scales) : 0;
    }
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfDispatchStage, kRetired);
  }
}

// The SM path's stores: warps claim this PE's tokens and store each row (and its scales) into
// row me*T + t of every peer holding one of its experts, and of this PE's own output where one
// is here (the local copy then runs beside the NVLink stores instead of after them); the last
// block then raises pushed[me] at each peer.
// Each destination's output (where it published one) or landing area, for push_slot_rows.
struct SlotTargets {
  char* rows[kMaxCopyRanks];
  char* scales[kMaxCopyRanks];
};

// Fills the block's targets (threads < R); the caller syncs the block before using them.
__device__ void load_slot_targets(const DispatchArgs& a, SlotTargets& targets) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks;
  const Control* mine = control_of(ctx, ctx.rank);
  char** rows = targets.rows;
  char** scales = targets.scales;
  if (threadIdx.x < R) {  // each destination's output (published) or landing area
    const int r = threadIdx.x, pe = pe_of(ctx, r);
    const uint64_t x = __ldcg(&mine->xla_out_x[pe]);
    const uint64_t sc = __ldcg(&mine->xla_out_scales[pe]);
    if (x != 0 && !xla_mapped(ctx, pe)) {  // published, not mapped here
      report_timeout(ctx, "dispatch", "a peer's output outside the mapped XLA allocations", r,
                     0, 0);
      trap_after_report();
    }
    rows[r] = x != 0 ? xla_address(ctx, pe, x) : region<char>(ctx, r, a.plan.rows);
    scales[r] = x != 0 ? (sc != 0 ? xla_address(ctx, pe, sc) : nullptr)
                       : region<char>(ctx, r, a.plan.scales);
  }
}

__device__ void push_slot_rows(const DispatchArgs& a, const SlotTargets& targets, uint64_t call) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, L = a.num_experts / R;
  const int lane = threadIdx.x % 32;
  Control* mine = control_of(ctx, me);
  char* const* rows = targets.rows;
  char* const* scales = targets.scales;
  uint32_t* cursor = &mine->work_cursor[kCursorDispatch];
  for (int t = claim_item(cursor, lane); t < T; t = claim_item(cursor, lane)) {
    const uint32_t mask = rank_mask(a, t, L);
    const char* row = static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes;
    const char* row_scales =
        reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes;
    const size_t i = size_t(me) * T + t;
    for (uint32_t left = mask & ~(1u << me); left != 0; left &= left - 1) {
      const int r = __ffs(left) - 1;
      copy_row(rows[r] + i * a.x_row_bytes, row, a.x_row_bytes, lane, 32);
      if (a.scales != nullptr)
        copy_row(scales[r] + i * a.scale_row_bytes, row_scales, a.scale_row_bytes, lane, 32);
    }
    if (mask >> me & 1) {
      copy_row(static_cast<char*>(a.out_x) + i * a.x_row_bytes, row, a.x_row_bytes, lane, 32);
      if (a.scales != nullptr)
        copy_row(reinterpret_cast<char*>(a.out_scales) + i * a.scale_row_bytes, row_scales,
                 a.scale_row_bytes, lane, 32);
    }
  }
  if (last_block_on(&mine->block_counter[kCounterSlotsPush]) && threadIdx.x == 0) {
    signal_all(ctx, Flag::kPushed, call);
  }
}

// One lane's row i (source s, token t): the source's ids and weights (over NVLink for a peer)
// become the row's local ids and weights and the handle's entries. Returns whether one of the
// token's experts is here (the row is used).
__device__ bool write_row_metadata(const DispatchArgs& a, int i, int s, int t) {
  const PeerContext& ctx = a.ctx;
  const int K = a.num_topk;
  const bool used =
      write_local_ids(a, i, region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K,
                      region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K);
  a.src_rank[i] = used ? s : -1;
  a.src_token[i] = used ? t : -1;
  a.src_k[i] = -1;
  return used;
}

// Warps `warp` of `warps` walk the output rows, 32 at a time (lane q resolves the q-th one's
// metadata), in the order they land: this PE's own block first (x holds it), then me + 1, ...,
// each in token order as the chunks arrive. Each row gets its metadata and, unless it is
// already in place, its data or zeros. Returns one past the last used row this lane saw.
template <bool kSMs>
__device__ int gather_slot_rows(const DispatchArgs& a, uint64_t call, int warp, int warps) {
  const PeerContext& ctx = a.ctx;
  const Control* mine = control_of(ctx, ctx.rank);
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, rows = R * T;
  const int lane = threadIdx.x % 32;
  int last_used = 0;
  for (int j0 = warp; j0 < rows; j0 += 32 * warps) {
    const int j = j0 + lane * warps;
    int my_i = -1;
    bool my_used = false;
    if (j < rows) {
      my_i = j + me * T < rows ? j + me * T : j + me * T - rows;
      my_used = write_row_metadata(a, my_i, my_i / T, my_i % T);
      if (my_used) last_used = max(last_used, my_i + 1);
    }
    const uint32_t used = __ballot_sync(0xffffffffu, my_used);
    for (int q = 0; q < 32; ++q) {
      const int i = __shfl_sync(0xffffffffu, my_i, q);
      if (i < 0) break;  // past the last row, and so are the later lanes' positions
      char* out_row = static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes;
      char* out_scales = reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes;
      if (!(used >> q & 1)) {  // no expert of this token here: a zero row
        zero_row(out_row, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr) zero_row(out_scales, a.scale_row_bytes, lane, 32);
        continue;
      }
      const int s = i / T, t = i % T;
      if (kSMs && s == me) continue;  // the push stored it
      if (s == me) {
        copy_row(out_row, static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes,
                 a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row(out_scales,
                   reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes,
                   a.scale_row_bytes, lane, 32);
        continue;
      }
      if (kSMs) {
        if (a.direct_out) continue;  // the peer stored it here
        if (lane == 0)
          wait_flag(ctx, &mine->pushed[pe_of(ctx, s)], call, "dispatch", "rows pushed", s);
        __syncwarp();
      } else {
        wait_landed(ctx, s, t / a.copy_chunk_rows, lane, "dispatch");
      }
      // L1 may hold the area's previous call: the copy engine (or the peer) wrote around it
      copy_row<true>(out_row, region<char>(ctx, me, a.plan.rows) + size_t(i) * a.x_row_bytes,
                     a.x_row_bytes, lane, 32);
      if (a.scales != nullptr)
        copy_row<true>(out_scales,
                       region<char>(ctx, me, a.plan.scales) + size_t(i) * a.scale_row_bytes,
                       a.scale_row_bytes, lane, 32);
    }
  }
  return last_used;
}

// kSMs: the SM path, which stores this PE's rows at the peers (push_slot_rows). Where this PE
// published its output, the peers' rows land in place and the gather has only metadata (and
// zero rows) to write: kMetadataWarps warps of each block write it first, beside the other
// warps' stores, then join them (the metadata pass after the stores cost ~25 µs of 205).
// Else a peer's rows are in the landing area once its pushed flag has come, so every warp
// stores first (no block holds back this PE's flag while waiting for a peer's).
template <bool kSMs>
__global__ void __launch_bounds__(kThreads) slots_gather(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfDispatchGather, "dispatch");
  const Control* mine = control_of(ctx, ctx.rank);
  const int L = a.num_experts / ctx.num_ranks;
  const int warp_in_block = threadIdx.x / 32;
  int last_used = 0;
  if (kSMs) {
    __shared__ SlotTargets targets;
    load_slot_targets(a, targets);
    __syncthreads();
    if (a.direct_out) {
      if (warp_in_block < kMetadataWarps)
        last_used = gather_slot_rows<kSMs>(a, call, blockIdx.x * kMetadataWarps + warp_in_block,
                                           gridDim.x * kMetadataWarps);
      push_slot_rows(a, targets, call);
    } else {
      push_slot_rows(a, targets, call);
      last_used = gather_slot_rows<kSMs>(a, call, blockIdx.x * kWarps + warp_in_block,
                                         gridDim.x * kWarps);
    }
  } else {
    last_used = gather_slot_rows<kSMs>(a, call, blockIdx.x * kWarps + warp_in_block,
                                       gridDim.x * kWarps);
  }
  last_used = __reduce_max_sync(0xffffffffu, last_used);
  if (threadIdx.x % 32 == 0 && last_used > 0) atomicMax(a.num_received, last_used);
  profile_end(ctx, kProfDispatchGather);
  if (!last_block(ctx, 1, /*reads_blocks=*/true)) return;
  for (int l = threadIdx.x; l < L; l += kThreads)
    a.group_sizes[l] = __ldcg(a.tokens_per_expert + l);
  if (threadIdx.x == 0) {
    if (kSMs) {
      // this PE's accesses of the call are over (every block has arrived): done goes out
      // first, then every peer's rows here (in place, they landed unseen) before the end
      finish_call(ctx, call);
      for (int s = 0; s < ctx.num_ranks; ++s)
        wait_flag(ctx, &mine->pushed[pe_of(ctx, s)], call, "dispatch", "rows pushed", s);
    } else {
      close_copy_engine_call(ctx, a.copy_chunks, "dispatch");
      finish_call(ctx, call);
    }
    profile_mark(ctx, kProfDispatchGather, kRetired);
  }
}

}  // namespace

cudaError_t launch_dispatch_slots(const DispatchArgs& a, cudaStream_t stream) {
  if (!a.copy_engine) {  // by the SMs
    cudaError_t status = launch_after_previous(slots_stage, a.num_blocks, kThreads, 0, stream, a);
    if (status != cudaSuccess) return status;
    // every block resident: a block waiting for a peer's rows must not keep this PE's own
    // pushes from a CTA slot
    return launch_after_previous(slots_gather<true>, std::min(a.num_blocks, multiprocessors()), kThreads, 0,
                                 stream, a);
  }
  cudaError_t status = copy_engine_guard(a.ctx, /*combine=*/false, stream);
  if (status != cudaSuccess) return status;
  CopySequence sequence;
  add_dispatch_transfers(a, sequence);
  status = copy_engine_run(a.ctx, sequence, stream);
  if (status == cudaSuccess)
    status = launch_after_previous(slots_stage, a.num_blocks, kThreads, 0, stream, a);
  if (status == cudaSuccess)
    status = launch_after_previous(slots_gather<false>, a.num_blocks, kThreads, 0, stream, a);
  if (status == cudaSuccess) status = copy_engine_join(a.ctx, stream);
  return status;
}

}  // namespace jax_ep
