// Intranode normal-mode kernels (NVLink through the symmetric buffer's peer pointers).
//
// Every operation takes two launches:
//   1. stage   : wait until every peer finished the previous call, write what peers will read
//                into this PE's symmetric buffer (dispatch: per-destination counts and token
//                lists; combine: its rows, or for expert_major one partial sum per (source,
//                token)), then raise ready[me] on every peer of the call's group (the lean
//                push's stage instead writes its totals and output addresses as words tagged
//                with the call, which the stores wait for, and the push kernel raises ready);
//   2. gather  : wait for every peer's ready flag, read what this PE needs straight from the
//                peers' buffers into the XLA output (the pull paths), or store this PE's rows
//                into the receivers' regions and move out the rows that have arrived in its
//                own (dispatch_fused, the default dispatch); then raise done[me] (peers.cuh).
// A token's row crosses NVLink at most once per (token, rank) in every layout: expert_major
// rows are expanded to their (token, k) pairs on the receiving side, and its combine sums a
// token's pairs on the expert's rank before the sum crosses back (docs/design.md).
// Calls are numbered by a device-side counter that the kernels advance themselves, so the
// sequence needs no host synchronisation and can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/buffer_layout.h"
#include "kernels/device_utils.cuh"
#include "kernels/element_type.h"
#include "kernels/launch.h"
#include "transport/copy_sequence.cuh"

namespace jax_ep {

// Threads per block of the intranode kernels.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct DispatchArgs {
  PeerContext ctx;
  RegionPlan plan;  // pull mode
  PushPlan push;    // push mode
  // Push mode: senders store rows into the receivers' regions and, in the same kernel, the
  // receivers move complete chunks out as they arrive. Pull mode otherwise.
  bool fused;
  int chunk_rows;  // fused: output rows per arrival counter
  int num_tokens, num_topk, num_experts, capacity, alignment;
  bool expert_major;
  int num_blocks;  // CTAs of the gather kernel (SM budget)
  // inputs
  const void* x;
  size_t x_row_bytes;
  const float* scales;  // nullptr unless FP8
  size_t scale_row_bytes;
  const int32_t* topk_idx;
  const float* topk_weights;
  // outputs
  void* out_x;
  float* out_scales;
  int32_t* out_topk_idx;
  float* out_topk_weights;
  int32_t* tokens_per_expert;
  int32_t* group_sizes;
  int32_t* num_received;
  int32_t* num_dropped;
  int32_t* send_slot;
  int32_t* src_rank;
  int32_t* src_token;
  int32_t* src_k;
  // expert_major: [R][T][K] the row each (source, token, k) pair became here, -1 if none (the
  // combine's and the cached dispatch's lookup); nullptr otherwise.
  int32_t* pair_row;
  // Pull mode whose rows the sources' copy engines deliver into this PE's landing area
  // (plan_dispatch_copy) in chunks of copy_chunk_rows tokens, copy_chunks per source.
  bool copy_engine;
  int copy_chunk_rows, copy_chunks;
  // Bytes of rows per copy-engine transfer, from the call's configuration.
  size_t copy_chunk_bytes;
  // The source_slots layout: row s*T + t is source s's token t (copy_engine is set too).
  bool source_slots;
  // Fused rank_major with out_x (and out_scales) inside this PE's mapped XLA allocation: the
  // peers store their rows there (Control::xla_out_x) instead of into the push region.
  bool direct_out;
  // The fused rank_major path where the XLA windows are open (kernels/dispatch_lean.cu): the
  // pull stage (lists, counts, ids; no rows), then every source stores its rows into their
  // final rows at each destination (plan_dispatch_lean: its landing area where the output is
  // not published).
  bool lean;
  // The pull path (not the copy engines) with x, scales, topk_idx and topk_weights inside this
  // PE's mapped XLA allocation: the peers read them there (Control::xla_in) instead of from a
  // staged copy, and the call ends once every peer is done reading.
  bool in_place;
  // The lean push quantising the rows to e4m3 on the way (dispatch with use_fp8): x holds
  // unquantised rows of x_type (scales nullptr); x_row_bytes and scale_row_bytes are the
  // output's (one byte a channel, a float per 128 channels). The other paths get rows the
  // handler quantised first.
  bool quantize, ue8m0;
  ElementType x_type;
};

struct CachedDispatchArgs {
  PeerContext ctx;
  int num_tokens, capacity, num_blocks;
  int num_topk;  // expert_major (pair_row set): the pairs per token; else 0
  const void* x;
  size_t row_bytes;
  const int32_t* src_rank;
  const int32_t* src_token;
  // expert_major: [R][T][K] rows of each pair (the dispatch's pair_row): a token's row crosses
  // NVLink once and is stored to all of its rows here; nullptr: one load per row.
  const int32_t* pair_row;
  void* out;
  // The combine's backward (expert_major, weighted): out[i] = weights[i] * x_row(i) in x's
  // dtype, and d_weights[i] = <x_row(i), y[i]> in float32, from one load of each row; weights
  // nullptr otherwise.
  const float* weights;
  const void* y;
  float* d_weights;
  ElementType dtype;
};

