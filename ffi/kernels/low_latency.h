// Low-latency (decode) kernels on their own symmetric buffer (see the low-latency section of
// buffer_layout.h): one launch per half of a split operation, one cooperative launch of both
// halves for a fused one.
//
//   dispatch send     every block numbers the pairs of its experts (several warps per
//                     expert, ids staged in shared memory): each pair's per-(source, expert)
//                     slot, its header (me, token, k) -> (call, local expert, slot) and the
//                     expert's count (a tagged word), written into its rank; meanwhile every
//                     block takes whole tokens, reads a row once (quantising it to FP8 in
//                     registers), stages the record in shared memory and stores it as tagged
//                     128-byte lines into record (me, token) of each distinct destination
//                     rank (once per rank, not per expert). Where the call's shape is not its
//                     parity's last, or the lines may not land whole (not NVLink), or across
//                     nodes, the last block also raises arrived[me].
//   dispatch receive  waits for every source's arrival where the send raised it, else for
//                     each count, header and line to show this call's number; each warp loads
//                     a piece of a record with its pair headers while the counts are scanned
//                     (in a fused call of its parity's last shape the slot warps scan them
//                     once they have numbered, while the token warps send), then stores the piece into the row of each of the record's pairs ([L,
//                     R*M] blocks, the expert_major layout's packed groups, by source from this
//                     rank on, then (token, k), or the record's own row), and records each
//                     pair's row in the handle's pair_row [R][T][K]; the next kernel of ours
//                     raises consumed[me] at every source (LLControl::consumed_pending).
//   combine send      the blocks write this rank's weights as tagged gate words into every
//                     other rank's buffer; each warp takes (owner, token) pieces (other
//                     owners first), finds the rows of the pair in the handle's pair_row
//                     (local), issues their loads, takes the weights (its own, or the
//                     owner's words once they carry this call's number), sums its experts'
//                     rows of that token in k order, weighted (float32, no FMA), and stores
//                     the partial, rounded to y's dtype, into the owner's record [token][me]
//                     as tagged lines: one row per (token, rank), not per k; it writes its tag
//                     of every (owner, token), n or n - 1 where it holds no pair.
//   combine receive   adds a token's partials in rank order (float32) and rounds: the
//                     partials tagged with this call, each line loaded until it lands where
//                     the dispatch's conditions for skipping the arrival hold, else after it.
//
// Across nodes (a job that spans nodes: the kernels' kPuts instantiation): a rank of another
// node is reached by NVSHMEM puts (transport/puts.cuh), the ranks of this node by stores as
// above. The dispatch send writes a record once into this PE's own record (me, token) and puts
// it to each such destination; the pair headers of those pairs go into this PE's own header
// block [me], which the last block puts whole (receivers keep the entries naming their own
// experts); counts go as single puts. The combine send puts its gate words whole with a signal
// (gates[me] at the owner) instead of tagged stores, and sums a partial for such an owner into
// a staging row of its own region before putting it; tags go as single puts. Every block
// completes its puts (quiet) before the last-block count, so arrivals, NVSHMEM signals for
// those PEs, follow every put of the call (as the consumed flags do, raised by a later kernel).
//
// Call numbers come from device-side counters in LLControl advanced by the send kernels; the
// send returns its number and the receive takes it, so the two calls of one operation may be
// separated by the other half of another call (at most two calls of an op in flight). A send
// of call n first waits until every destination has consumed call n - 2 (same parity).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/buffer_layout.h"
#include "kernels/device_utils.cuh"

