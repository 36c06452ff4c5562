// Low-latency (decode) dispatch and combine kernels; see low_latency.h for the protocol.
#include "kernels/low_latency.h"

#include "kernels/fp8.cuh"
#include "kernels/launch.h"
#include "transport/puts.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace jax_ep {
namespace {

constexpr int kWarps = kLLThreads / 32;
// The dispatch send's two warp groups, which run side by side: the first sends the tokens'
// rows, the second numbers the pairs (slots, pair headers, counts). Before, each block did one
// after the other, and the slots ended ~2 µs after the rows.
constexpr int kTokenWarps = kWarps / 2, kSlotWarps = kWarps - kTokenWarps;
constexpr int kTokenThreads = kTokenWarps * 32, kSlotThreads = kSlotWarps * 32;
// named barriers (0 is __syncthreads): the slot warps', then one per group of token warps
constexpr int kSlotBarrier = 1, kTokenBarrier0 = 2;
static_assert(kTokenBarrier0 + kTokenWarps <= 16, "named barriers");

// A barrier among `threads` threads (whole warps) of the block.
__device__ __forceinline__ void group_sync(int barrier, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
}
// Lines of a partial row one warp sums as one work unit: at most kPieceLines (~4.3 KB of
// payload), a multiple of kWarpLines (partial_lines' round).
constexpr size_t kPieceLines = 32;
// A record line's lanes: lane j of each eight of a warp holds bytes [16 j, 16 j + 16) of a line
// (the last lane 8 payload bytes, then the line's tag), so a warp holds four lines at once.
constexpr int kLineLanes = int(kLLLineBytes / 16), kBlockLines = 32 / kLineLanes;
constexpr int kBlockPayload = kBlockLines * int(kLLLinePayload);  // payload bytes of a block
constexpr int kOpDispatch = 0, kOpCombine = 1;
// A pair header's position for a pair dropped at its source (slot >= M): names no row
constexpr uint32_t kNoPosition = 0xffffffffu;
// block_counter slots of LLControl
// (the sends' "last to start" counters: whose block may overwrite what every block reads first)
constexpr int kCounterDispatchSend = 0, kCounterCombineSend = 2, kCounterDispatchStart = 4,
              kCounterCombineStart = 5;

// Base and control block of rank r of the group in the low-latency buffer.
__device__ __forceinline__ char* ll_base(const PeerContext& ctx, int r) {
  return static_cast<char*>(ctx.peers[pe_of(ctx, r)]);
}

__device__ __forceinline__ LLControl* ll_control(const PeerContext& ctx, int r) {
  return reinterpret_cast<LLControl*>(ctx.peers[pe_of(ctx, r)]);
}

// Call n's sections of an op's area (see ll_sections).
template <typename Plan>
__device__ __forceinline__ LLSections sections_of(uint64_t n, size_t begin, size_t end,
                                                  const Plan& plan) {
  return ll_sections(n, begin, end, plan.words_bytes, plan.bytes);
}

__device__ __forceinline__ uint64_t read_call(const int32_t* call) {
  return uint64_t(uint32_t(call[0])) | (uint64_t(uint32_t(call[1])) << 32);
}

// last_block_on the low-latency counter `slot`, for a send's arrival: each block fences its
// writes, the last block's release stores carry every block's NVLink stores (it acquires the
// others' arrivals first, since lanes other than the one that counted raise peers' flags).
// puts: the block's puts are completed first (so the last block's signals follow every put
// of the call).
__device__ inline bool ll_last_block(const PeerContext& ctx, int slot, bool puts) {
  if (puts) {
    __syncthreads();
    if (threadIdx.x == 0) quiet_puts();
  }
  return last_block_on(&ll_control(ctx, ctx.rank)->block_counter[slot],
                       puts ? BlockFence::kSystem  // a proxy may read what they staged
                            : BlockFence::kGpu,
                       /*reads_blocks=*/true);
}

// Flags of every peer in one round of loads: each lane of the calling warp loads its own
// peer's flag (one acquire load per lane, side by side), not one thread all of them: an
// acquire load holds back the loads after it, so R flags from one thread cost R memory
// latencies.

// Byte offset of a flag inside LLControl: the same flag of PE r is at ll_control(r) + offset.
__device__ __forceinline__ size_t control_offset(const LLControl* control, const uint64_t* flag) {
  return reinterpret_cast<const char*>(flag) - reinterpret_cast<const char*>(control);
}

// The whole warp: the rank check, then flags[PE of s] >= want for every peer s (lane s,
// strided); the expected rank and the flags are loaded in one round. Flags are indexed by PE
// (as the normal mode's: a PE's next call may have another group).
__device__ inline void warp_wait_peers(const PeerContext& ctx, const uint64_t* flags,
                                       uint64_t want, const char* op, const char* what) {
  const int lane = threadIdx.x & 31;
  const int expected = *ctx.expected_rank;
  uint64_t first = want;  // the first load of each lane's flag, issued before the rank check
  if (lane < ctx.num_ranks) first = load_acquire(flags + pe_of(ctx, lane));
  if (lane == 0 && expected != ctx.rank) check_rank(ctx, op);
  if (first < want) wait_flag(ctx, flags + pe_of(ctx, lane), want, op, what, lane);
  for (int s = lane + 32; s < ctx.num_ranks; s += 32)
    wait_flag(ctx, flags + pe_of(ctx, s), want, op, what, s);
  __syncwarp();
}

// The whole warp of a send kernel: the call number n (the op's count + 1), after checking the
// rank and that every destination has consumed call n - 2 (same parity). The count, the
// expected rank and both parities' consumed flags are loaded in one round (the parity is not
// known before the count).
__device__ inline uint64_t warp_enter_send(const PeerContext& ctx, int op, const char* name) {
  const int lane = threadIdx.x & 31, R = ctx.num_ranks;
  LLControl* mine = ll_control(ctx, ctx.rank);
  const uint64_t n = *reinterpret_cast<volatile uint64_t*>(&mine->calls[op]) + 1;
  const int expected = *ctx.expected_rank;
  const bool both = 2 * R <= 32;  // lane p * R + d holds parity p's flag of d
  uint64_t guess = 0;
  if (both && lane < 2 * R)
    guess = load_acquire(&mine->consumed[op][lane / R][pe_of(ctx, lane % R)]);
  if (lane == 0 && expected != ctx.rank) check_rank(ctx, name);
  if (n <= 2) return n;
  const uint64_t want = n - 2;
  const int parity = int(n & 1);
  const uint64_t mine_now = __shfl_sync(0xffffffffu, guess, both ? (parity * R + lane) & 31 : 0);
  for (int d = lane; d < R; d += 32)
    if (!both || d != lane || mine_now < want)
      wait_flag(ctx, &mine->consumed[op][parity][pe_of(ctx, d)], want, name,
                "receive of call n-2 finished", d);
  __syncwarp();
  return n;
}

// The whole warp: lane r of it raises `flag` (a flag of this PE's LLControl, named by its
// address there) to n at rank r of the group, with release semantics; all peers side by side.
// every_pe: at every PE of the job instead (consumed: a sender's next call of this parity
// may have another group, which must see its new destinations' last receive). A PE on another
// node gets an NVSHMEM signal (after the puts this PE has completed).
template <bool kPuts>
__device__ inline void warp_signal_peers(const PeerContext& ctx, const uint64_t* flag, uint64_t n,
                                         bool every_pe = false) {
  const size_t offset = control_offset(ll_control(ctx, ctx.rank), flag);
  const int count = every_pe ? ctx.num_pes : ctx.num_ranks;
  for (int i = threadIdx.x & 31; i < count; i += 32) {
    const int pe = every_pe ? i : pe_of(ctx, i);
    char* control = static_cast<char*>(ctx.peers[pe]);
    if (control != nullptr)
      store_release(reinterpret_cast<uint64_t*>(control + offset), n);
    else if (kPuts)
      signal_pe(pe, const_cast<uint64_t*>(flag), n);
  }
}

// The whole warp (one warp of block 0 of every low-latency kernel, any time): raises, at every
// PE, consumed[op] for the receive that a kernel before this one ran (consumed_pending):
// complete now, as every kernel before this one. A receive so ends with no count of its
// blocks and no fence; a sender waits for the flag only two calls later.
template <bool kPuts>
__device__ inline void warp_raise_consumed(const PeerContext& ctx) {
  LLControl* mine = ll_control(ctx, ctx.rank);
  volatile uint64_t* pending = mine->consumed_pending;
  const uint64_t done[kLLOps] = {pending[kOpDispatch], pending[kOpCombine]};
  __syncwarp();  // every lane has loaded them before lane 0 clears them
  for (int op = 0; op < kLLOps; ++op) {
    if (done[op] == 0) continue;
    warp_signal_peers<kPuts>(ctx, &mine->consumed[op][done[op] & 1][pe_of(ctx, ctx.rank)],
                             done[op], /*every_pe=*/true);
    if ((threadIdx.x & 31) == 0) pending[op] = 0;
  }
}

// This kernel's receive of call n of `op`, for the next kernel to raise (the thread that ran
// warp_raise_consumed in this kernel: program order keeps its clearing before this).
__device__ __forceinline__ void leave_consumed(const PeerContext& ctx, int op, uint64_t n) {
  reinterpret_cast<volatile uint64_t*>(ll_control(ctx, ctx.rank)->consumed_pending)[op] = n;
}

// The entry of a split call's receive kernel (its send's kernel has completed: kernel order):
// returns the call number of `op` and sets *fresh to whether its send found its parity's last
// shape (`fresh_words`: LLControl's dispatch_fresh or combine_fresh); block 0's last warp
// raises what the kernels before left pending and leaves this receive's consumed flags for
// the next kernel.
template <bool kPuts>
__device__ __forceinline__ uint64_t enter_split_receive(const PeerContext& ctx,
                                                        const int32_t* call,
                                                        const uint64_t* fresh_words, int op,
                                                        bool* fresh) {
  const uint64_t n = read_call(call);
  *fresh = reinterpret_cast<const volatile uint64_t*>(fresh_words)[n & 1] != 0;
  if (blockIdx.x == 0 && threadIdx.x >= kLLThreads - 32) {
    warp_raise_consumed<kPuts>(ctx);
    if (threadIdx.x == kLLThreads - 32) leave_consumed(ctx, op, n);
  }
  return n;
}

// One thread of each block of a send, once the block has read the call counter and the last
// calls' shapes (past a barrier after warp 0's loads): counts the block in and returns
// whether it was the last; that block may then overwrite them with the call's bookkeeping
// (every block has read them), and resets the counter (the next kernel counts once this one
// is complete). Called where the thread's warp has time to wait for the count: no block
// counts or waits at its end.
__device__ __forceinline__ bool counted_last(const PeerContext& ctx, int slot) {
  unsigned* counter = &ll_control(ctx, ctx.rank)->block_counter[slot];
  if (atomicAdd(counter, 1u) != gridDim.x - 1) return false;
  *counter = 0;
  return true;
}

// Exclusive prefix sum of data[0, n) in place, data[n] = total; data is shared memory with
// n + 1 entries. Thread `tid` of `threads` (whole warps, meeting at named barrier `barrier`;
// by default the whole block) call it.
__device__ inline void block_exclusive_scan(int* data, int n, int tid = -1, int threads = 0,
                                            int barrier = 0) {
  __shared__ int warp_sums[kWarps];
  if (tid < 0) {
    tid = threadIdx.x;
    threads = blockDim.x;
  }
  const int lane = tid & 31, warp = tid >> 5, warps = threads / 32;
  const int per = (n + threads - 1) / threads;
  const int begin = min(n, tid * per), end = min(n, begin + per);
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += data[i];
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  group_sync(barrier, threads);
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
  }
  group_sync(barrier, threads);
  int run = incl - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = run;
    run += v;
  }
  if (tid == threads - 1) data[n] = run;
  group_sync(barrier, threads);
}

