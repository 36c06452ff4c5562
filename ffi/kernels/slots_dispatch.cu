// Dispatch in the source_slots layout: row s*T + t of the output holds source s's token t.
// Every source's copy engines land all of its rows in its peers' landing areas
// (add_dispatch_transfers), so the CTAs only publish the routing, copy rows locally into
// their fixed places and write each row's metadata: no per-destination scan, no token lists.
#include "kernels/intranode.h"

namespace jax_ep {
namespace {

// Ids (and weights) a lane loads together for one row: one round trip per group of them.
constexpr int kIdsPerRound = 8;

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
    signal_all(ctx, Flag::kReady, call);
    profile_mark(ctx, kProfDispatchStage, kRetired);
  }
}

// One lane's row i (source s, token t): the source's ids and weights (over NVLink for a peer),
// loaded in groups before any store, become the row's local ids and weights and the handle's
// entries. Returns whether one of the token's experts is here (the row is used).
__device__ bool write_row_metadata(const DispatchArgs& a, int i, int s, int t) {
  const PeerContext& ctx = a.ctx;
  const int K = a.num_topk, E = a.num_experts, L = E / ctx.num_ranks, me = ctx.rank;
  const int32_t* ids = region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K;
  const float* weights = region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K;
  int32_t* out_ids = a.out_topk_idx + size_t(i) * K;
  float* out_weights = a.out_topk_weights + size_t(i) * K;
  bool used = false;
  for (int k0 = 0; k0 < K; k0 += kIdsPerRound) {
    int32_t e[kIdsPerRound];
    float w[kIdsPerRound];
#pragma unroll
    for (int u = 0; u < kIdsPerRound; ++u) {
      e[u] = k0 + u < K ? __ldcg(ids + k0 + u) : -1;
      w[u] = k0 + u < K ? __ldcg(weights + k0 + u) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kIdsPerRound; ++u) {
      if (k0 + u >= K) break;
      const bool here = valid_expert(e[u], E) && e[u] / L == me;
      out_ids[k0 + u] = here ? e[u] % L : -1;
      out_weights[k0 + u] = here ? w[u] : 0.f;
      if (here) {
        used = true;
        atomicAdd(&a.tokens_per_expert[e[u] % L], 1);
      }
    }
  }
  a.src_rank[i] = used ? s : -1;
  a.src_token[i] = used ? t : -1;
  a.src_k[i] = -1;
  return used;
}

__global__ void __launch_bounds__(kThreads) slots_gather(DispatchArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, kProfDispatchGather, kEnter);
  wait_all_ready(ctx, call, "dispatch");
  profile_mark(ctx, kProfDispatchGather, kWaited);
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, rows = R * T;
  const int L = a.num_experts / R;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  // Warp w takes positions w, w + warps, ..., 32 at a time (lane q resolves the q-th one's
  // metadata), so that the grid walks the rows in the order they land: this PE's own block
  // first (x holds it), then me + 1, ..., each in token order as the chunks arrive.
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
      if (s == me) {
        copy_row(out_row, static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes,
                 a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row(out_scales,
                   reinterpret_cast<const char*>(a.scales) + size_t(t) * a.scale_row_bytes,
                   a.scale_row_bytes, lane, 32);
        continue;
      }
      wait_landed(ctx, s, t / a.copy_chunk_rows, lane, "dispatch");
      // L1 may hold the area's previous call: the copy engine wrote around it
      copy_row<true>(out_row, region<char>(ctx, me, a.plan.rows) + size_t(i) * a.x_row_bytes,
                     a.x_row_bytes, lane, 32);
      if (a.scales != nullptr)
        copy_row<true>(out_scales,
                       region<char>(ctx, me, a.plan.scales) + size_t(i) * a.scale_row_bytes,
                       a.scale_row_bytes, lane, 32);
    }
  }
  last_used = __reduce_max_sync(0xffffffffu, last_used);
  if (lane == 0 && last_used > 0) atomicMax(a.num_received, last_used);
  profile_end(ctx, kProfDispatchGather);
  if (!last_block(ctx, 1)) return;
  for (int l = threadIdx.x; l < L; l += kThreads)
    a.group_sizes[l] = __ldcg(a.tokens_per_expert + l);
  if (threadIdx.x == 0) {
    close_copy_engine_call(ctx, a.copy_chunks, "dispatch");
    finish_call(ctx, call);
    profile_mark(ctx, kProfDispatchGather, kRetired);
  }
}

}  // namespace

cudaError_t launch_dispatch_slots(const DispatchArgs& a, cudaStream_t stream) {
  cudaError_t status = copy_engine_guard(a.ctx, /*combine=*/false, stream);
  if (status != cudaSuccess) return status;
  CopySequence sequence;
  add_dispatch_transfers(a, sequence);
  status = copy_engine_run(a.ctx, sequence, stream);
  if (status == cudaSuccess)
    status = launch_after_previous(slots_stage, a.num_blocks, kThreads, 0, stream, a);
  if (status == cudaSuccess)
    status = launch_after_previous(slots_gather, a.num_blocks, kThreads, 0, stream, a);
  if (status == cudaSuccess) status = copy_engine_join(a.ctx, stream);
  return status;
}

}  // namespace jax_ep