namespace jax_ep {

constexpr int kLLThreads = 512;

enum class LLElement { kBF16, kF16, kF32, kRaw };

struct LLDispatchSendArgs {
  PeerContext ctx;            // peers: the low-latency buffers
  size_t area_begin, area_end;
  LLDispatchPlan plan;
  int num_tokens, num_topk, num_experts, max_tokens, hidden;
  bool use_fp8, ue8m0, cached;
  LLElement x_type;           // FP8 quantisation reads this type; raw rows are row_bytes
  size_t row_bytes;           // bytes of a sent row (FP8: hidden)
  size_t scale_bytes;         // FP8: hidden / 128 floats, else 0
  int num_blocks;
  // shared memory: a record's payload staged per group of token warps (ll_plan_dispatch_stages)
  size_t stage_offset, stage_bytes;
  int stage_groups;
  const void* x;
  const int32_t* topk_idx;
  const int32_t* slots_in;    // cached: the handle's send_slot
  int32_t* send_slot;
  int32_t* call_out;          // [2]: low, high 32 bits of the call number
  int32_t* num_dropped;
};

struct LLDispatchReceiveArgs {
  PeerContext ctx;
  size_t area_begin, area_end;
  LLDispatchPlan plan;
  int num_experts, max_tokens;
  int num_tokens, num_topk;   // T and K of every source (the program is the same on every rank)
  size_t row_bytes, scale_bytes;
  int num_blocks;
  int num_rows;               // expert_major: the packed rows; 0: [L, R*M] blocks
  bool records;               // out_x holds each record once ([R*M], row s*M + t), the
                              // handle the packed rows (num_rows of them)
  const int32_t* call;
  void* out_x;                // [L, R*M] (or [num_rows], or records [R*M]) rows of row_bytes
  float* out_scales;          // nullptr unless FP8
  int32_t* recv_count;        // [L]
  int32_t* src_rank;          // [L, R*M] or [num_rows] (all three nullptr: not wanted)
  int32_t* src_token;
  int32_t* src_k;
  int32_t* pair_row;          // [R, T, K]: the row of each source pair held here, else -1
};

struct LLCombineSendArgs {
  PeerContext ctx;
  size_t area_begin, area_end;
  LLCombinePlan plan;
  int num_local_experts, rows_per_expert, max_tokens, num_topk, num_experts;
  int num_tokens;             // T of every owner (the program is the same on every rank)
  size_t row_bytes;
  LLElement dtype;            // of y
  int hidden;
  int num_blocks;
  int num_rows;               // expert_major: y's packed rows; 0: [L, R*M] blocks
  const void* y;              // [L, R*M] (or [num_rows]) rows of row_bytes
  const int32_t* recv_count;  // [L]
  const int32_t* pair_row;    // [R, T, K]: the handle's row of each (owner, token, k) pair here
  const float* weights;       // [T, K] this rank's gates, published for the expert ranks
  int32_t* call_out;
};

struct LLCombineReceiveArgs {
  PeerContext ctx;
  size_t area_begin, area_end;
  LLCombinePlan plan;
  int num_tokens, num_topk, num_experts, hidden;
  LLElement dtype;
  int num_blocks;
  const int32_t* call;
  void* out;
};

// Dynamic shared memory of the combine send: the [L] used rows (the bound of pair_row's rows)
// and, expert_major, their sum. The receive needs none.
inline size_t ll_combine_send_smem(int num_local_experts) {
  return sizeof(int32_t) * (size_t(num_local_experts) + 1);
}

// Dynamic shared memory of the dispatch send: the pairs' expert ids (and, cached, the
// handle's slots), then two counts per expert (for the slot scans), then the token groups'
// record stages (ll_plan_dispatch_stages).
inline size_t ll_dispatch_ids_smem(int num_tokens, int num_topk, int num_experts, bool cached) {
  return sizeof(int32_t) * (size_t(num_tokens) * num_topk * (cached ? 2 : 1) +
                            2 * size_t(num_experts));
}
inline size_t ll_dispatch_send_smem(const LLDispatchSendArgs& a) {
  return a.stage_offset + a.stage_bytes * size_t(a.stage_groups);
}
constexpr size_t kLLMaxSendSmem = 200 * 1024;  // what the launchers allow

// The stages of a's records in the send's shared memory (after the ids): one record's payload
// in whole lines per group of token warps, as many groups as a block of num_blocks has tokens
// and as fit (a power of two, at most 8); false where not even one fits.
inline bool ll_plan_dispatch_stages(LLDispatchSendArgs* a) {
  const size_t ids = ll_dispatch_ids_smem(a->num_tokens, a->num_topk, a->num_experts, a->cached);
  const int blocks = a->num_blocks > 0 ? a->num_blocks : 1;
  const int per_block = (a->num_tokens + blocks - 1) / blocks;
  a->stage_offset = align_up(ids, 16);
  a->stage_bytes = align_up(a->plan.record_lines * kLLLinePayload, 16);
  a->stage_groups = 0;
  for (int g = 8; g >= 1; g /= 2)
    if ((g == 1 || g <= per_block) && a->stage_offset + a->stage_bytes * size_t(g) <= kLLMaxSendSmem) {
      a->stage_groups = g;
      break;
    }
  return a->stage_groups > 0;
}

cudaError_t launch_ll_dispatch_send(const LLDispatchSendArgs& args, cudaStream_t stream);
cudaError_t launch_ll_dispatch_receive(const LLDispatchReceiveArgs& args, cudaStream_t stream);
// Where a fused kernel runs, which decides how its grid is launched (every block must be
// resident: the receive half waits for the send half's blocks).
enum class LLPlacement {
  kAlone,       // the program's stream, no kernel of ours beside it: a plain launch of a grid
                // the device holds (a cooperative launch costs 1-1.6 µs a call)
  kBesideOwn,   // the program's stream while another kernel of ours may run beside it (in a
                // captured program, whose kernels KernelStreams cannot order after work
                // outside its graph): cooperative, so that it never holds part of its grid
                // waiting for the rest
  kBesideWork,  // a split call's kernel, beside the program's work: cooperative, its blocks in
                // clusters of two (see ll_cluster)
};

// Both halves in one launch (the fused calls); two launches where the device cannot hold the
// grid at once.
cudaError_t launch_ll_dispatch(const LLDispatchSendArgs& send,
                               const LLDispatchReceiveArgs& receive, cudaStream_t stream,
                               LLPlacement placement);
cudaError_t launch_ll_combine(const LLCombineSendArgs& send, const LLCombineReceiveArgs& receive,
                              cudaStream_t stream, LLPlacement placement);
// A split combine's halves: ll_combine_send_kernel on `blocks` CTAs beside the work, then
// ll_combine_receive_kernel on receive.num_blocks on the program's stream.
cudaError_t launch_ll_combine_send(const LLCombineSendArgs& send, int blocks, cudaStream_t stream,
                                   LLPlacement placement);
cudaError_t launch_ll_combine_receive(const LLCombineReceiveArgs& receive, cudaStream_t stream);

}  // namespace jax_ep