// dst[0, n) = src[0, n) and, if src2 is given, dst2[0, n) = src2[0, n) (shared memory <-
// global), all threads of the block; each thread loads kBatch values of each before storing
// any (the stores might alias the loads as far as the compiler knows, which would make every
// load wait for the one before).
// `thread` of `threads` taking part (the whole block by default).
__device__ __forceinline__ void stage_ints(int* dst, const int32_t* src, int n,
                                           int* dst2 = nullptr, const int32_t* src2 = nullptr,
                                           int thread = -1, int threads = -1) {
  constexpr int kBatch = 4;
  if (thread < 0) {
    thread = threadIdx.x;
    threads = blockDim.x;
  }
  for (int base = thread; base < n; base += kBatch * threads) {
    int v[kBatch], w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * threads;
      v[b] = i < n ? __ldg(src + i) : 0;
      w[b] = i < n && src2 != nullptr ? __ldg(src2 + i) : 0;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * threads;
      if (i < n) dst[i] = v[b];
      if (i < n && src2 != nullptr) dst2[i] = w[b];
    }
  }
}

// ----------------------------------------------------------------------------- dispatch send

// Quantises token t's row (8 threads per 128-channel block, 16 channels each) into the
// record's payload staged in shared memory (e4m3 data, then the scales); `thread` of `threads`
// (the token warps of a group) take part, with the loads of kRounds rounds in flight before
// any store (fp8.cuh).
template <typename T>
__device__ void quantize_to_stage(const LLDispatchSendArgs& a, int t, char* stage, int thread,
                                  int threads) {
  constexpr int kRounds = sizeof(T) == 2 ? 2 : 1;  // float rows: one round (registers)
  const int H = a.hidden, chunks = H / 16;
  const T* row = static_cast<const T*>(a.x) + size_t(t) * H;
  constexpr int kPer = 16 / sizeof(T);  // elements per int4
  for (int c0 = thread; c0 - thread < chunks; c0 += kRounds * threads) {
    int4 raw[kRounds][16 / kPer];  // the loads, kept raw: fewer registers than floats
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int c = c0 + u * threads;
      const int4* q = reinterpret_cast<const int4*>(row + size_t(c) * 16);
#pragma unroll
      for (int i = 0; i < 16 / kPer; ++i) raw[u][i] = c < chunks ? __ldg(q + i) : int4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
      const int c = c0 + u * threads;
      const bool active = c < chunks;  // uniform over each group of 8 lanes (chunks % 8 == 0)
      float v[16];
      unpack16<T>(raw[u], v);
      int4 packed;
      const float scale = quantize16(v, a.ue8m0, &packed);
      if (!active) continue;
      reinterpret_cast<int4*>(stage)[c] = packed;
      if ((c & 7) == 0) reinterpret_cast<float*>(stage + a.plan.scale_offset)[c / 8] = scale;
    }
  }
}

// Stages token t's raw row (row_bytes) in shared memory; `thread` of `threads` take part.
__device__ void copy_raw_to_stage(const LLDispatchSendArgs& a, int t, char* stage, int thread,
                                  int threads) {
  const char* row = static_cast<const char*>(a.x) + size_t(t) * a.row_bytes;
  if (((reinterpret_cast<uintptr_t>(row) | a.row_bytes) & 15) == 0) {
    constexpr int kBatch = 4;
    const int4* src = reinterpret_cast<const int4*>(row);
    int4* out = reinterpret_cast<int4*>(stage);
    const size_t n = a.row_bytes / 16;
    for (size_t i0 = thread; i0 < n; i0 += size_t(kBatch) * threads) {
      int4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const size_t i = i0 + size_t(b) * threads;
        if (i < n) v[b] = __ldg(src + i);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const size_t i = i0 + size_t(b) * threads;
        if (i < n) out[i] = v[b];
      }
    }
  } else {
    for (size_t i = thread; i < a.row_bytes; i += threads) stage[i] = row[i];
  }
}

// Every lane of the warp: waits until each line part this lane reads (need; v: a load of it
// at p, bytes [16 j, 16 j + 16) of its line, j = lane % 8) belongs to a line whose tag (lane
// 8k + 7's third word) shows `tag`; the eight lanes of a line not yet landed load their parts
// again together (one instruction: the line is read whole). Bounded as wait_flag.
__device__ inline void wait_line(const PeerContext& ctx, const void* p, uint4& v, bool need,
                                 uint32_t tag, const char* op, const char* what, int peer) {
  const int lane = threadIdx.x & 31, tag_lane = lane | (kLineLanes - 1);
  uint64_t start = 0;
  while (true) {
    const bool line_in = __shfl_sync(0xffffffffu, !need || v.z == tag, tag_lane);
    if (__all_sync(0xffffffffu, line_in)) return;
    if (start == 0) start = global_timer_ns();
    if (line_in) continue;
    if (global_timer_ns() - start > ctx.timeout_ns) {
      if (lane == tag_lane) report_timeout(ctx, op, what, peer, tag, v.z);
      trap_after_report();
    }
    v = load_line_part(p);
  }
}

// The staged payload of one record as tagged lines (kLLLinePayload bytes and the call's tag
// each) into the record at each destination: `dst` (num_dst of them), or where `every` is
// set, record `record` at every rank of the group (a call whose shape differs from its
// parity's last, so that later calls of this shape find lines of this shape there). `thread`
// of `threads` (whole warps): a line's eight parts go out from eight lanes of one warp in one
// instruction.
__device__ void store_staged_lines(const LLDispatchSendArgs& a, const char* stage, uint32_t tag,
                                   char* const* dst, int num_dst, bool every, size_t record,
                                   int thread, int threads) {
  const int parts = int(a.plan.record_lines) * kLineLanes;
  for (int i = thread; i < parts; i += threads) {
    const int line = i / kLineLanes, part = i % kLineLanes;
    const uint64_t* src =
        reinterpret_cast<const uint64_t*>(stage + kLLLinePayload * size_t(line) + 16 * part);
    const uint64_t lo = src[0], hi = part == kLineLanes - 1 ? uint64_t(tag) : src[1];
    const size_t off = kLLLineBytes * size_t(line) + 16 * part;
    if (every) {
      for (int r = 0; r < a.ctx.num_ranks; ++r)
        store_line_part(static_cast<char*>(a.ctx.peers[pe_of(a.ctx, r)]) + record + off, lo, hi);
    } else {
      for (int d = 0; d < num_dst; ++d)
        if (dst[d] != nullptr) store_line_part(dst[d] + off, lo, hi);
    }
  }
}

// Experts whose pairs block b numbers: e = b + j * grid.
__device__ __forceinline__ int block_experts(int num_experts) {
  return num_experts > int(blockIdx.x) ? (num_experts - 1 - int(blockIdx.x)) / int(gridDim.x) + 1
                                       : 0;
}

// The slot warps' first step, before the call's region is known: the pairs' ids (and, cached,
// the handle's slots) into shared memory, and the two per-expert counts of block_expert_slots
// zeroed. smem: ll_dispatch_send_smem() bytes.
__device__ void stage_pair_ids(const LLDispatchSendArgs& a, int* smem, int thread) {
  const int n_pairs = a.num_tokens * a.num_topk;
  stage_ints(smem, a.topk_idx, n_pairs, smem + n_pairs, a.cached ? a.slots_in : nullptr, thread,
             kSlotThreads);
  int* counts = smem + n_pairs * (a.cached ? 2 : 1);
  for (int i = thread; i < 2 * a.num_experts; i += kSlotThreads) counts[i] = 0;
}

// The slots, by the slot warps (`warp` of kSlotWarps, ids staged by stage_pair_ids and a
// barrier since). A pair's slot is its rank among its expert's pairs in pair order (cached:
// the handle's slot). Every block counts all pairs per expert in shared memory (a few
// shared atomics a thread), then writes the counts of its experts (e = block + j * grid) at
// their ranks (block 0 also the pairs past max_tokens, the call's dropped count), and numbers
// its own range of pairs in order (one warp, 32 pairs a step, each expert's pairs before the
// range counted):
// send_slot and the pair headers (me, token, k) -> (call n, local expert, slot). The work per
// block shrinks with the grid on both sides, so few blocks number as fast as many (dealing
// whole experts to blocks, 16 CTAs took 15 µs against 3 at one per SM). Pairs with an
// out-of-range id are left to the token pass (send_slot -1).
template <bool kPuts>
__device__ void block_expert_slots(const LLDispatchSendArgs& a, uint64_t n, size_t words,
                                   int* smem, int warp) {
  const PeerContext& ctx = a.ctx;
  const int E = a.num_experts, K = a.num_topk, M = a.max_tokens, n_pairs = a.num_tokens * K;
  const int R = ctx.num_ranks, L = E / R, me = ctx.rank;
  const int lane = threadIdx.x & 31, thread = warp * 32 + lane;
  const int* ids = smem;               // [T*K]
  const int* given = smem + n_pairs;   // [T*K], cached only
  int* total = smem + n_pairs * (a.cached ? 2 : 1);  // [E]: every pair
  int* before = total + E;             // [E]: the pairs before this block's range
  const int per_block = (n_pairs + int(gridDim.x) - 1) / int(gridDim.x);
  const int range_begin = min(n_pairs, int(blockIdx.x) * per_block);
  const int range_end = min(n_pairs, range_begin + per_block);
  auto expert_of = [&](int p) {  // -1: numbered by no one here (cached: no slot to keep)
    const int v = ids[p];
    if (v < 0 || v >= E || (a.cached && (given[p] < 0 || given[p] >= M))) return -1;
    return v;
  };
  for (int p = thread; p < n_pairs; p += kSlotThreads) {
    const int e = expert_of(p);
    if (e < 0) continue;
    atomicAdd(&total[e], 1);
    if (p < range_begin) atomicAdd(&before[e], 1);
  }
  group_sync(kSlotBarrier, kSlotThreads);

  // a rank on another node: the headers go into this PE's own block [me], which the last
  // block puts there whole (the receiver keeps the entries naming its own experts)
  for (int j = thread; j < block_experts(E); j += kSlotThreads) {
    const int e = int(blockIdx.x) + j * int(gridDim.x), r = e / L, l = e % L;
    const int seen = total[e];
    const size_t count_at = words + a.plan.counts + sizeof(uint64_t) * size_t(me * L + l);
    const uint64_t count = uint64_t(uint32_t(n)) << 32 | uint32_t(min(seen, M));
    if (off_node<kPuts>(ctx, r)) put_u64(ctx, pe_of(ctx, r), count_at, count);
    else store_relaxed(reinterpret_cast<uint64_t*>(ll_base(ctx, r) + count_at), count);
  }
  // the pairs past max_tokens, from block 0's counts (every block has all of them)
  if (blockIdx.x == 0 && warp == 0) {
    int over = 0;
    for (int e = lane; e < E && !a.cached; e += 32) over += max(0, total[e] - M);
    for (int d = 16; d > 0; d >>= 1) over += __shfl_xor_sync(0xffffffffu, over, d);
    if (lane == 0) *a.num_dropped = over;
  }
  if (warp != 0) return;
  const uint64_t tag = uint64_t(uint32_t(n)) << 32;
  const unsigned below = (1u << lane) - 1u;
  // this PE's block [me] of the headers, the same offset at every rank
  const size_t block_at = words + a.plan.headers + sizeof(uint64_t) * size_t(me) * M * K;
  for (int base = range_begin; base < range_end; base += 32) {
    const int p = base + lane;  // token * K + k
    const int e = p < range_end ? expert_of(p) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    uint32_t position = kNoPosition;  // no expert, or dropped at the source (slot >= M)
    if (e >= 0) {
      const int s = a.cached ? given[p] : before[e] + __popc(peers & below);
      const bool kept = s < M;
      a.send_slot[p] = kept ? s : -1;
      if (kept) position = uint32_t(e * M + s);
    }
    // Every rank reads the K headers of every record of every source, so each header goes to
    // every rank of this node (those on other nodes get this PE's whole block [me], a put),
    // a pair with no expert included: no header read is older than the call. (An older one
    // carries an older number, but where an earlier call of another shape had its counts or
    // records, stale bytes can show this call's number: two counts equal to it.)
    if (p < range_end)
      for (int d = 0; d < R; ++d)
        if (!off_node<kPuts>(ctx, d))
          store_relaxed(reinterpret_cast<uint64_t*>(ll_base(ctx, d) + block_at) + p,
                        tag | position);
    __syncwarp();  // every lane has read before[] for this step
    if (e >= 0 && !a.cached && lane == __ffs(peers) - 1) before[e] += __popc(peers);
    __syncwarp();
  }
}

