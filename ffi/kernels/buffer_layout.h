// How one call carves the symmetric buffer, and how many bytes it needs.
//
// Every PE runs the same calls with the same static shapes, so every PE computes the same
// offsets and can address a peer's regions through that peer's base pointer. Regions:
//
//   Control    epoch, "last block" counters, ready[] and done[] flags (fixed size, offset 0)
//   matrix     [R][W] int32: row s = PE s's counts per destination (W = R ranks, or E experts)
//   lists      [W][list_len] int32: per destination, this PE's tokens (or token*K+k pairs)
//   meta       [T][K] int32 expert ids + [T][K] float weights of this PE's tokens
//   rows       staged rows: this PE's tokens (dispatch) or expert outputs (combine)
//
// A call may reuse what an earlier call left: calls are ordered by the done[] flags.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/control.h"

namespace jax_ep {

// Rows one token sums in combine, or destinations one token has in the push dispatch: ranks
// (rank_major) or top-k slots (expert_major). The Python API checks these limits at trace time
// (module.limits()).
constexpr int kMaxSources = 16;
// Top-k of the low-latency kernels.
constexpr int kLLMaxTopk = 32;

// Bytes of one staged row, padded so that every row starts 16-byte aligned.
JAX_EP_HOST_DEVICE inline size_t row_stride(size_t row_bytes) { return align_up(row_bytes, 16); }

struct RegionPlan {
  size_t matrix = 0, lists = 0, meta_ids = 0, meta_weights = 0, rows = 0, scales = 0;
  size_t positions = 0;  // the lean push only
  size_t end = 0;  // bytes needed
  size_t list_len = 0;
};

// Dispatch (and the pull side of cached dispatch): W destinations, rows = this PE's tokens.
// expert_major lists hold (token, k) pairs, so they are T*K long; rank_major ones T.
JAX_EP_HOST_DEVICE inline RegionPlan plan_dispatch(int num_ranks, int num_tokens, int num_topk,
                                                    int num_experts, bool expert_major,
                                                    size_t x_row_bytes, size_t scale_row_bytes) {
  RegionPlan p;
  size_t offset = align_up(sizeof(Control), kRegionAlign);
  const size_t width = expert_major ? num_experts : num_ranks;
  p.list_len = expert_major ? size_t(num_tokens) * num_topk : size_t(num_tokens);
  p.matrix = offset;
  offset = align_up(offset + sizeof(int32_t) * num_ranks * width, kRegionAlign);
  p.lists = offset;
  offset = align_up(offset + sizeof(int32_t) * width * p.list_len, kRegionAlign);
  p.meta_ids = offset;
  offset = align_up(offset + sizeof(int32_t) * num_tokens * num_topk, kRegionAlign);
  p.meta_weights = offset;
  offset = align_up(offset + sizeof(float) * num_tokens * num_topk, kRegionAlign);
  p.rows = offset;
  offset = align_up(offset + row_stride(x_row_bytes) * num_tokens, kRegionAlign);
  p.scales = offset;
  offset = align_up(offset + row_stride(scale_row_bytes) * num_tokens, kRegionAlign);
  p.end = offset;
  return p;
}

// Copy-engine dispatch: the pull plan's control regions (matrix, lists, ids, weights), and a
// landing area where every source's copy engine writes all of its tokens' rows as x holds
// them (unpadded: one transfer per chunk): rows [R][T], then scales [R][T] (FP8).
JAX_EP_HOST_DEVICE inline RegionPlan plan_dispatch_copy(int num_ranks, int num_tokens,
                                                        int num_topk, int num_experts,
                                                        bool expert_major, size_t x_row_bytes,
                                                        size_t scale_row_bytes) {
  RegionPlan p = plan_dispatch(num_ranks, num_tokens, num_topk, num_experts, expert_major, 0, 0);
  const size_t rows = size_t(num_ranks) * num_tokens;
  p.rows = p.end;
  p.scales = align_up(p.rows + x_row_bytes * rows, kRegionAlign);
  p.end = align_up(p.scales + scale_row_bytes * rows, kRegionAlign);
  return p;
}

// The lean push (rank_major by the SMs, the XLA windows open): the pull plan's control
// regions; positions [T][R] int32, each token's place in every destination's list (the stage
// writes them; the push turns them into the handle's send_slot, and the warps pushing a
// token's other pieces still read them); and a landing area where the sources store the rows
// of a destination whose output is not published, at their output rows: rows [capacity],
// then scales [capacity] (FP8).
JAX_EP_HOST_DEVICE inline RegionPlan plan_dispatch_lean(int num_ranks, int num_tokens,
                                                        int num_topk, int num_experts,
                                                        int capacity, size_t x_row_bytes,
                                                        size_t scale_row_bytes) {
  RegionPlan p = plan_dispatch(num_ranks, num_tokens, num_topk, num_experts, false, 0, 0);
  p.positions = p.end;
  p.rows = align_up(p.positions + sizeof(int32_t) * num_tokens * num_ranks, kRegionAlign);
  p.scales = align_up(p.rows + x_row_bytes * capacity, kRegionAlign);
  p.end = align_up(p.scales + scale_row_bytes * capacity, kRegionAlign);
  return p;
}

// Copy-engine combine (rank_major): an expert rank stages, for every owner s, the rows of s's
// tokens from y (contiguous there, but from a start only the device knows) at a fixed place:
// staged [s][T] records; its copy engines send the whole slot to s's landing area at [r][T].
// Record q of a slot is the owner's q-th token in its list for r: its row, then its weight
// (one transfer per chunk), padded so that every row starts 16-byte aligned.
struct CombineCopyPlan {
  size_t staged = 0, landed = 0, record_stride = 0, weight_offset = 0, end = 0;
};

JAX_EP_HOST_DEVICE inline CombineCopyPlan plan_combine_copy(int num_ranks, int num_tokens,
                                                            size_t row_bytes) {
  CombineCopyPlan p;
  const size_t records = size_t(num_ranks) * num_tokens;
  p.weight_offset = row_stride(row_bytes);
  p.record_stride = p.weight_offset + 16;
  p.staged = align_up(sizeof(Control), kRegionAlign);
  p.landed = align_up(p.staged + p.record_stride * records, kRegionAlign);
  p.end = align_up(p.landed + p.record_stride * records, kRegionAlign);
  return p;
}

// Copy-engine combine of the source_slots layout: an owner's rows are one contiguous block of
// y (rows s*T .. s*T + T - 1), so the expert rank's copy engines send the block and its
// weights straight from y and the weights, unstaged: landed rows [R][T] as y holds them, then
// landed weights [R][T].
struct SlotsCombinePlan {
  size_t rows = 0, weights = 0, end = 0;
};

JAX_EP_HOST_DEVICE inline SlotsCombinePlan plan_combine_slots(int num_ranks, int num_tokens,
                                                              size_t row_bytes) {
  SlotsCombinePlan p;
  const size_t records = size_t(num_ranks) * num_tokens;
  p.rows = align_up(sizeof(Control), kRegionAlign);
  p.weights = align_up(p.rows + row_bytes * records, kRegionAlign);
  p.end = align_up(p.weights + sizeof(float) * records, kRegionAlign);
  return p;
}

// Push-mode dispatch. rank_major: senders write rows straight to their final position in the
// receiver's region (rows from this PE go straight to the output), with a metadata record per
// row (token, K local ids, K weights). expert_major: a token's row goes once to each peer's
// staging slot s*T + t, with a record: whether it was sent this call, then K (row, local id,
// weight) entries, the rows of its pairs there.
struct PushPlan {
  size_t matrix = 0, rows = 0, scales = 0, meta = 0, meta_stride = 0, end = 0;
};

JAX_EP_HOST_DEVICE inline PushPlan plan_dispatch_push(int num_ranks, int num_tokens,
                                                      int num_topk, int num_experts,
                                                      bool expert_major, int capacity,
                                                      size_t x_row_bytes,
                                                      size_t scale_row_bytes) {
  PushPlan p;
  size_t offset = align_up(sizeof(Control), kRegionAlign);
  const size_t width = expert_major ? num_experts : num_ranks;
  p.matrix = offset;
  offset = align_up(offset + sizeof(int32_t) * num_ranks * width, kRegionAlign);
  const size_t rows = expert_major ? size_t(num_ranks) * num_tokens : size_t(capacity);
  p.rows = offset;
  offset = align_up(offset + row_stride(x_row_bytes) * rows, kRegionAlign);
  p.scales = offset;
  offset = align_up(offset + row_stride(scale_row_bytes) * rows, kRegionAlign);
  p.meta_stride = expert_major ? align_up(4 + 12 * size_t(num_topk), 16)
                               : align_up(4 + 8 * size_t(num_topk), 16);
  p.meta = offset;
  offset = align_up(offset + p.meta_stride * rows, kRegionAlign);
  p.end = offset;
  return p;
}

// Combine: every PE stages its `capacity` expert-output rows and their weights.
JAX_EP_HOST_DEVICE inline RegionPlan plan_combine(int capacity, size_t y_row_bytes) {
  RegionPlan p;
  size_t offset = align_up(sizeof(Control), kRegionAlign);
  p.meta_weights = offset;
  offset = align_up(offset + sizeof(float) * capacity, kRegionAlign);
  p.rows = offset;
  offset = align_up(offset + row_stride(y_row_bytes) * capacity, kRegionAlign);
  p.end = offset;
  return p;
}

// The push combine (rank_major): every source's rows and weights at [source][token] of the
// owner's buffer, the rows 16-byte aligned.
struct CombinePushPlan {
  size_t weights = 0, rows = 0, end = 0;
};
JAX_EP_HOST_DEVICE inline CombinePushPlan plan_combine_push(int num_ranks, int num_tokens,
                                                            size_t y_row_bytes) {
  CombinePushPlan p;
  const size_t slots = size_t(num_ranks) * num_tokens;
  size_t offset = align_up(sizeof(Control), kRegionAlign);
  p.weights = offset;
  offset = align_up(offset + sizeof(float) * slots, kRegionAlign);
  p.rows = offset;
  offset = align_up(offset + row_stride(y_row_bytes) * slots, kRegionAlign);
  p.end = offset;
  return p;
}

// Bytes each operation needs; the FFI handlers check these, so the hint below cannot drift.
JAX_EP_HOST_DEVICE inline size_t dispatch_bytes(int num_ranks, int num_tokens, int num_topk,
                                                int num_experts, bool expert_major, int capacity,
                                                size_t x_row_bytes, size_t scale_row_bytes,
                                                bool push) {
  return push ? plan_dispatch_push(num_ranks, num_tokens, num_topk, num_experts, expert_major,
                                   capacity, x_row_bytes, scale_row_bytes).end
              : plan_dispatch(num_ranks, num_tokens, num_topk, num_experts, expert_major,
                              x_row_bytes, scale_row_bytes).end;
}

JAX_EP_HOST_DEVICE inline size_t combine_bytes(int capacity, size_t y_row_bytes) {
  return plan_combine(capacity, y_row_bytes).end;
}

// Cached dispatch stages the source's T rows in the combine plan's row region.
JAX_EP_HOST_DEVICE inline size_t cached_dispatch_bytes(int num_tokens, size_t row_bytes) {
  return plan_combine(num_tokens, row_bytes).end;
}

// The node exchange of a group with one rank per node (kernels/node_exchange.cu): N inbox
// blocks of T rows (block s: what the rank on node s sent; this PE's own block stages its rows
// for the puts), their FP8 scales, and per block the source's [T][K] ids then [T][K] weights;
// the return direction stages its rows apart (`staged`, [N][T]: block s is what goes to s),
// since its peers put into the blocks it would stage in.
struct NodePlan {
  size_t rows = 0, scales = 0, meta = 0, staged = 0;
  size_t row_stride = 0, scale_stride = 0, meta_stride = 0;
  size_t end = 0;
};

JAX_EP_HOST_DEVICE inline NodePlan plan_node_exchange(int num_nodes, int num_tokens,
                                                     int num_topk, size_t row_bytes,
                                                     size_t scale_row_bytes, bool returning) {
  NodePlan p;
  size_t offset = align_up(sizeof(Control), kRegionAlign);
  const size_t slots = size_t(num_nodes) * num_tokens;
  p.row_stride = row_stride(row_bytes);
  p.scale_stride = row_stride(scale_row_bytes);
  p.meta_stride = align_up(size_t(8) * num_tokens * num_topk, 16);
  p.rows = offset;
  offset = align_up(offset + p.row_stride * slots, kRegionAlign);
  p.scales = offset;
  offset = align_up(offset + p.scale_stride * slots, kRegionAlign);
  p.meta = offset;
  offset = align_up(offset + p.meta_stride * num_nodes, kRegionAlign);
  p.staged = offset;
  if (returning) offset = align_up(offset + p.row_stride * slots, kRegionAlign);
  p.end = offset;
  return p;
}

// Bytes that every call of a dispatch / combine pair of these shapes needs, backward passes
// included (combine's backward is a cached dispatch of T rows, dispatch's a combine of C rows,
// both in elem_bytes per element), in any dispatch mode; the copy-engine paths' larger areas
// only with copy_engine. What buffer_size_hint reports.
inline size_t required_buffer_bytes(int num_ranks, int num_tokens, int hidden, int elem_bytes,
                                    int num_topk, int num_experts, int capacity, bool expert_major,
                                    bool fp8, bool copy_engine = false,
                                    bool push_combine = false) {
  const size_t x_row = fp8 ? size_t(hidden) : size_t(hidden) * elem_bytes;
  const size_t scale_row = fp8 ? sizeof(float) * (hidden / 128) : 0;
  const size_t y_row = size_t(hidden) * elem_bytes;
  const size_t sizes[] = {
      dispatch_bytes(num_ranks, num_tokens, num_topk, num_experts, expert_major, capacity, x_row,
                     scale_row, /*push=*/false),
      dispatch_bytes(num_ranks, num_tokens, num_topk, num_experts, expert_major, capacity, x_row,
                     scale_row, /*push=*/true),
      copy_engine ? plan_dispatch_copy(num_ranks, num_tokens, num_topk, num_experts,
                                       expert_major, x_row, scale_row).end
                  : 0,
      !expert_major ? plan_dispatch_lean(num_ranks, num_tokens, num_topk, num_experts, capacity,
                                         x_row, scale_row).end
                    : 0,
      copy_engine && !expert_major ? plan_combine_copy(num_ranks, num_tokens, y_row).end : 0,
      copy_engine && !expert_major ? plan_combine_slots(num_ranks, num_tokens, y_row).end : 0,
      combine_bytes(capacity, y_row),
      push_combine && !expert_major ? plan_combine_push(num_ranks, num_tokens, y_row).end : 0,
      cached_dispatch_bytes(num_tokens, y_row),
  };
  size_t need = 0;
  for (size_t s : sizes) need = s > need ? s : need;
  return need;
}

}  // namespace jax_ep