struct CombineArgs {
  PeerContext ctx;
  // rank_major with the rows moved by the copy engines (plan_combine_copy), in chunks of
  // copy_chunk_rows records per owner slot, copy_chunks per slot.
  bool copy_engine;
  int copy_chunk_rows, copy_chunks;
  // Bytes of rows per copy-engine transfer, from the call's configuration.
  size_t copy_chunk_bytes;
  // The source_slots layout (rank_major otherwise): with copy_engine, each owner's block of y
  // goes unstaged (plan_combine_slots).
  bool source_slots;
  int num_tokens, num_topk, num_experts, capacity, hidden;
  bool expert_major;
  int num_blocks;
  ElementType dtype;
  const void* y;
  const float* weights;
  const int32_t* topk_idx;
  const int32_t* send_slot;
  const int32_t* num_received;
  const int32_t* src_rank;  // [C]: rows with -1 are not staged
  const int32_t* src_token;  // [C]: each row's token at its owner (the push combine)
  const int32_t* pair_row;  // expert_major: [R][T][K] (DispatchArgs::pair_row)
  void* out;
  // rank_major: rows pushed into the owners' [source][token] slots (plan_combine_push)
  bool push;
  // The pull path with y and weights inside this PE's mapped XLA allocation: the peers read
  // them there (Control::combine_in) instead of from a staged copy.
  bool unstaged;
};

__device__ __forceinline__ bool valid_expert(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

// Destination ranks of token t as a bit mask (R <= 32); invalid expert ids are ignored.
__device__ __forceinline__ uint32_t rank_mask(const DispatchArgs& a, int t, int L) {
  uint32_t mask = 0;
  for (int k = 0; k < a.num_topk; ++k) {
    const int e = a.topk_idx[size_t(t) * a.num_topk + k];
    if (valid_expert(e, a.num_experts)) mask |= 1u << (e / L);
  }
  return mask;
}

// Output row i's local ids and weights from its source's K ids and weights (over NVLink for a
// peer), loaded in groups of kIdsPerRound per round trip, counted into tokens_per_expert.
// Returns whether one of them is an expert of this PE (the row is used).
constexpr int kIdsPerRound = 8;
__device__ __forceinline__ bool write_local_ids(const DispatchArgs& a, int i, const int32_t* ids,
                                                const float* weights) {
  const int K = a.num_topk, E = a.num_experts, L = E / a.ctx.num_ranks, me = a.ctx.rank;
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
  return used;
}

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
// The fused push dispatch (dispatch_fused.cu), given the bytes of its offset tables.
cudaError_t launch_dispatch_fused(const DispatchArgs& args, size_t tables, cudaStream_t stream);

// Shared memory of the dispatch kernels' routing tables (every layout but source_slots):
// expert_major keeps per-expert counts and offsets and a per-(expert, source) matrix.
inline size_t dispatch_table_bytes(int num_ranks, int num_experts, bool expert_major) {
  const size_t R = num_ranks, E = num_experts, L = E / R;
  return expert_major ? sizeof(int32_t) * (2 * E + L + L * (R + 1))
                      : sizeof(int32_t) * (2 * R + 1);
}

// The most dynamic shared memory one block of this device may opt in to.
int max_block_shared_memory();
// The source_slots layout (slots_dispatch.cu): always the copy engines' transfers.
cudaError_t launch_dispatch_slots(const DispatchArgs& args, cudaStream_t stream);
cudaError_t launch_dispatch_lean(const DispatchArgs& args, cudaStream_t stream);
// The copy-engine dispatch's transfers (guard, then x to every peer's landing area).
cudaError_t enqueue_dispatch_copies(const DispatchArgs& a, cudaStream_t stream);
void add_dispatch_transfers(const DispatchArgs& a, CopySequence& sequence);
cudaError_t launch_cached_dispatch(const CachedDispatchArgs& args, cudaStream_t stream);
// The cached dispatch's stage (its owner's rows into the symmetric buffer), and the combine's
// weighted backward after it (combine_pairs.cu).
cudaError_t launch_cached_stage(const CachedDispatchArgs& args, cudaStream_t stream);
cudaError_t launch_combine_backward(const CachedDispatchArgs& args, cudaStream_t stream);
cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream);
// The combine's paths (combine_pull.cu is the entry point and the pull path): the copy
// engines' (combine_copy.cu) and expert_major's (combine_pairs.cu).
cudaError_t launch_combine_copy(const CombineArgs& args, cudaStream_t stream);
cudaError_t launch_combine_pairs(const CombineArgs& args, cudaStream_t stream);
cudaError_t launch_combine_push(const CombineArgs& args, cudaStream_t stream);

}  // namespace jax_ep