// Word j of the dispatch's shape ({M << 32 | T, R << 32 | K, E << 32 | record stride}): where
// its words and records lie and which of them a call may write (LLControl::dispatch_words).
__device__ __forceinline__ uint64_t dispatch_shape(int M, int T, int R, int K, int E,
                                                   size_t stride, int j) {
  return j == 0   ? uint64_t(uint32_t(M)) << 32 | uint32_t(T)
         : j == 1 ? uint64_t(uint32_t(R)) << 32 | uint32_t(K)
                  : uint64_t(uint32_t(E)) << 32 | uint32_t(stride);
}

// This PE's bookkeeping of call n, once every block of its send has read the call counter
// (one thread of the block that started last): the call's shape and freshness for its
// parity's next send and for a split receive, the call number.
__device__ void finish_dispatch_send(const LLDispatchSendArgs& a, uint64_t n, bool fresh) {
  LLControl* mine = ll_control(a.ctx, a.ctx.rank);
  for (int j = 0; j < 3; ++j)  // read by this PE's next send of this parity
    mine->dispatch_words[n & 1][j] = dispatch_shape(a.max_tokens, a.num_tokens, a.ctx.num_ranks,
                                                    a.num_topk, a.num_experts,
                                                    a.plan.record_stride, j);
  mine->dispatch_fresh[n & 1] = fresh ? 1 : 0;
  *reinterpret_cast<volatile uint64_t*>(&mine->calls[kOpDispatch]) = n;
}

// The token warps: every block sends whole tokens, each row once per destination rank (not
// once per expert: with R ranks and top-K experts that is up to K/R times fewer bytes), as
// tagged lines; the slot warps meanwhile number this block's range of pairs
// (block_expert_slots): the two do not wait for each other, nor does any block for another.
// Returns the call number (every thread) and, in *fresh, whether the receive may read the
// call's lines as they land (a call of its parity's last shape, on one node): then no arrival
// is raised. smem: ll_dispatch_send_smem() bytes, the records' stages from a.stage_offset.
// defer: a fresh call leaves its closing to the receive of the same kernel (its last block
// calls finish_dispatch_send), so that no block fences or counts between its two halves.
template <bool kPuts>
__device__ uint64_t dispatch_send(const LLDispatchSendArgs& a, int* smem, bool* fresh,
                                  bool defer = false) {
  const PeerContext& ctx = a.ctx;
  const int E = a.num_experts, T = a.num_tokens, K = a.num_topk, M = a.max_tokens;
  const int R = ctx.num_ranks, L = E / R, me = ctx.rank;
  __shared__ uint64_t call_s;
  __shared__ bool same_s, fresh_s;
  // per group of token warps (below): its token's destination records and far ranks
  __shared__ int num_dst[kTokenWarps], num_far[kTokenWarps];
  __shared__ char* dst[kTokenWarps][kLLMaxTopk];
  __shared__ int far[kTokenWarps][kLLMaxTopk];  // destination ranks on another node: by puts
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool token_warp = warp < kTokenWarps;
  LLControl* mine = ll_control(ctx, me);
  profile_mark(ctx, kProfLLDispatchSend, kEnter);

  if (!token_warp) {  // ids into shared memory while warp 0 checks the region
    if (warp == kTokenWarps) profile_mark_lane0(ctx, kProfLLDispatchSlots, kEnter);
    if (blockIdx.x == 0 && warp == kWarps - 1) warp_raise_consumed<kPuts>(ctx);
    stage_pair_ids(a, smem, tid - kTokenThreads);
  } else if (warp == 0) {
    // both parities' last shapes, loaded beside the wait (written by sends that have
    // completed: every kernel of ours starts after the one before it)
    const uint64_t last =
        lane < 6 ? *(reinterpret_cast<const volatile uint64_t*>(mine->dispatch_words) + lane) : 0;
    // The region of this parity at every destination must have been read (call n - 2).
    const uint64_t n = warp_enter_send(ctx, kOpDispatch, "low_latency_dispatch (send)");
    const int j = lane - 3 * int(n & 1);
    const bool same = j < 0 || j >= 3 ||
                      last == dispatch_shape(M, T, R, K, E, a.plan.record_stride, j);
    const bool all_same = __all_sync(0xffffffffu, same);
    if (lane == 0) {
      call_s = n;
      same_s = all_same;
      // lines read as they land only where they land whole (Transport::whole_lines)
      fresh_s = !kPuts && all_same && ctx.whole_lines;
    }
  }
  __syncthreads();
  profile_mark(ctx, kProfLLDispatchSend, kWaited);  // the region is free at every destination
  const uint64_t n = call_s;
  const bool is_fresh = fresh_s;
  *fresh = is_fresh;
  if (blockIdx.x == 0 && tid == 0) {
    a.call_out[0] = int32_t(uint32_t(n));
    a.call_out[1] = int32_t(uint32_t(n >> 32));
  }
  const LLSections at = sections_of(n, a.area_begin, a.area_end, a.plan);

  if (token_warp) {
    // The token warps split into `groups` groups that send one token each at a time, as many
    // as the block has tokens (up to one warp a token) and shared memory stages: with few
    // CTAs a block's tokens go side by side instead of one after another, each a chain of
    // dependent loads and barriers.
    const int per_block = (T + int(gridDim.x) - 1) / int(gridDim.x);
    int groups = 1;
    while (groups * 2 <= min(min(per_block, kTokenWarps), a.stage_groups)) groups *= 2;
    const int group_warps = kTokenWarps / groups, g = warp / group_warps, gw = warp % group_warps;
    const int group_threads = group_warps * 32, thread = tid - g * group_threads;
    char* const* my_dst = dst[g];
    char* stage = reinterpret_cast<char*>(smem) + a.stage_offset + size_t(g) * a.stage_bytes;
    // a call of another shape writes every record at every rank (none is on another node)
    const bool every = !kPuts && !same_s;
    for (int t = int(blockIdx.x) + g * int(gridDim.x); t < T; t += groups * int(gridDim.x)) {
      const size_t record =
          at.data + a.plan.records + (size_t(me) * M + t) * a.plan.record_stride;
      if (gw == 0) {  // the distinct destination ranks of token t
        int r = -1;
        if (lane < K) {
          const int p = t * K + lane, e = a.topk_idx[p];
          const bool sent = e >= 0 && e < E && (!a.cached || (a.slots_in[p] >= 0 &&
                                                              a.slots_in[p] < M));
          if (sent) r = e / L;
          else a.send_slot[p] = -1;  // no expert warp finds this pair
        }
        const unsigned same = __match_any_sync(0xffffffffu, r);
        const bool leader = r >= 0 && lane == __ffs(same) - 1;
        // a rank on another node gets the record from this PE's own record (me, t), by a put
        const bool put = leader && off_node<kPuts>(ctx, r);
        const unsigned stores = __ballot_sync(0xffffffffu, leader && !put);
        const unsigned puts = __ballot_sync(0xffffffffu, put);
        const bool own_stored = __ballot_sync(0xffffffffu, leader && r == me) != 0;
        const unsigned below = (1u << lane) - 1u;
        if (leader && !put) dst[g][__popc(stores & below)] = ll_base(ctx, r) + record;
        if (put) far[g][__popc(puts & below)] = r;
        if (lane == 0) {
          int n_dst = __popc(stores);
          if (puts != 0 && !own_stored) dst[g][n_dst++] = ll_base(ctx, me) + record;
          num_dst[g] = n_dst;
          num_far[g] = __popc(puts);
        }
      }
      // the payload's last line past the scales, zeroed (the staging writes never reach it)
      for (size_t i = a.plan.payload_bytes + thread; i < a.plan.record_lines * kLLLinePayload;
           i += group_threads)
        stage[i] = 0;
      if (a.use_fp8) {
        switch (a.x_type) {
          case LLElement::kBF16:
            quantize_to_stage<__nv_bfloat16>(a, t, stage, thread, group_threads);
            break;
          case LLElement::kF16: quantize_to_stage<__half>(a, t, stage, thread, group_threads); break;
          default: quantize_to_stage<float>(a, t, stage, thread, group_threads); break;
        }
      } else {
        copy_raw_to_stage(a, t, stage, thread, group_threads);
      }
      group_sync(kTokenBarrier0 + g, group_threads);  // the stage and dst[g] are complete
      // this warp's puts of token t (lane j: far rank gw + j * group_warps), read before the
      // group's next token overwrites far[g]
      const int fi = gw + lane * group_warps;
      const int my_far = fi < num_far[g] ? far[g][fi] : -1;
      store_staged_lines(a, stage, uint32_t(n), my_dst, num_dst[g], every, record, thread,
                         group_threads);
      group_sync(kTokenBarrier0 + g, group_threads);  // the stage and dst[g] are reused next
      unsigned far_lanes = __ballot_sync(0xffffffffu, my_far >= 0);
      if (far_lanes != 0) {  // the record is complete in this PE's own copy: put it
        for (; far_lanes != 0; far_lanes &= far_lanes - 1)
          put_own_warp(ctx, __shfl_sync(0xffffffffu, my_far, __ffs(far_lanes) - 1), record,
                       a.plan.record_stride);
      }
    }
  } else {
    if (warp == kTokenWarps) profile_mark_lane0(ctx, kProfLLDispatchSlots, kWaited);  // staged
    block_expert_slots<kPuts>(a, n, at.words, smem, warp - kTokenWarps);
    if (warp == kTokenWarps) {
      profile_mark_lane0(ctx, kProfLLDispatchSlots, kFirstEnd);
      profile_mark_lane0(ctx, kProfLLDispatchSlots, kLastEnd);
    }
    // this PE's bookkeeping (the slot warps finish before the token warps)
    if (tid == kLLThreads - 32 && counted_last(ctx, kCounterDispatchStart))
      finish_dispatch_send(a, n, is_fresh);
  }

  // ---- the last block raises arrived[me] at every destination, where the receive waits for
  // it (the blocks' fences: its release carries their stores), unless the receive reads the
  // lines as they land (fresh)
  if (is_fresh) {
    if (!defer) allow_next_kernel();
    profile_end(ctx, kProfLLDispatchSend);
    return n;
  }
  const bool last = ll_last_block(ctx, kCounterDispatchSend, kPuts);
  if (kPuts && last) {
    // this PE's pair headers, staged in its own block [me], to every rank on another node
    const size_t headers = at.words + a.plan.headers + sizeof(uint64_t) * size_t(me) * M * K;
    for (int d = warp; d < R; d += kWarps)
      if (off_node<kPuts>(ctx, d))
        put_own_warp(ctx, d, headers, sizeof(uint64_t) * size_t(T) * K);
    __syncthreads();
    if (tid == 0) quiet_puts();
    __syncthreads();
  }
  if (last && warp == 0)
    warp_signal_peers<kPuts>(ctx, &mine->arrived[kOpDispatch][n & 1][pe_of(ctx, me)], n);
  profile_end(ctx, kProfLLDispatchSend);
  return n;
}