// ----------------------------------------------------------------------------- low latency
//
// The low-latency (decode) kernels use a second symmetric allocation of their own, so that
// they never collide with normal-mode calls. Its layout:
//
//   [0, kLLControlBytes)       LLControl: call counters, arrival counters, epoch flags
//   dispatch area [ctrl, mid)  parity 0 region grows up from ctrl, parity 1 down from mid
//   combine area  [mid, end)   parity 0 region grows up from mid, parity 1 down from end
//
// with end = the buffer size rounded down to kRegionAlign and mid = ctrl + 4/8 of (end - ctrl)
// rounded down (a fixed split: dispatch regions hold R*M records, possibly FP8, combine
// regions R*M partial rows of the combine dtype). Call n of an operation uses the region of
// parity n % 2; the two parities grow from opposite ends of their area, so two calls in
// flight never overlap whatever their shapes, as long as each fits in half of its area
// (what the handlers check). A region is a words section (counts, headers, gate words, tags:
// what is read by its call number or rewritten in full every call) and a data section
// (records); parity 0 puts its words first, parity 1 last, so that the words sections of calls
// of the same R, E, M and K always coincide (see LLDispatchPlan).
//
// Dispatch region (at the receiver): counts [R][L] uint64 (row s: source s's kept pairs per
// local expert, tagged with the call), the pair headers [R][M][K] uint64 (entry (s, token, k), written for every
// token of the call and k at every rank, wherever the pair went: the call number's low 32 bits
// << 32 | expert * M + slot (the global expert: the receiver keeps only the entries naming its
// own experts), or 0xffffffff for a pair with no expert or dropped at its source; so a receive
// reads no entry of an earlier call); data: records [R][M]: record
// (s, token) = the row (data), then the FP8 scales, as tagged 128-byte lines (LLDispatchPlan).
// A token is stored once per destination rank (at every rank of its node where its call's
// shape differs from its parity's last).
// Combine region (at every PE): gate words [R][M][K] uint64 (entry (s, token, k), written by
// owner s into every other rank's buffer: the call number's low 32 bits << 32 | the bits of
// the pair's float32 weight; a word carries its own call number, so the expert rank reads it
// with neither a flag nor a fence, except after a call of another shape: LLControl's
// combine_words), tags [M][R] uint32 (tag (token, r) = the low 32 bits of the number of the
// call whose partial row r wrote into record (token, r), or of the call before it where r had
// no pair of the token, written by every rank for every token every call: the owner sums the
// records tagged with its call, in rank order); data: records [M][R]: record (token, r) = the
// partial row expert rank r summed over its pairs of that token, as tagged 128-byte lines (a
// call of another shape than its parity's last writes every record, zeros where r has no
// pair, so that later calls of its shape find only older numbers there); for a
// group across nodes also staging [R][M]: row (owner, token), this rank's partial for an owner
// on another node, written here and put from here into the owner's record.

