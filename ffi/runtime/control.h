// The control block at the start of every PE's symmetric buffers (normal mode: Control;
// low latency: LLControl): the flags, counters and phase stamps that the kernels write and the
// runtime's diagnostics read, with the limits that size them. Kernels and runtime both include
// it; it includes nothing of theirs.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define JAX_EP_HOST_DEVICE __host__ __device__
#else
#define JAX_EP_HOST_DEVICE
#endif

namespace jax_ep {

constexpr int kMaxRanks = 1024;

// A dispatch's inputs as one PE published them for its peers (Control::xla_in).
struct XlaInputs {
  uint64_t x, scales, ids, weights;
};
constexpr int kProfileKernels = 16;
// Rows of Control::profile: handler call c since the last reset stamps row c % (kProfileCalls
// - 1), so a chain of calls leaves a timeline (gaps between calls included); the last row is
// the kernels' in cached copy-engine graphs (a per-call row would change their arguments).
constexpr int kProfileCalls = 64;
// Stamps per kernel and call: see Control::profile.
constexpr int kProfilePhases = 5;
// Arrival counters of the fused dispatch: one per chunk of output rows (kMaxChunks at most).
constexpr int kMaxChunks = 16384;
// The parallel rank_major stage: per-CTA counts of at most this many CTAs and ranks.
constexpr int kMaxStageBlocks = 256;
constexpr int kMaxStageRanks = 32;
// Control::stage_counts entries: CTAs x destinations (ranks or experts) of a parallel stage.
constexpr int kStageCounts = 32768;
// Copy-engine dispatch: at most this many ranks, and chunks per source (Control::landed).
constexpr int kMaxCopyRanks = kMaxStageRanks;
constexpr int kMaxCopyChunks = 64;

// Kernels that stamp their phases into Control::profile (the index is the kernel's slot).
enum ProfileSlot {
  kProfDispatchStage = 0,
  kProfDispatchGather,
  kProfCachedStage,
  kProfCachedGather,
  kProfCombineStage,
  kProfCombineReduce,
  kProfDispatchFused,
  kProfLLDispatchSend,
  kProfLLDispatchReceive,
  kProfLLCombineSend,
  kProfLLCombineReceive,
  kProfLLDispatchSlots,  // the dispatch send's slot warps: slots, pair headers, counts
  kProfNumSlots
};
static_assert(kProfNumSlots <= kProfileKernels, "Control::profile has a row per slot");

struct Control {
  uint64_t epoch;               // calls this PE has completed
  uint32_t block_counter[16];   // arrival counters of the "last block" pattern, per kernel
  // Indexed by PE (not by rank in the call's group). ready[s] = e: PE s, a peer of this PE's
  // call e, has staged its data; done[s] = e: PE s has finished every access of its call e
  // (raised at every PE of the job: a PE's next call may have another group).
  uint64_t ready[kMaxRanks];
  uint64_t done[kMaxRanks];
  // entered[s] = e: PE s, on another node, has entered its call e with every access of its
  // node's PEs to its buffer over: the node exchange (kernels/node_exchange.cu) puts into a PE
  // only after this, since done[] does not cross nodes.
  uint64_t entered[kMaxRanks];
  // The pull combine's sources: combine_in[s] = the low and high halves of PE s's y and
  // weights for the current call (in its own address space, see XlaWindow; 0 where it staged
  // them), each word tagged with the call (its low 32 bits in the high half). An unstaged
  // source writes them as its reduce kernel opens, a staged one once its rows are staged (after
  // a system fence); the reduce waits for them alone, acquiring (no ready flag).
  uint64_t combine_in[kMaxRanks][4];
  // The fused dispatch's direct rows (rank_major): xla_out_x[s] / xla_out_scales[s] = PE s's
  // outputs for the current call, in its own address space, 0 when its rows go through the
  // push region (written before ready[s]).
  uint64_t xla_out_x[kMaxRanks];
  uint64_t xla_out_scales[kMaxRanks];
  // The pull dispatch's sources read in place: xla_in[s] = PE s's inputs for the current call
  // (x, scales, top-k ids, top-k weights), in its own address space, x 0 when it staged them
  // (written before ready[s]).
  XlaInputs xla_in[kMaxRanks];
  // The source_slots dispatch by the SMs and rank_major's lean push: pushed[s] = e: PE s has
  // stored every row of its call e that this PE receives (into this PE's output or its
  // landing area).
  uint64_t pushed[kMaxRanks];
  // Phase timestamps (globaltimer ns) read by the benchmarks, one row per handler call (ring):
  // [call][kernel][0] first block entered, [1] last block done waiting for peers, [2] first
  // block finished, [3] last block finished, [4] retired: the last block past its closing
  // fences and flags (normal-mode kernels). Reset by the host (runtime profile_reset).
  unsigned long long profile[kProfileCalls][kProfileKernels][kProfilePhases];
  // arrivals[c] = rows of chunk c written into this PE's push region so far in the current
  // fused dispatch; the receiver that consumes the chunk sets it back to 0.
  uint32_t arrivals[kMaxChunks];
  // Parallel stages: tokens (rank_major) or pairs (expert_major) each CTA has per destination
  // rank or expert, [CTA][destination], and their grid barrier.
  int32_t stage_counts[kStageCounts];
  unsigned stage_arrived, stage_generation;
  // Work counters (kCursor*): warps claim tokens from them, so the SMs whose stores drain
  // faster take more of the work. The kernel launched before the one claiming zeroes it.
  uint32_t work_cursor[2];
  // Fused dispatch: chunks of each chunk range (a source's rows) already moved out.
  uint32_t chunk_cursor[kMaxStageRanks];
  // rank_major's lean push, written by each source's stage as soon as it has its totals, with
  // no flag or fence: each word carries its call (low 32 bits in the high half), so the
  // stores, which need nothing else of a peer, wait for these words alone.
  // lean_totals[s][w] = rank s's rows for rank w; lean_out[s] = the low and high halves of
  // rank s's out_x and out_scales for the call (0: its landing area). Indexed by rank in the
  // group.
  uint64_t lean_totals[kMaxStageRanks][kMaxStageRanks];
  uint64_t lean_out[kMaxStageRanks][4];
  // Copy-engine dispatch: landed[s][c] = 1 once PE s's copy engine has written chunk c of its
  // tokens into our landing area; this PE's last gather block sets them back to 0 (after all
  // landed) before it raises done, so PE s writes them again only in the next call (dispatch
  // and combine both use them: calls are ordered by done[]).
  uint64_t landed[kMaxCopyRanks][kMaxCopyChunks];
};
enum WorkCursor { kCursorDispatch = 0, kCursorCombine = 1 };

enum class Flag { kReady, kDone, kPushed };

constexpr size_t kRegionAlign = 256;

// A PE's allocation of XLA's device memory (the one its JAX arrays live in), mapped into this
// process: remote is its base in the PE's own address space, mapped the same bytes here, size
// 0 where nothing is mapped. A peer's address a in [remote, remote + size) reads at
// mapped + (a - remote) here.
struct XlaWindow {
  uint64_t mapped, remote, size;
};

JAX_EP_HOST_DEVICE inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

constexpr int kLLOps = 2;  // 0: dispatch (and cached dispatch), 1: combine

struct LLControl {
  uint64_t calls[kLLOps];          // calls of each op started by this PE's send kernels
  uint32_t block_counter[8];       // "last block" and "last to start" counters, one per use
  // arrived[op][parity][s] = n: PE s has written all its data of call n into this buffer
  uint64_t arrived[kLLOps][2][kMaxRanks];
  // consumed[op][parity][d] = n: PE d has finished the receive of its call n (raised at every
  // PE of the job, as done[] above). Both indexed by PE.
  uint64_t consumed[kLLOps][2][kMaxRanks];
  // consumed_pending[op] = n (0: none): the last kernel of ours that received op ran the
  // receive of this PE's call n and has not raised consumed[op] for it: the next kernel of
  // ours does (every kernel of ours starts once the ones before it are complete), so that no
  // block of a receive counts blocks or fences at its end.
  uint64_t consumed_pending[kLLOps];
  // gates[s] = n: PE s has written its gate words of combine call n here: put by a PE on
  // another node; stored by a peer of this node only where the call's words section may hold
  // another shape's bytes (combine_words below), else they are tagged words, which need no flag
  uint64_t gates[kMaxRanks];
  // combine_words[parity] = the shape of this PE's last combine call of that parity ({M << 32
  // | T, R << 32 | K, record stride}): a call of the same shape finds, at its gate words, tags
  // and record lines, only tags of older calls. The same on every PE (every PE runs every
  // call, with the same shapes).
  uint64_t combine_words[2][3];
  // dispatch_words[parity] = the shape of this PE's last dispatch send of that parity ({M << 32
  // | T, R << 32 | K, E << 32 | record stride}): a call of the same shape finds, wherever a
  // source may write in its region, only tags of older calls of this shape (a call
  // of another shape writes every record at every rank), and reads them as they land, without
  // the sources' arrival. The same on every PE (every PE runs every call, with the same
  // shapes).
  uint64_t dispatch_words[2][3];
  // dispatch_fresh[parity] = 1 where this PE's last dispatch send of that parity found the
  // shape of the one before it (so its receive reads the words as they land), else 0
  uint64_t dispatch_fresh[2];
  // combine_fresh[parity] = 1 where this PE's last combine send of that parity found the
  // shape of the one before it (so a split receive reads the lines as they land), else 0
  uint64_t combine_fresh[2];
};

JAX_EP_HOST_DEVICE inline size_t ll_control_bytes() {
  return align_up(sizeof(LLControl), kRegionAlign);
}

}  // namespace jax_ep