// ----------------------------------------------------------------------------- dispatch receive

// Largest number of blocks of lines a lane holds parts of for one unit of the dispatch receive.
constexpr int kReceiveVecs = 4;

// One unit of the dispatch receive, in registers: `vecs` blocks of kBlockLines lines of
// record (s, t) (lane i: part i % 8 of line i / 8 of each block) and the record's pair headers
// (lane k: pair k's).
struct ReceiveUnit {
  uint64_t header;
  uint4 parts[kReceiveVecs];
};

// Sources in every expert's block in the order me, me + 1, ..., me - 1 (position q of source
// (me + q) % R): this rank's own pairs start each block, at rows known without any count.
__device__ __forceinline__ int source_at(int q, int me, int R) {
  return q + me < R ? q + me : q + me - R;
}
__device__ __forceinline__ int position_of(int s, int me, int R) {
  return s >= me ? s - me : s - me + R;
}

// A block of lines (lane i holds part i % 8 of line i / 8) as the 16-byte chunks of its
// kBlockPayload payload bytes: lane q < kBlockPayload / 16 gets bytes [16 q, 16 q + 16), whose
// two 8-byte halves each lie in one part (a line's payload starts at a multiple of 8 bytes).
// Whole warp.
__device__ __forceinline__ int4 lines_to_chunk(const uint4& v, int lane) {
  int out[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int b = 16 * lane + 8 * h, line = b / int(kLLLinePayload), o = b % int(kLLLinePayload);
    const int src = (line * kLineLanes + o / 16) & 31;
    const int x = __shfl_sync(0xffffffffu, int(v.x), src);
    const int y = __shfl_sync(0xffffffffu, int(v.y), src);
    const int z = __shfl_sync(0xffffffffu, int(v.z), src);
    const int w = __shfl_sync(0xffffffffu, int(v.w), src);
    const bool upper = (o & 15) != 0;
    out[2 * h] = upper ? z : x;
    out[2 * h + 1] = upper ? w : y;
  }
  return int4{out[0], out[1], out[2], out[3]};
}

// The pairs' counts of call n, every source's for every local expert (tagged words, loaded
// again until they show the call), scanned into prefix (E + 1 ints of shared memory, over
// (local expert, source position), expert-major). Thread `thread` of `threads` (whole warps,
// meeting at named barrier `barrier`).
__device__ void receive_counts(const LLDispatchReceiveArgs& a, int* prefix, uint64_t n,
                               const LLSections& at, int thread, int threads, int barrier) {
  const PeerContext& ctx = a.ctx;
  const int E = a.num_experts, R = ctx.num_ranks, L = E / R, M = a.max_tokens, me = ctx.rank;
  const uint64_t* counts =
      reinterpret_cast<const uint64_t*>(ll_base(ctx, me) + at.words + a.plan.counts);
  for (int i = thread; i < E; i += threads) {
    const int l = i / R, s = source_at(i % R, me, R);
    const int c = int(wait_tagged(ctx, counts + s * L + l, uint32_t(n),
                                  "low_latency_dispatch (receive)", "pair counts", s));
    prefix[i] = min(max(c, 0), M);
  }
  group_sync(barrier, threads);
  block_exclusive_scan(prefix, E, thread, threads, barrier);
}

// prefix: E + 1 ints of shared memory (over (local expert, source position), expert-major).
//
// Work is dealt by record piece, not by output row: a warp loads a piece of record (s, t)
// (vecs blocks of kBlockLines lines per warp) and the record's K pair headers in one round,
// before the counts' scan is done, then stores the piece into the row of every pair of the
// record kept here. So the only loads after the scan are those of later units, and a record is
// read once however many of its pairs this rank holds. Where the call's shape is its parity's
// last (fresh), nothing waits for the sources' arrival: the counts, the headers and the record
// lines carry the call's number, and a line found with an older one is loaded again until its
// stores land. Records (kRecords): the piece is stored once, into the record's own row
// s * M + t, if any of its pairs was kept here; the handle's rows say which record each packed
// row reads (a template parameter: the stores' loop of the other layouts stays as it was).
// counted: prefix already holds the counts' scan (receive_counts, by the fused kernel's slot
// warps while its token warps send).
template <bool kPuts, bool kRecords>
__device__ void dispatch_receive(const LLDispatchReceiveArgs& a, int* prefix, uint64_t n,
                                 bool fresh, bool counted = false) {
  const PeerContext& ctx = a.ctx;
  const int E = a.num_experts, R = ctx.num_ranks, L = E / R, M = a.max_tokens, RM = R * M;
  const int T = a.num_tokens, K = a.num_topk, me = ctx.rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const LLSections at = sections_of(n, a.area_begin, a.area_end, a.plan);
  LLControl* mine = ll_control(ctx, me);
  const char* op = "low_latency_dispatch (receive)";
  profile_mark(ctx, kProfLLDispatchReceive, kEnter);
  if (!fresh && warp == 0)
    warp_wait_peers(ctx, mine->arrived[kOpDispatch][n & 1], n, op, "rows sent");
  if (!counted) __syncthreads();  // (else the caller's barrier stands here)
  profile_mark(ctx, kProfLLDispatchReceive, kWaited);
  const char* words = ll_base(ctx, me) + at.words;
  const char* data = ll_base(ctx, me) + at.data;
  const uint64_t* headers = reinterpret_cast<const uint64_t*>(words + a.plan.headers);
  const uint32_t tag = uint32_t(n);

  // Units: (record, piece) of every record, by source position. A piece is `vecs` blocks of
  // kBlockLines lines, as many as make one unit per warp of the grid (at most kReceiveVecs);
  // rows whose payload does not split into 16-byte chunks: whole records, byte by byte.
  // (the FP8 scales need only 4-byte alignment: where their rows are not 16-byte multiples
  // they are stored 4 bytes at a time)
  const bool vec = ((a.row_bytes | reinterpret_cast<uintptr_t>(a.out_x)) & 15) == 0 &&
                   ((a.scale_bytes | reinterpret_cast<uintptr_t>(a.out_scales)) & 3) == 0;
  const bool scales16 = ((a.scale_bytes | reinterpret_cast<uintptr_t>(a.out_scales)) & 15) == 0;
  const int record_lines = int(a.plan.record_lines);
  const int blocks = (record_lines + kBlockLines - 1) / kBlockLines;
  const int grid_warps = int(gridDim.x) * kWarps;
  const int records = R * T;
  const int vecs = vec ? min(kReceiveVecs, max(1, (records * blocks + grid_warps - 1) / grid_warps))
                       : 0;
  const int pieces = vec ? (blocks + vecs - 1) / vecs : 1;
  const int units = records * pieces;

  struct Unit {
    int s, t, piece;
  };
  auto unit_at = [&](int u) {
    const int record = u / pieces;
    return Unit{source_at(record / T, me, R), record % T, u % pieces};
  };
  auto record_of = [&](const Unit& w) {
    return data + a.plan.records + (size_t(w.s) * M + w.t) * a.plan.record_stride;
  };
  auto load_unit = [&](int u, ReceiveUnit& x) {
    const Unit w = unit_at(u);
    x.header = lane < K ? load_relaxed(headers + (size_t(w.s) * M + w.t) * K + lane) : 0;
    if (!vec) return;
    const char* rec = record_of(w);
#pragma unroll
    for (int j = 0; j < kReceiveVecs; ++j) {
      const int line = (w.piece * vecs + j) * kBlockLines + lane / kLineLanes;
      if (j < vecs && line < record_lines)
        x.parts[j] =
            load_line_part(rec + kLLLineBytes * size_t(line) + 16 * (lane % kLineLanes));
    }
  };

  // the first unit's loads go out before the counts' (a load's first use stalls the thread)
  int u = warp * int(gridDim.x) + int(blockIdx.x);  // units dealt block by block
  ReceiveUnit x;
  if (u < units) load_unit(u, x);
  if (!counted) receive_counts(a, prefix, n, at, tid, blockDim.x, 0);

  // expert_major: the groups packed one after another (group l's rows start at prefix[l * R]),
  // bounded by the output's rows; else block l of R*M rows holds group l
  const bool packed = a.num_rows > 0;
  const int used = packed ? min(prefix[E], a.num_rows) : 0;
  if (blockIdx.x == 0)
    for (int l = tid; l < L; l += blockDim.x) a.recv_count[l] = prefix[(l + 1) * R] - prefix[l * R];
  if (a.src_rank != nullptr) {
    const size_t rows = packed ? size_t(a.num_rows) : size_t(L) * RM;
    for (size_t row = size_t(blockIdx.x) * blockDim.x + tid; row < rows;
         row += size_t(gridDim.x) * blockDim.x) {
      const int l = int(row / RM), i = int(row % RM);
      if (packed ? int(row) >= used : i >= prefix[(l + 1) * R] - prefix[l * R]) {
        a.src_rank[row] = -1;
        a.src_token[row] = -1;
        a.src_k[row] = -1;
      }
    }
  }

  // lane k: the output row of pair k of record (s, .) if it was kept here in this call (a
  // header naming another rank's expert (a source on another node puts all its headers), or
  // one naming rows outside the source's count, is skipped); a header still showing an older
  // call is loaded again until this call's lands (every source writes every header)
  auto pair_row = [&](uint64_t header, const Unit& w) {
    if (lane >= K) return -1;
    if (uint32_t(header >> 32) != tag)
      header = wait_tagged(ctx, headers + (size_t(w.s) * M + w.t) * K + lane, tag, op,
                           "pair headers", w.s);
    const uint32_t pos = uint32_t(header);
    if (pos == kNoPosition) return -1;
    const uint32_t l = pos / uint32_t(M) - uint32_t(me * L);  // expert - first one here
    const int slot = int(pos % uint32_t(M));
    if (l >= uint32_t(L)) return -1;
    const int j = int(l) * R + position_of(w.s, me, R);
    if (slot >= prefix[j + 1] - prefix[j]) return -1;
    if (packed) return prefix[j] + slot < used ? prefix[j] + slot : -1;
    return int(l) * RM + (prefix[j] - prefix[l * R]) + slot;
  };
  // the handle: each row's source pair, and each source pair's row (for the combine: no
  // lookup of the owner's routing there); every record's unit with piece 0 writes its K entries
  auto mark_source = [&](int row, int s, int t) {
    if (a.src_rank == nullptr) return;
    if (row >= 0) {
      a.src_rank[row] = s;
      a.src_token[row] = t;
      a.src_k[row] = lane;
    }
    if (lane < K) a.pair_row[(size_t(s) * T + t) * K + lane] = row;
  };
  // Unaligned rows: whole records, line by line, each payload byte to its row. A loop of its
  // own: slow, and rare (rows of a size or address not a multiple of 16 bytes).
  if (!vec) {
    for (; u < units; u += grid_warps) {
      const Unit w = unit_at(u);
      const int row = pair_row(x.header, w);
      mark_source(row, w.s, w.t);
      const char* rec = record_of(w);
      for (unsigned left = __ballot_sync(0xffffffffu, row >= 0); left != 0; left &= left - 1) {
        const int dst = kRecords ? w.s * M + w.t : __shfl_sync(0xffffffffu, row, __ffs(left) - 1);
        for (int i0 = 0; i0 < record_lines * kLineLanes; i0 += 32) {  // warp-uniform
          const int line = (i0 + lane) / kLineLanes, part = lane % kLineLanes;
          const bool need = line < record_lines;
          const char* at_part = rec + kLLLineBytes * size_t(line) + 16 * part;
          uint4 v = need ? load_line_part(at_part) : uint4{};
          wait_line(ctx, at_part, v, need, tag, op, "rows sent", w.s);
          if (!need) continue;
          const uint32_t payload[4] = {v.x, v.y, v.z, v.w};
          const int bytes = part == kLineLanes - 1 ? 8 : 16;
          for (int b = 0; b < bytes; ++b) {
            const size_t off = kLLLinePayload * size_t(line) + 16 * part + b;
            const char byte = reinterpret_cast<const char*>(payload)[b];
            if (off < a.row_bytes)
              static_cast<char*>(a.out_x)[size_t(dst) * a.row_bytes + off] = byte;
            else if (off < a.plan.payload_bytes)
              reinterpret_cast<char*>(a.out_scales)[size_t(dst) * a.scale_bytes + off -
                                                    a.row_bytes] = byte;
          }
        }
        if (kRecords) break;  // the record once, whatever its pairs here
      }
      if (u + grid_warps < units) load_unit(u + grid_warps, x);
    }
  } else {
    for (; u < units; u += grid_warps) {
      const Unit w = unit_at(u);
      const int row = pair_row(x.header, w);
      if (w.piece == 0) mark_source(row, w.s, w.t);
      const unsigned pairs = __ballot_sync(0xffffffffu, row >= 0);
      if (pairs != 0) {
        // the piece's lines of this call (loaded again until they land), as 16-byte chunks
        const char* rec = record_of(w);
        int4 chunk[kReceiveVecs];
#pragma unroll
        for (int j = 0; j < kReceiveVecs; ++j) {
          if (j >= vecs) break;  // vecs: the same in every lane
          const int line = (w.piece * vecs + j) * kBlockLines + lane / kLineLanes;
          wait_line(ctx, rec + kLLLineBytes * size_t(line) + 16 * (lane % kLineLanes),
                    x.parts[j], line < record_lines, tag, op, "rows sent", w.s);
          chunk[j] = lines_to_chunk(x.parts[j], lane);
        }
        for (unsigned left = pairs; left != 0; left &= left - 1) {
          const int dst =
              kRecords ? w.s * M + w.t : __shfl_sync(0xffffffffu, row, __ffs(left) - 1);
#pragma unroll
          for (int j = 0; j < kReceiveVecs; ++j) {
            const size_t off = size_t(w.piece * vecs + j) * kBlockPayload + 16 * lane;
            if (j >= vecs || lane >= kBlockPayload / 16 || off >= a.plan.payload_bytes) continue;
            if (off < a.row_bytes) {
              *reinterpret_cast<int4*>(static_cast<char*>(a.out_x) + size_t(dst) * a.row_bytes +
                                       off) = chunk[j];
              continue;
            }
            const size_t at = off - a.row_bytes;
            char* scales = reinterpret_cast<char*>(a.out_scales) + size_t(dst) * a.scale_bytes;
            if (scales16) {
              *reinterpret_cast<int4*>(scales + at) = chunk[j];
            } else {
              const int v[4] = {chunk[j].x, chunk[j].y, chunk[j].z, chunk[j].w};
#pragma unroll
              for (int i = 0; i < 4; ++i)
                if (at + 4 * i < a.scale_bytes) reinterpret_cast<int*>(scales + at)[i] = v[i];
            }
          }
          if (kRecords) break;  // the record once, whatever its pairs here
        }
      }
      if (u + grid_warps < units) load_unit(u + grid_warps, x);
    }
  }

  // the sources learn that the region may be reused from the next kernel of ours
  // (warp_raise_consumed)
  allow_next_kernel();
  profile_end(ctx, kProfLLDispatchReceive);
}