namespace jax_ep {


// A region holds a words section (the arrays read by their tags or written in full every
// call) and a data section (records). Call n's region of parity 0 puts its words section
// first, at the start of its area, parity 1 last, at the area's end (ll_sections): so the
// words of every call with the same ranks, experts, max tokens and top-k sit at the same place
// whatever the size of its rows. Calls of another shape put their words elsewhere: a word
// read there may be bytes of an older call's counts or records, so what a call reads by its
// number alone must not be stale (the dispatch's headers are all rewritten every call; the
// combine rewrites all its tags, and flags its gate words, when its shape changes).
// A record (the dispatch's and the combine's) travels as 128-byte lines of kLLLinePayload
// bytes and the call's number (low 32 bits) in the last 8 (NCCL's LL128 shape): eight lanes of
// a warp store a line, 16 bytes each, in one instruction, and NVLink delivers such a line whole,
// so a receiver whose eight lanes load the line in one instruction and find its tag holds the
// line's bytes of that call, with no flag or fence between the stores and the loads
// (ll_dispatch_fresh in low_latency.cu). A sixteenth of the bytes carries tags.
constexpr size_t kLLLineBytes = 128, kLLLinePayload = 120;

struct LLDispatchPlan {
  size_t counts = 0;         // words section: [R][L] uint64: call << 32 | count
  size_t headers = 0;        // words section: [R][M][K] uint64: call << 32 | l * M + slot
  size_t words_bytes = 0;    // the words section
  size_t records = 0;        // data section: [R][M] records (source, token)
  size_t record_stride = 0;  // record_lines 128-byte lines
  size_t record_lines = 0;   // lines of a record's payload: the row, then the FP8 scales
  size_t payload_bytes = 0;  // the row's bytes and the scales'
  size_t scale_offset = 0;   // the scales in the payload (after the row)
  size_t bytes = 0;          // region size
};

JAX_EP_HOST_DEVICE inline LLDispatchPlan plan_ll_dispatch(int num_ranks, int num_experts,
                                                          int max_tokens, int num_topk,
                                                          size_t row_bytes, size_t scale_bytes) {
  LLDispatchPlan p;
  p.counts = 0;
  p.headers = align_up(sizeof(uint64_t) * size_t(num_experts), kRegionAlign);
  p.words_bytes = align_up(
      p.headers + sizeof(uint64_t) * size_t(num_ranks) * max_tokens * num_topk, kRegionAlign);
  p.records = 0;
  p.scale_offset = row_bytes;
  p.payload_bytes = row_bytes + scale_bytes;
  p.record_lines = (p.payload_bytes + kLLLinePayload - 1) / kLLLinePayload;
  p.record_stride = kLLLineBytes * p.record_lines;
  p.bytes = align_up(p.words_bytes + p.record_stride * size_t(num_ranks) * max_tokens,
                     kRegionAlign);
  return p;
}

struct LLCombinePlan {
  size_t gate_words = 0;     // words section: [R][M][K] uint64: call << 32 | weight bits
  size_t tags = 0;           // words section: [M][R] uint32: call (low bits) of record (t, r)
  size_t words_bytes = 0;    // the words section
  size_t records = 0;        // data section: [M][R] partial rows (token, expert rank)
  size_t record_lines = 0;   // tagged 128-byte lines of a partial row
  size_t record_stride = 0;
  size_t staging = 0;        // data section, staged only: [R][M] partial rows (owner, token)
  size_t bytes = 0;
};

// staged: the group reaches some owner on another node by puts, so each partial row for such
// an owner is written here first (staging) and put from there into the owner's record.
JAX_EP_HOST_DEVICE inline LLCombinePlan plan_ll_combine(int num_ranks, int max_tokens,
                                                        int num_topk, size_t row_bytes,
                                                        bool staged = false) {
  LLCombinePlan p;
  p.gate_words = 0;
  p.tags = align_up(sizeof(uint64_t) * size_t(num_ranks) * max_tokens * num_topk, kRegionAlign);
  p.words_bytes =
      p.tags + align_up(sizeof(uint32_t) * size_t(max_tokens) * num_ranks, kRegionAlign);
  p.records = 0;
  p.record_lines = (row_bytes + kLLLinePayload - 1) / kLLLinePayload;
  p.record_stride = kLLLineBytes * p.record_lines;
  const size_t rows = p.record_stride * size_t(max_tokens) * num_ranks;
  p.staging = p.records + rows;
  p.bytes = align_up(p.words_bytes + rows * (staged ? 2 : 1), kRegionAlign);
  return p;
}

// Byte offsets (in the buffer) of call n's words and data sections inside the area [begin,
// end): parity 0 from begin (words, then data), parity 1 ending at end (data, then words).
struct LLSections {
  size_t words = 0, data = 0;
};

JAX_EP_HOST_DEVICE inline LLSections ll_sections(uint64_t n, size_t begin, size_t end,
                                                 size_t words_bytes, size_t bytes) {
  if (n & 1) return {end - words_bytes, end - bytes};
  return {begin, begin + words_bytes};
}

struct LLAreas {
  size_t dispatch_begin = 0, dispatch_end = 0, combine_begin = 0, combine_end = 0;
};

constexpr size_t kLLDispatchEighths = 4;  // of the buffer after the control block

inline LLAreas ll_areas(size_t buffer_bytes) {
  LLAreas a;
  const size_t ctrl = ll_control_bytes();
  const size_t end = buffer_bytes / kRegionAlign * kRegionAlign;
  if (end <= ctrl) return a;  // all empty
  const size_t span = end - ctrl;
  const size_t dispatch_span = span / 8 * kLLDispatchEighths / kRegionAlign * kRegionAlign;
  a.dispatch_begin = ctrl;
  a.dispatch_end = a.combine_begin = ctrl + dispatch_span;
  a.combine_end = end;
  return a;
}

// Buffer bytes that make a dispatch region of `region` bytes (per parity) fit, i.e. that
// satisfy 2 * region <= dispatch area (and likewise for combine): the handlers' check is the
// exact predicate, these sufficient sizes are what they report and what the hint adds up.
inline size_t ll_bytes_for_dispatch(size_t region) {
  const size_t span = (2 * region + 2 * kRegionAlign) * 8 / kLLDispatchEighths + 64;
  return ll_control_bytes() + span + 2 * kRegionAlign;
}

inline size_t ll_bytes_for_combine(size_t region) {
  const size_t span = 2 * region * 8 / (8 - kLLDispatchEighths) + 64;
  return ll_control_bytes() + span + 2 * kRegionAlign;
}

// Bytes of the low-latency buffer that every call of a low-latency dispatch + combine of these
// shapes needs, FP8 or not, backward passes (cached dispatches of [T, H] rows and [T, K]
// float32 weights) included; elem_bytes is the largest element size of x and y.
// across_nodes: the group spans several nodes (the combine stages the rows it puts).
inline size_t required_low_latency_bytes(int max_tokens, int hidden, int num_experts,
                                         int num_topk, int num_ranks, int elem_bytes,
                                         bool across_nodes = false) {
  const size_t rows[] = {
      plan_ll_dispatch(num_ranks, num_experts, max_tokens, num_topk, size_t(hidden),
                       sizeof(float) * size_t(hidden / 128)).bytes,
      plan_ll_dispatch(num_ranks, num_experts, max_tokens, num_topk,
                       size_t(hidden) * elem_bytes, 0).bytes,
      plan_ll_dispatch(num_ranks, num_experts, max_tokens, num_topk,
                       sizeof(float) * num_topk, 0).bytes,
  };
  size_t dispatch = 0;
  for (size_t r : rows) dispatch = r > dispatch ? r : dispatch;
  const size_t combine =
      plan_ll_combine(num_ranks, max_tokens, num_topk, size_t(hidden) * elem_bytes,
                      across_nodes).bytes;
  const size_t a = ll_bytes_for_dispatch(dispatch);
  const size_t b = ll_bytes_for_combine(combine);
  return a > b ? a : b;
}

}  // namespace jax_ep