// Every LL kernel is launched to start while the kernel before it drains (programmatic
// launch) and waits for it before reading anything: its inputs, the LL control state.
template <bool kPuts>
__global__ void __launch_bounds__(kLLThreads) ll_dispatch_send_kernel(LLDispatchSendArgs a) {
  extern __shared__ int smem[];
  wait_previous_kernel();
  bool fresh;
  dispatch_send<kPuts>(a, smem, &fresh);
}

template <bool kPuts, bool kRecords>
__global__ void __launch_bounds__(kLLThreads) ll_dispatch_receive_kernel(LLDispatchReceiveArgs a) {
  extern __shared__ int smem[];
  wait_previous_kernel();
  bool fresh;
  const uint64_t n = enter_split_receive<kPuts>(
      a.ctx, a.call, ll_control(a.ctx, a.ctx.rank)->dispatch_fresh, kOpDispatch, &fresh);
  dispatch_receive<kPuts, kRecords>(a, smem, n, fresh);
}

// Where the fused dispatch's receive keeps its counts' scan: past the send's shared memory
// (ll_dispatch_send_smem), which the send's token warps may still use while its slot warps
// scan.
__host__ __device__ inline size_t ll_fused_prefix_offset(const LLDispatchSendArgs& a) {
  return (a.stage_offset + a.stage_bytes * size_t(a.stage_groups) + 15) / 16 * 16;
}

// Send and receive in one launch of a resident grid (the receive half waits for this PE's own
// arrival, raised by the last block of the send half; LLPlacement). One launch gap less.
template <bool kPuts, bool kRecords>
__global__ void __launch_bounds__(kLLThreads) ll_dispatch_kernel(LLDispatchSendArgs send,
                                                                 LLDispatchReceiveArgs receive) {
  extern __shared__ int smem[];
  wait_previous_kernel();
  bool fresh;
  const uint64_t n = dispatch_send<kPuts>(send, smem, &fresh, /*defer=*/true);
  // (the thread that raised the consumed flags left pending in dispatch_send)
  if (blockIdx.x == 0 && threadIdx.x == kLLThreads - 32) leave_consumed(send.ctx, kOpDispatch, n);
  // the receive's scan past the send's shared memory (ll_fused_prefix_offset): in a fresh
  // call the slot warps, done numbering, wait for the counts and scan them there while the
  // token warps still send
  int* prefix = smem + ll_fused_prefix_offset(send) / sizeof(int);
  if (fresh && int(threadIdx.x) >= kTokenThreads)
    receive_counts(receive, prefix, n,
                   sections_of(n, receive.area_begin, receive.area_end, receive.plan),
                   int(threadIdx.x) - kTokenThreads, kSlotThreads, kSlotBarrier);
  __syncthreads();  // this block's records are written, the counts scanned
  dispatch_receive<kPuts, kRecords>(receive, prefix, n, fresh, fresh);
}

// ----------------------------------------------------------------------------- combine send

// Lane k < K of the calling warp: pair k of (owner s, token t) if this rank holds it: its row in
// y, from the handle's pair_row and bounded by the used rows (a handle from another call never
// sends us outside y), and its weight.
struct GateEntry {
  int row;  // -1: not a pair of this rank
  float weight;
};

__device__ __forceinline__ int pair_row_of(const LLCombineSendArgs& a, const int* count, int s,
                                           int t, int k) {
  if (k >= a.num_topk) return -1;
  const int row = __ldg(a.pair_row + (size_t(s) * a.num_tokens + t) * a.num_topk + k);
  const int RM = a.rows_per_expert;
  if (a.num_rows > 0) return row >= 0 && row < count[a.num_local_experts] ? row : -1;
  if (row < 0 || row >= a.num_local_experts * RM || row % RM >= count[row / RM]) return -1;
  return row;
}

// Lane k's weight of pair (s, t, k): this rank's own argument, or owner s's gate word in this
// PE's buffer (waited for until it carries call n's number; from an owner on another node,
// put as a whole with a signal, once that signal has come).
template <bool kPuts>
__device__ __forceinline__ float pair_weight(const LLCombineSendArgs& a, size_t words,
                                             uint64_t n, int s, int t, int k) {
  if (s == a.ctx.rank) return __ldg(a.weights + size_t(t) * a.num_topk + k);
  if (off_node<kPuts>(a.ctx, s))
    wait_flag(a.ctx, &ll_control(a.ctx, a.ctx.rank)->gates[pe_of(a.ctx, s)], n,
              "low_latency_combine (send)", "gate words of the owner", s);
  const uint64_t* gate_words =
      reinterpret_cast<const uint64_t*>(ll_base(a.ctx, a.ctx.rank) + words + a.plan.gate_words);
  const size_t word = (size_t(s) * a.max_tokens + t) * a.num_topk + k;
  return __uint_as_float(wait_tagged(a.ctx, gate_words + word, uint32_t(n),
                                     "low_latency_combine (send)", "gate words of the owner", s));
}

// The combine's send sums kLineRounds rounds of four lines a warp together (their loads in
// flight at once).
constexpr int kLineRounds = 2;
constexpr int kWarpLines = kBlockLines * kLineRounds;  // lines of a warp's round

// Whether rows of row_bytes bytes from base may be accessed 8 bytes at a time (a line's
// payload starts at multiples of 120 bytes: 8-byte aligned, not 16).
__device__ __forceinline__ bool rows_8_aligned(const void* base, size_t row_bytes) {
  return ((row_bytes | reinterpret_cast<uintptr_t>(base)) & 7) == 0;
}

// Bytes [at, at + 4 * kValues) of a row of row_bytes bytes as 32-bit values, those past the
// row zeros: 8-byte loads (kVec: at and row_bytes multiples of 8), else element by element.
template <typename T, bool kVec, int kValues>
__device__ __forceinline__ void load_row_bytes(const char* row, size_t at, size_t row_bytes,
                                               uint32_t (&v)[kValues]) {
  if constexpr (kVec) {
#pragma unroll
    for (int q = 0; q < kValues / 2; ++q) {
      const size_t c = at + 8 * q;
      const uint2 x = c < row_bytes ? __ldg(reinterpret_cast<const uint2*>(row + c)) : uint2{0, 0};
      v[2 * q] = x.x, v[2 * q + 1] = x.y;
    }
  } else {
    T* e = reinterpret_cast<T*>(v);
    const T* src = reinterpret_cast<const T*>(row);
    const size_t h0 = at / sizeof(T), H = row_bytes / sizeof(T);
#pragma unroll
    for (int j = 0; j < 4 * kValues / int(sizeof(T)); ++j)
      e[j] = h0 + j < H ? src[h0 + j] : from_float<T>(0.f);
  }
}

// The 32-bit values v as bytes [at, at + 4 * count) of a row of row_bytes bytes (count: 2 or 4),
// those past the row left out (load_row_bytes' inverse).
template <typename T, bool kVec>
__device__ __forceinline__ void store_row_bytes(char* row, size_t at, size_t row_bytes,
                                                const uint32_t (&v)[4], int count) {
  if constexpr (kVec) {
#pragma unroll
    for (int q = 0; q < 2; ++q)
      if (2 * q < count && at + 8 * q < row_bytes)
        *reinterpret_cast<uint2*>(row + at + 8 * q) = uint2{v[2 * q], v[2 * q + 1]};
  } else {
    const T* e = reinterpret_cast<const T*>(v);
    T* dst = reinterpret_cast<T*>(row);
    const size_t h0 = at / sizeof(T), H = row_bytes / sizeof(T);
#pragma unroll
    for (int j = 0; j < 16 / int(sizeof(T)); ++j)
      if (j < count * 4 / int(sizeof(T)) && h0 + j < H) dst[h0 + j] = e[j];
  }
}

// The partial row of one (owner, token), lines [l0, l1) of its record: the sum over this
// rank's pairs (ks: the set lanes of `mask`, ascending) of weight * y[row], float32 without
// FMA, rounded to T, stored as lines tagged `tag` into the record at `dst` (its line 0); a
// line's bytes past the row are zeros, and so is every line where mask is 0. Every lane of the
// warp calls it (the lines' stores and the shuffles need all of them).
template <typename T, bool kVec>
__device__ void partial_lines(const LLCombineSendArgs& a, unsigned mask, int my_row,
                              float my_weight, char* dst, int l0, int l1, uint32_t tag,
                              int lane) {
  constexpr int kBatch = 4;                     // rows loaded at once
  constexpr int kElems = 16 / int(sizeof(T));  // elements of a lane's 16 bytes
  const char* y = static_cast<const char*>(a.y);
  const size_t row_bytes = a.row_bytes;
  const int part = lane % kLineLanes;  // 16-byte part of the line
  const bool tag_lane = part == kLineLanes - 1;
  for (int lb = l0; lb < l1; lb += kWarpLines) {  // warp-uniform
    int line[kLineRounds];
    size_t at[kLineRounds];
    bool active[kLineRounds];
    float acc[kLineRounds][kElems];
#pragma unroll
    for (int i = 0; i < kLineRounds; ++i) {
      line[i] = lb + i * (32 / kLineLanes) + lane / kLineLanes;
      active[i] = line[i] < l1;
      at[i] = kLLLinePayload * size_t(line[i]) + 16 * part;
#pragma unroll
      for (int j = 0; j < kElems; ++j) acc[i][j] = 0.f;
    }
    for (unsigned m = mask; m != 0;) {
      uint32_t raw[kBatch][kLineRounds][4];
      float wt[kBatch];
      int got = 0;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int k = m != 0 ? __ffs(m) - 1 : 0;  // m is the same in every lane
        const int row = __shfl_sync(0xffffffffu, my_row, k);
        wt[b] = __shfl_sync(0xffffffffu, my_weight, k);
        if (m != 0) {
#pragma unroll
          for (int i = 0; i < kLineRounds; ++i) {
            // the tag lane's last 8 bytes are the tag's: zeros loaded past the row stand there
            if (active[i])
              load_row_bytes<T, kVec, 4>(y + size_t(row) * row_bytes, at[i],
                                         tag_lane ? min(row_bytes, at[i] + 8) : row_bytes,
                                         raw[b][i]);
          }
          m &= m - 1;
          ++got;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (b >= got) break;
#pragma unroll
        for (int i = 0; i < kLineRounds; ++i) {
          const T* e = reinterpret_cast<const T*>(raw[b][i]);
#pragma unroll
          for (int j = 0; j < kElems; ++j)
            acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(wt[b], to_float<T>(e[j])));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kLineRounds; ++i) {
      uint32_t out[4];
      T* o = reinterpret_cast<T*>(out);
      const size_t h0 = at[i] / sizeof(T);
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        o[j] = h0 + j < size_t(a.hidden) ? from_float<T>(acc[i][j]) : from_float<T>(0.f);
      if (tag_lane) out[2] = tag, out[3] = 0;
      // every lane of a line stores in this one instruction (the line travels whole)
      if (active[i])
        store_line_part(dst + kLLLineBytes * size_t(line[i]) + 16 * part,
                        uint64_t(out[0]) | uint64_t(out[1]) << 32,
                        uint64_t(out[2]) | uint64_t(out[3]) << 32);
    }
  }
}

// partial_lines with 8-byte loads where the rows allow them.
template <typename T>
__device__ __forceinline__ void partial_row(const LLCombineSendArgs& a, unsigned mask, int my_row,
                                            float my_weight, char* dst, int l0, int l1,
                                            uint32_t tag, int lane) {
  if (rows_8_aligned(a.y, a.row_bytes))
    partial_lines<T, true>(a, mask, my_row, my_weight, dst, l0, l1, tag, lane);
  else
    partial_lines<T, false>(a, mask, my_row, my_weight, dst, l0, l1, tag, lane);
}

// The tag of this PE's record at owner s (byte offset tag_at of the buffer).
template <bool kPuts>
__device__ __forceinline__ void write_tag(const PeerContext& ctx, int s, size_t tag_at,
                                          uint32_t value) {
  if (off_node<kPuts>(ctx, s)) put_u32(ctx, pe_of(ctx, s), tag_at, value);
  else store_relaxed_u32(reinterpret_cast<uint32_t*>(ll_base(ctx, s) + tag_at), value);
}

// Word i of the combine's words section's shape (LLControl::combine_words): where the last call
// of this parity had the same, its gate words and tags hold words of older calls only (numbers
// below n), else possibly another shape's bytes. Recomputed where used (kernel arguments): kept
// in registers across the send, it spilled.
__device__ __forceinline__ uint64_t combine_words_shape(const LLCombineSendArgs& a, int i) {
  return i == 0   ? uint64_t(uint32_t(a.max_tokens)) << 32 | uint32_t(a.num_tokens)
         : i == 1 ? uint64_t(uint32_t(a.ctx.num_ranks)) << 32 | uint32_t(a.num_topk)
                  : uint64_t(a.plan.record_stride);
}

// Returns the call number (every thread). smem: ll_combine_send_smem() bytes. Needs every
// block resident (LLPlacement): a peer's blocks wait for the gate words that this
// rank's first blocks write.
template <bool kPuts>
__device__ uint64_t combine_send(const LLCombineSendArgs& a, int* smem, bool* tagged_out) {
  const PeerContext& ctx = a.ctx;
  const int L = a.num_local_experts, RM = a.rows_per_expert, K = a.num_topk, T = a.num_tokens;
  const int R = ctx.num_ranks, me = ctx.rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* count = smem;  // [L]: used rows per local expert
  __shared__ uint64_t call_s;
  __shared__ bool fresh_s;  // the last call of this parity had this words section's shape
  LLControl* mine = ll_control(ctx, me);
  profile_mark(ctx, kProfLLCombineSend, kEnter);
  if (warp == 0) {  // the region must be free at every destination
    // both parities' shapes, loaded beside the wait (written by sends that have completed, as
    // the call counter: every kernel starts after the one before it)
    const uint64_t last =
        lane < 6 ? *(reinterpret_cast<const volatile uint64_t*>(mine->combine_words) + lane) : 0;
    const uint64_t n = warp_enter_send(ctx, kOpCombine, "low_latency_combine (send)");
    const int j = lane - 3 * int(n & 1);
    const bool same = j < 0 || j >= 3 || last == combine_words_shape(a, j);
    const bool all_same = __all_sync(0xffffffffu, same);
    if (lane == 0) {
      call_s = n;
      fresh_s = all_same;
    }
  } else {
    // (block 0's last warp: what the kernels before left pending, beside the counts' loads)
    if (blockIdx.x == 0 && warp == kWarps - 1) warp_raise_consumed<kPuts>(ctx);
    for (int l = tid - 32; l < L; l += blockDim.x - 32)
      count[l] = min(max(__ldg(a.recv_count + l), 0), RM);
  }
  __syncthreads();
  if (a.num_rows > 0) {  // expert_major: count[L] = the used rows, a prefix of y's
    if (warp == 0) {
      int sum = 0;
      for (int l = lane; l < L; l += 32) sum += count[l];
      for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      if (lane == 0) count[L] = min(sum, a.num_rows);
    }
    __syncthreads();
  }
  const uint64_t n = call_s;
  const bool fresh = fresh_s;
  // the owners read the partials as they land (no arrival): on one node, where lines land
  // whole (Transport::whole_lines)
  const bool tagged = fresh && !kPuts && ctx.whole_lines;
  *tagged_out = tagged;
  // this PE's bookkeeping, by the block counted last
  if (tid == kLLThreads - 32 && counted_last(ctx, kCounterCombineStart)) {
    volatile uint64_t* last = mine->combine_words[n & 1];
    for (int j = 0; j < 3; ++j)  // read by this PE's next call of this parity
      last[j] = combine_words_shape(a, j);
    reinterpret_cast<volatile uint64_t*>(mine->combine_fresh)[n & 1] = fresh ? 1 : 0;
    *reinterpret_cast<volatile uint64_t*>(&mine->calls[kOpCombine]) = n;
  }
  const LLSections at = sections_of(n, a.area_begin, a.area_end, a.plan);

  // This rank's weights, as tagged words, into every other rank's buffer (the first blocks'
  // threads, one 8-byte store each): the expert ranks read them locally, and a word carries
  // its call number, so no fence and no flag stand between the stores and their use. After a
  // call of another shape, block 0 stores them all and raises this PE's gates flag at each
  // rank, which waits for that instead (a stale word there might show n by chance).
  if (R > 1) {
    const int pairs = T * K, total = (R - 1) * pairs;
    const uint64_t tag = uint64_t(uint32_t(n)) << 32;
    const size_t mine_at =
        at.words + a.plan.gate_words + sizeof(uint64_t) * size_t(me) * a.max_tokens * K;
    if (kPuts && blockIdx.x == 0) {
      // ranks on another node: every word into this PE's own block [me], put whole, with a
      // signal after it (a put's words may land in any order)
      uint64_t* own = reinterpret_cast<uint64_t*>(ll_base(ctx, me) + mine_at);
      for (int p = tid; p < pairs; p += blockDim.x)
        store_relaxed(own + p, tag | __float_as_uint(__ldg(a.weights + p)));
      __syncthreads();
      for (int d = warp; d < R; d += kWarps)
        if (off_node<kPuts>(ctx, d))
          put_own_signal_warp(ctx, d, mine_at, sizeof(uint64_t) * size_t(pairs),
                              &mine->gates[pe_of(ctx, me)], n);
    }
    const int first = fresh ? int(blockIdx.x) * blockDim.x : blockIdx.x == 0 ? 0 : total;
    const int stride = fresh ? gridDim.x * blockDim.x : blockDim.x;
    for (int i = first + tid; i < total; i += stride) {
      const int r = (me + 1 + i / pairs) % R, p = i % pairs;
      if (off_node<kPuts>(ctx, r)) continue;
      store_relaxed(reinterpret_cast<uint64_t*>(ll_base(ctx, r) + mine_at) + p,
                    tag | __float_as_uint(__ldg(a.weights + p)));
    }
    if (!fresh) {
      // block 0 raises this PE's gates flag at each rank of its node once its words are
      // stored (the release carries every thread's stores), and every block waits for the
      // flags of the owners (those on another node signal after their put) before reading
      // a gate word
      if (blockIdx.x == 0) {
        __syncthreads();
        if (warp == 0) warp_signal_peers<false>(ctx, &mine->gates[pe_of(ctx, me)], n);
      }
      if (warp == 0)
        warp_wait_peers(ctx, mine->gates, n, "low_latency_combine (send)",
                        "gate words of the owner");
      __syncthreads();
    }
  }
  if (blockIdx.x == 0 && tid == 0) {
    a.call_out[0] = int32_t(uint32_t(n));
    a.call_out[1] = int32_t(uint32_t(n >> 32));
  }
  profile_mark(ctx, kProfLLCombineSend, kWaited);

  // One unit: a piece (lines [l0, l1)) of the partial row of one (owner, token), owners after
  // this rank first (their rows cross NVLink: sent first, they overlap the local ones) and this
  // rank last. Each warp takes a contiguous run of units (pieces of one token mostly: one
  // lookup); pieces are rounded up so that each warp has at most one unit where kPieceLines
  // allows (rounded down, 128 tokens of 14 KB made 3584 units for 2112 warps: two rounds one
  // after the other).
  const size_t warps = size_t(gridDim.x) * kWarps;
  const size_t rows = size_t(R) * T;
  const size_t lines = a.plan.record_lines;
  constexpr size_t kRound = kWarpLines;
  size_t piece = (lines * rows + warps * kRound - 1) / (warps * kRound) * kRound;
  piece = piece < kRound ? kRound : piece > kPieceLines ? kPieceLines : piece;
  const size_t pieces = (lines + piece - 1) / piece;
  const size_t units = rows * pieces, per_warp = (units + warps - 1) / warps;
  // runs dealt block by block (warp w of every block before warp w + 1 of any): every block
  // gets some of the owners' units that cross NVLink, not only the first blocks
  const size_t u_begin = (size_t(warp) * gridDim.x + blockIdx.x) * per_warp;
  const size_t u_end = min(units, u_begin + per_warp);
  // after a call of another shape (one node): a record of zeros where no pair is here, so that
  // every record line of this shape shows an older call's number to the next calls
  const bool zeros = !fresh && !kPuts;
  size_t current = ~size_t(0);
  GateEntry g{-1, 0.f};
  unsigned mask = 0;
  int s = me, t = 0;
  for (size_t u = u_begin; u < u_end; ++u) {
    const size_t token = u / pieces;
    if (token != current) {
      current = token;
      s = (me + 1 + int(token / T)) % R;
      t = int(token % T);
      g = GateEntry{pair_row_of(a, count, s, t, lane), 0.f};
      if (g.row >= 0) g.weight = pair_weight<kPuts>(a, at.words, n, s, t, lane);
      mask = __ballot_sync(0xffffffffu, g.row >= 0);
    }
    // the owner sums the records tagged with this call: this rank's tag says whether it sent
    // one (n) or holds no pair of (s, t) (n - 1), written every call where the owner reads the
    // partials as they land or after a call of another shape (so that no stale word there
    // shows n by chance), else only with a partial
    const size_t q = u % pieces;
    if (q == 0 && lane == 0 && (mask != 0 || !fresh || !kPuts))
      write_tag<kPuts>(ctx, s, at.words + a.plan.tags + sizeof(uint32_t) * (size_t(t) * R + me),
                       uint32_t(mask != 0 ? n : n - 1));
    if (mask == 0 && !zeros) continue;
    const int l0 = int(q * piece), l1 = int(min(lines, q * piece + piece));
    // an owner on another node: the piece is summed into this PE's staging row (s, t), then put
    const bool far = off_node<kPuts>(ctx, s);
    const size_t record = at.data + a.plan.records + (size_t(t) * R + me) * a.plan.record_stride;
    char* dst = far ? ll_base(ctx, me) + at.data + a.plan.staging +
                          (size_t(s) * a.max_tokens + t) * a.plan.record_stride
                    : ll_base(ctx, s) + record;
    const uint32_t line_tag = uint32_t(mask != 0 ? n : n - 1);
    switch (a.dtype) {
      case LLElement::kBF16:
        partial_row<__nv_bfloat16>(a, mask, g.row, g.weight, dst, l0, l1, line_tag, lane);
        break;
      case LLElement::kF16:
        partial_row<__half>(a, mask, g.row, g.weight, dst, l0, l1, line_tag, lane);
        break;
      default: partial_row<float>(a, mask, g.row, g.weight, dst, l0, l1, line_tag, lane); break;
    }
    if (far) {
      __syncwarp();
      put_warp(ctx, s, record + kLLLineBytes * size_t(l0), dst + kLLLineBytes * size_t(l0),
               kLLLineBytes * size_t(l1 - l0));
    }
  }

  // unless the owners read the lines as they land (tagged), the last block raises arrived[me]
  // where they wait for it (the blocks' fences: its release carries their stores)
  if (!tagged && ll_last_block(ctx, kCounterCombineSend, kPuts) && warp == 0)
    warp_signal_peers<kPuts>(ctx, &mine->arrived[kOpCombine][n & 1][pe_of(ctx, me)], n);
  profile_end(ctx, kProfLLCombineSend);
  return n;
}

// ----------------------------------------------------------------------------- combine receive

// The tag (token, r) of call n or of the call before it (rank r holds no pair of the token),
// loaded again until one of them lands; bounded as wait_flag.
__device__ inline uint32_t wait_combine_tag(const PeerContext& ctx, const uint32_t* p,
                                            uint32_t v, uint32_t now, int peer) {
  if (v == now || v == now - 1) return v;
  const uint64_t start = global_timer_ns();
  while ((v = load_relaxed_u32(p)) != now && v != now - 1) {
    if (global_timer_ns() - start > ctx.timeout_ns) {
      report_timeout(ctx, "low_latency_combine (receive)", "partial row tags", peer, now, v);
      trap_after_report();
    }
  }
  return v;
}

// out[t] = the partials of call n added in rank order in float32, rounded: rank r's where its
// tag (t, r) shows n. Each eight lanes of a warp take one line of the output (a line's payload
// of one token: 16 bytes a lane, 8 the last) in each of kRounds groups and load, kBatch ranks at
// a time, every group's tags and line parts in one round, the line before its tag is known
// (with few CTAs, beside a GEMM, the receive is bound by the loads a warp has in flight).
// tagged: the owner did not wait for the ranks' arrival, and every rank writes every tag
// (n - 1: it holds no pair of t), so a tag still showing an older call is loaded again until
// this call's lands, and so is a line whose tag lane does not show n (all eight lanes again:
// they load the line in one instruction); else every line of the call has arrived, and a tag
// other than n is an older call's.
template <typename T, bool kVec>
__device__ void combine_sum(const LLCombineReceiveArgs& a, const char* words, const char* data,
                            uint64_t n, bool tagged) {
  constexpr int kBatch = 2;   // ranks loaded at once
  constexpr int kRounds = 2;  // groups of kPerWarp lines a warp takes at once
  constexpr int kElems = 16 / int(sizeof(T));  // elements of a lane's 16 bytes
  constexpr int kPerWarp = 32 / kLineLanes;    // lines a warp takes in a group
  const int R = a.ctx.num_ranks, lane = threadIdx.x & 31;
  const int lines = int(a.plan.record_lines);
  const size_t warps = size_t(gridDim.x) * (blockDim.x / 32);
  const size_t units = size_t(a.num_tokens) * lines;
  char* out = static_cast<char*>(a.out);
  const size_t out_row = size_t(a.hidden) * sizeof(T);
  const char* records = data + a.plan.records;
  const uint32_t* tags = reinterpret_cast<const uint32_t*>(words + a.plan.tags);
  const uint32_t now = uint32_t(n);
  const int part = lane % kLineLanes;
  const bool tag_lane = part == kLineLanes - 1;
  const size_t first = (size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * kPerWarp;
  const size_t stride = warps * kPerWarp;  // between a warp's groups
  for (size_t u0 = first; u0 < units; u0 += kRounds * stride) {  // warp-uniform
    bool active[kRounds];
    int token[kRounds], line[kRounds];
    float acc[kRounds][kElems];
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const size_t u = u0 + i * stride + lane / kLineLanes;
      active[i] = u < units;
      token[i] = active[i] ? int(u / lines) : 0;
      line[i] = int(u % lines);
#pragma unroll
      for (int j = 0; j < kElems; ++j) acc[i][j] = 0.f;
    }
    auto line_at = [&](int i, int r) {
      return records + (size_t(token[i]) * R + r) * a.plan.record_stride +
             kLLLineBytes * size_t(line[i]) + 16 * part;
    };
    for (int r0 = 0; r0 < R; r0 += kBatch) {
      // every tag and every line part of the groups' ranks in one round (a line whose tag
      // says "no partial" is not used; one not yet landed is loaded again below)
      uint32_t tg[kRounds][kBatch];
      uint4 v[kRounds][kBatch];
#pragma unroll
      for (int i = 0; i < kRounds; ++i)
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          tg[i][b] = 0;
          if (r0 + b < R && active[i]) {
            tg[i][b] = load_relaxed_u32(tags + size_t(token[i]) * R + r0 + b);
            v[i][b] = load_line_part(line_at(i, r0 + b));
          }
        }
#pragma unroll
      for (int i = 0; i < kRounds; ++i)
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int r = r0 + b;
          if (r >= R) break;
          bool use = false;
          if (active[i]) {
            if (tagged)
              tg[i][b] = wait_combine_tag(a.ctx, tags + size_t(token[i]) * R + r, tg[i][b], now, r);
            use = tg[i][b] == now;
          }
          if (tagged)
            wait_line(a.ctx, line_at(i, r), v[i][b], use, now, "low_latency_combine (receive)",
                      "partial rows", r);
          if (!use) continue;
          const T* e = reinterpret_cast<const T*>(&v[i][b]);
#pragma unroll
          for (int j = 0; j < kElems; ++j)
            if (!tag_lane || j < kElems / 2) acc[i][j] = __fadd_rn(acc[i][j], to_float<T>(e[j]));
        }
    }
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      if (!active[i]) continue;
      uint32_t packed[4];
      T* o = reinterpret_cast<T*>(packed);
#pragma unroll
      for (int j = 0; j < kElems; ++j) o[j] = from_float<T>(acc[i][j]);
      store_row_bytes<T, kVec>(out + size_t(token[i]) * out_row,
                               kLLLinePayload * size_t(line[i]) + 16 * part, out_row, packed,
                               tag_lane ? 2 : 4);
    }
  }
}

// combine_sum with 8-byte stores where the output rows allow them.
template <typename T>
__device__ __forceinline__ void combine_out(const LLCombineReceiveArgs& a, const char* words,
                                            const char* data, uint64_t n, bool tagged) {
  if (rows_8_aligned(a.out, size_t(a.hidden) * sizeof(T)))
    combine_sum<T, true>(a, words, data, n, tagged);
  else
    combine_sum<T, false>(a, words, data, n, tagged);
}

template <bool kPuts>
__device__ void combine_receive(const LLCombineReceiveArgs& a, uint64_t n, bool tagged) {
  const PeerContext& ctx = a.ctx;
  const LLSections at = sections_of(n, a.area_begin, a.area_end, a.plan);
  LLControl* mine = ll_control(ctx, ctx.rank);
  profile_mark(ctx, kProfLLCombineReceive, kEnter);
  if (!tagged && threadIdx.x < 32)
    warp_wait_peers(ctx, mine->arrived[kOpCombine][n & 1], n, "low_latency_combine (receive)",
                    "partial rows sent back");
  __syncthreads();
  profile_mark(ctx, kProfLLCombineReceive, kWaited);
  const char* words = ll_base(ctx, ctx.rank) + at.words;
  const char* data = ll_base(ctx, ctx.rank) + at.data;
  switch (a.dtype) {
    case LLElement::kBF16: combine_out<__nv_bfloat16>(a, words, data, n, tagged); break;
    case LLElement::kF16: combine_out<__half>(a, words, data, n, tagged); break;
    default: combine_out<float>(a, words, data, n, tagged); break;
  }
  // the owners learn that the region may be reused from the next kernel of ours
  // (warp_raise_consumed)
  allow_next_kernel();
  profile_end(ctx, kProfLLCombineReceive);
}

// Both halves of a combine in one launch of a resident grid (see ll_dispatch_kernel).
template <bool kPuts>
__global__ void __launch_bounds__(kLLThreads) ll_combine_kernel(LLCombineSendArgs send,
                                                                LLCombineReceiveArgs receive) {
  extern __shared__ int smem[];
  wait_previous_kernel();
  bool tagged;
  const uint64_t n = combine_send<kPuts>(send, smem, &tagged);
  // (the thread that raised the consumed flags left pending in combine_send)
  if (blockIdx.x == 0 && threadIdx.x == kLLThreads - 32) leave_consumed(send.ctx, kOpCombine, n);
  combine_receive<kPuts>(receive, n, tagged);
}

// A split combine's halves as kernels of their own: the send on the few CTAs it takes beside
// the program's work, the sum on every SM on the program's stream once that work is done (on
// few CTAs a warp's dependent rounds of loads bound the sum: ~20 µs of 16 CTAs beside a GEMM).
template <bool kPuts>
__global__ void __launch_bounds__(kLLThreads) ll_combine_send_kernel(LLCombineSendArgs send) {
  extern __shared__ int smem[];
  wait_previous_kernel();
  bool tagged;
  combine_send<kPuts>(send, smem, &tagged);
  allow_next_kernel();
}

template <bool kPuts>
__global__ void __launch_bounds__(kLLThreads) ll_combine_receive_kernel(LLCombineReceiveArgs a) {
  wait_previous_kernel();
  bool fresh;
  const uint64_t n = enter_split_receive<kPuts>(
      a.ctx, a.call, ll_control(a.ctx, a.ctx.rank)->combine_fresh, kOpCombine, &fresh);
  combine_receive<kPuts>(a, n, fresh && !kPuts && a.ctx.whole_lines);
}

// Host-side launch facts, looked up once per kernel (and shared-memory size) rather than on
// every call: in a decode loop the handler's host time is on the critical path whenever the
// GPU would otherwise run ahead. Handlers may run on several threads, hence the lock.
std::mutex g_launch_facts_lock;

// Raises `kernel`'s dynamic shared-memory limit to at least `smem` (once per new maximum).
cudaError_t allow_shared_memory(const void* kernel, size_t smem) {
  static std::unordered_map<const void*, size_t> allowed;
  const size_t want = smem > 48 * 1024 ? smem : 48 * 1024;
  std::lock_guard<std::mutex> lock(g_launch_facts_lock);
  size_t& have = allowed[kernel];
  if (want <= have) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(want));
  if (status == cudaSuccess) have = want;
  return status;
}

// Blocks of a resident grid of `kernel`: `wanted`, capped at what the device holds at once
// (0 when it cannot tell). Call allow_shared_memory first.
int resident_grid(const void* kernel, size_t smem, int wanted) {
  static std::map<std::pair<const void*, size_t>, int> resident;  // blocks the device holds
  int most = 0;
  {
    std::lock_guard<std::mutex> lock(g_launch_facts_lock);
    auto found = resident.find({kernel, smem});
    if (found != resident.end()) {
      most = found->second;
    } else {
      int device = 0, sms = 0, per_sm = 0;
      if (cudaGetDevice(&device) != cudaSuccess ||
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kLLThreads, smem) !=
              cudaSuccess)
        return 0;
      most = per_sm * sms;
      resident[{kernel, smem}] = most;
    }
  }
  return wanted < most ? wanted : most;
}

// Blocks per cluster of a split call's kernel: two where the grid is even. It runs beside the
// program's work, whose GEMMs on H100 are kernels of CTA clusters placed within a GPC; blocks
// taken in pairs of a GPC leave more room for those than blocks placed one by one (the split
// combine beside the benchmark's GEMM: 126.3 -> 123.2 µs steady, the dispatch 0.5-1.5 µs;
// clusters of four gained no more; benchmarks/RESULTS.md).
unsigned ll_cluster(int grid, LLPlacement placement) {
  return placement == LLPlacement::kBesideWork && grid % 2 == 0 ? 2 : 1;
}

cudaError_t launch_fused(const void* kernel, int grid, size_t smem, void** args,
                         cudaStream_t stream, LLPlacement placement) {
  return launch_grid_after_previous(kernel, dim3(grid), dim3(kLLThreads), smem, stream, args,
                                    placement != LLPlacement::kAlone,
                                    ll_cluster(grid, placement));
}

}  // namespace

cudaError_t launch_ll_dispatch_send(const LLDispatchSendArgs& a, cudaStream_t stream) {
  // enough blocks for one token or one slot warp's expert each, at most num_blocks
  const int wanted = a.num_tokens > (a.num_experts + kSlotWarps - 1) / kSlotWarps
                         ? a.num_tokens
                         : (a.num_experts + kSlotWarps - 1) / kSlotWarps;
  const int grid = wanted < a.num_blocks ? wanted : a.num_blocks;
  const size_t smem = ll_dispatch_send_smem(a);
  auto kernel =
      a.ctx.spans_nodes ? ll_dispatch_send_kernel<true> : ll_dispatch_send_kernel<false>;
  const cudaError_t status = allow_shared_memory(reinterpret_cast<const void*>(kernel), smem);
  if (status != cudaSuccess) return status;
  return launch_after_previous(kernel, grid > 0 ? grid : 1, kLLThreads, smem, stream, a);
}

cudaError_t launch_ll_dispatch_receive(const LLDispatchReceiveArgs& a, cudaStream_t stream) {
  const size_t smem = sizeof(int) * (size_t(a.num_experts) + 1);
  auto kernel = a.ctx.spans_nodes
                    ? (a.records ? ll_dispatch_receive_kernel<true, true>
                                 : ll_dispatch_receive_kernel<true, false>)
                    : (a.records ? ll_dispatch_receive_kernel<false, true>
                                 : ll_dispatch_receive_kernel<false, false>);
  return launch_after_previous(kernel, a.num_blocks, kLLThreads, smem, stream, a);
}

cudaError_t launch_ll_dispatch(const LLDispatchSendArgs& send,
                               const LLDispatchReceiveArgs& receive, cudaStream_t stream,
                               LLPlacement placement) {
  // the send's, then the receive's prefix (ll_dispatch_kernel)
  const size_t smem =
      ll_fused_prefix_offset(send) + sizeof(int) * (size_t(receive.num_experts) + 1);
  const void* kernel = reinterpret_cast<const void*>(
      send.ctx.spans_nodes ? (receive.records ? ll_dispatch_kernel<true, true>
                                              : ll_dispatch_kernel<true, false>)
                           : (receive.records ? ll_dispatch_kernel<false, true>
                                              : ll_dispatch_kernel<false, false>));
  cudaError_t status = allow_shared_memory(kernel, smem);
  if (status != cudaSuccess) return status;
  const int grid = resident_grid(kernel, smem, receive.num_blocks);
  if (grid < 1) {  // cannot hold the grid at once: two launches
    status = launch_ll_dispatch_send(send, stream);
    return status != cudaSuccess ? status : launch_ll_dispatch_receive(receive, stream);
  }
  LLDispatchSendArgs s = send;
  LLDispatchReceiveArgs r = receive;
  void* args[] = {&s, &r};
  return launch_fused(kernel, grid, smem, args, stream, placement);
}

// The combine kernels need every block resident (a peer's blocks wait for the gate words that
// this rank's first blocks write; the fused receive waits for its own send): always one grid.
namespace {

cudaError_t launch_resident(const void* kernel, int wanted, size_t smem, void** args,
                            cudaStream_t stream, LLPlacement placement) {
  const cudaError_t status = allow_shared_memory(kernel, smem);
  if (status != cudaSuccess) return status;
  const int grid = resident_grid(kernel, smem, wanted);
  if (grid < 1) return cudaErrorCooperativeLaunchTooLarge;
  return launch_fused(kernel, grid, smem, args, stream, placement);
}

size_t combine_send_smem(const LLCombineSendArgs& a) {
  return ll_combine_send_smem(a.num_local_experts);
}

}  // namespace

cudaError_t launch_ll_combine(const LLCombineSendArgs& send, const LLCombineReceiveArgs& receive,
                              cudaStream_t stream, LLPlacement placement) {
  LLCombineSendArgs s = send;
  LLCombineReceiveArgs r = receive;
  void* args[] = {&s, &r};
  const void* kernel = reinterpret_cast<const void*>(
      send.ctx.spans_nodes ? ll_combine_kernel<true> : ll_combine_kernel<false>);
  return launch_resident(kernel, receive.num_blocks, combine_send_smem(send), args, stream,
                         placement);
}

cudaError_t launch_ll_combine_send(const LLCombineSendArgs& send, int blocks, cudaStream_t stream,
                                   LLPlacement placement) {
  LLCombineSendArgs s = send;
  void* args[] = {&s};
  const void* kernel = reinterpret_cast<const void*>(
      send.ctx.spans_nodes ? ll_combine_send_kernel<true> : ll_combine_send_kernel<false>);
  return launch_resident(kernel, blocks, combine_send_smem(send), args, stream, placement);
}

cudaError_t launch_ll_combine_receive(const LLCombineReceiveArgs& receive, cudaStream_t stream) {
  auto kernel =
      receive.ctx.spans_nodes ? ll_combine_receive_kernel<true> : ll_combine_receive_kernel<false>;
  return launch_after_previous(kernel, receive.num_blocks, kLLThreads, 0, stream, receive);
}

}  // namespace jax_ep
