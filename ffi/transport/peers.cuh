// The NVLink transport's device side: how a kernel reaches its peers (each PE's symmetric
// buffer mapped into this process, nvshmem_ptr), the flags and tagged words it signals them
// with, and the bounded waits that end in a report naming the peer. Kernels reach peers only
// through these; another transport (NVSHMEM puts for peers off this host) is another such
// header behind the same calls.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "runtime/control.h"
#include "runtime/diagnostics.h"

namespace jax_ep {

// What every communication kernel needs to find its peers and to bound its waits. A call's
// ranks are an EP group: the PEs pe_base + r * pe_stride, r < num_ranks (one axis of a
// multi-axis mesh that lists the processes in order; the whole job for a one-axis mesh).
// Kernels index ranks within the group; pe_of maps one to its PE.
struct PeerContext {
  void* const* peers;    // device array: symmetric buffer base of every PE of the job
  int rank;              // this PE's rank in the group (its index along the EP axis)
  int num_ranks;         // ranks in the group
  uint64_t timeout_ns;   // a wait longer than this ends in a trap naming the peer
  const int32_t* expected_rank;  // the EP axis index the program computed (must equal rank)
  FaultRecord* fault;    // mapped host memory for the timeout report (may be null)
  // This PE's Control::profile row in the normal-mode buffer (the low-latency kernels stamp
  // their phases there too); nullptr: no stamps.
  unsigned long long (*profile)[kProfilePhases];
  int pe_base, pe_stride;  // the group's PEs: pe_base + r * pe_stride
  int num_pes;             // PEs of the job (peers[pe] is nullptr for another node's)
  bool spans_nodes;        // the job has PEs on other nodes, reached by puts (low-latency
                           // calls: transport/puts.cuh); false in the normal mode
  // XLA's allocation of every PE of this node mapped here, indexed by PE (nullptr: none).
  const XlaWindow* xla = nullptr;
  // Transport::whole_lines: the low-latency calls may read record lines as they land.
  bool whole_lines = false;
};

// Peer PE's address a (in its own address space, inside its XLA allocation) as mapped here.
__device__ __forceinline__ char* xla_address(const PeerContext& ctx, int pe, uint64_t a) {
  const XlaWindow w = ctx.xla[pe];
  return reinterpret_cast<char*>(w.mapped + (a - w.remote));
}

// Whether PE pe's XLA allocation is mapped here (what a published address needs).
__device__ __forceinline__ bool xla_mapped(const PeerContext& ctx, int pe) {
  return ctx.xla != nullptr && ctx.xla[pe].size > 0;
}

// The PE of rank r of the call's group.
__host__ __device__ __forceinline__ int pe_of(const PeerContext& ctx, int r) {
  return ctx.pe_base + r * ctx.pe_stride;
}

// Control block and regions of rank r of the group.
__device__ __forceinline__ Control* control_of(const PeerContext& ctx, int r) {
  return reinterpret_cast<Control*>(ctx.peers[pe_of(ctx, r)]);
}

template <typename T>
__device__ __forceinline__ T* region(const PeerContext& ctx, int r, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(ctx.peers[pe_of(ctx, r)]) + offset);
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t load_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A release (and acquire) fence at system scope: every write this thread made or observed
// before it reaches every PE before any write after it. Relaxed flag stores after one such
// fence release as st.release would, without one fence (~1.6 µs on an H100) per flag;
// fence.sc, which also orders fences among themselves, costs the same and buys nothing here.
__device__ __forceinline__ void fence_acq_rel_system() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// The same at GPU scope (the blocks of one kernel: the last-block counter, the grid barrier).
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Words that carry their own call number (its low 32 bits in the high half) need no flag or
// fence between their store and their use: relaxed accesses, each one single-copy atomic.
__device__ __forceinline__ uint64_t load_relaxed(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline void copy_text(char* dst, const char* src, int capacity) {
  int i = 0;
  for (; i < capacity - 1 && src[i] != 0; ++i) dst[i] = src[i];
  dst[i] = 0;
}

// The first thread to time out in this process fills the host-visible fault record, which the
// runtime's watchdog prints even if the device's printf buffer is never flushed, and prints
// the same line from the device; later ones stay silent.
__device__ inline void report_timeout_pe(const PeerContext& ctx, const char* op,
                                         const char* what, int peer_pe, uint64_t want,
                                         uint64_t saw) {
  FaultRecord* f = ctx.fault;
  const bool first = f == nullptr || atomicCAS(&f->claimed, 0, 1) == 0;
  if (!first) return;  // another thread of this process reports (once is enough)
  if (f != nullptr) {
    f->rank = pe_of(ctx, ctx.rank);
    f->peer = peer_pe;
    f->want = want;
    f->saw = saw;
    f->timeout_s = ctx.timeout_ns * 1e-9;
    copy_text(f->op, op, sizeof(f->op));
    copy_text(f->what, what, sizeof(f->what));
    __threadfence_system();
    f->written = 1;
    __threadfence_system();
  }
  printf("jax_ep %s: PE %d timed out after %.1f s waiting for PE %d (%s, call %llu, saw %llu)\n",
         op, pe_of(ctx, ctx.rank), ctx.timeout_ns * 1e-9, peer_pe, what,
         (unsigned long long)want, (unsigned long long)saw);
}

// The same for rank `peer` of the call's group.
__device__ inline void report_timeout(const PeerContext& ctx, const char* op, const char* what,
                                      int peer, uint64_t want, uint64_t saw) {
  report_timeout_pe(ctx, op, what, pe_of(ctx, peer), want, saw);
}

// Traps after giving the host watchdog (20 ms polls) time to print the fault record: once the
// trap surfaces, XLA may abort the process before anything else is printed.
__device__ inline void trap_after_report() {
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < 200000000ull) {
  }
  __trap();
}

// Spins until *flag >= want; after ctx.timeout_ns reports who was waited for (PE peer_pe)
// and traps.
__device__ inline void wait_flag_pe(const PeerContext& ctx, const uint64_t* flag, uint64_t want,
                                    const char* op, const char* what, int peer_pe) {
  if (load_acquire(flag) >= want) return;
  const uint64_t start = global_timer_ns();
  while (load_acquire(flag) < want) {
    if (global_timer_ns() - start > ctx.timeout_ns) {
      report_timeout_pe(ctx, op, what, peer_pe, want, load_acquire(flag));
      trap_after_report();
    }
  }
}

// The same for rank `peer` of the call's group.
__device__ inline void wait_flag(const PeerContext& ctx, const uint64_t* flag, uint64_t want,
                                 const char* op, const char* what, int peer) {
  wait_flag_pe(ctx, flag, want, op, what, pe_of(ctx, peer));
}

// Spins until the word at p carries `tag` in its high half and returns its low half; after
// ctx.timeout_ns reports the peer and traps (as wait_flag). kAcquire: acquire loads, so that
// what the writer wrote (or observed) before a release (a fence, then the word) is visible
// after it returns.
template <bool kAcquire = false>
__device__ inline uint32_t wait_tagged(const PeerContext& ctx, const uint64_t* p, uint32_t tag,
                                       const char* op, const char* what, int peer) {
  auto load = [p] { return kAcquire ? load_acquire(p) : load_relaxed(p); };
  uint64_t v = load();
  if (uint32_t(v >> 32) == tag) return uint32_t(v);
  const uint64_t start = global_timer_ns();
  while (uint32_t((v = load()) >> 32) != tag) {
    if (global_timer_ns() - start > ctx.timeout_ns) {
      report_timeout(ctx, op, what, peer, tag, v >> 32);
      trap_after_report();
    }
  }
  return uint32_t(v);
}

__device__ __forceinline__ void store_relaxed_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_relaxed_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 16 bytes of a line (kLLLineBytes): lane j of eight stores or loads bytes [16 j, 16 j + 16),
// all eight in one instruction (the line travels whole).
__device__ __forceinline__ void store_line_part(void* p, uint64_t lo, uint64_t hi) {
  asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi)
               : "memory");
}

__device__ __forceinline__ uint4 load_line_part(const void* p) {
  uint64_t lo, hi;
  asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];"
               : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
  return make_uint4(uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32));
}

// Two 64-bit values (addresses) as four words tagged with `call`, their low halves first: a
// reader waits for each word (wait_tagged) and joins them with tagged_pair_value.
__device__ inline void store_tagged_pair(uint64_t* words, uint64_t call, uint64_t a,
                                         uint64_t b) {
  const uint64_t tag = uint64_t(uint32_t(call)) << 32;
  store_relaxed(words + 0, tag | (a & 0xffffffffu));
  store_relaxed(words + 1, tag | a >> 32);
  store_relaxed(words + 2, tag | (b & 0xffffffffu));
  store_relaxed(words + 3, tag | b >> 32);
}

// Value i (0 or 1) of a pair stored by store_tagged_pair, from the four words' low halves.
__device__ __forceinline__ uint64_t tagged_pair_value(const uint32_t* halves, int i) {
  return halves[2 * i] | uint64_t(halves[2 * i + 1]) << 32;
}

// One thread: the program's EP axis index must be this PE's rank in the group (else a message
// and a trap).
__device__ inline void check_rank(const PeerContext& ctx, const char* op) {
  if (*ctx.expected_rank != ctx.rank) {
    printf("jax_ep %s: the expert-parallel axis index %d differs from PE %d's position %d on "
           "it; the mesh must list the processes in order (process i at flat position i)\n",
           op, *ctx.expected_rank, pe_of(ctx, ctx.rank), ctx.rank);
    __trap();
  }
}

// Thread 0 of every block: the program's EP rank must be this PE's, and every peer must have
// finished the previous call before we touch any symmetric memory of this one. Flags are
// indexed by PE, not by rank in the group: done is raised at every PE of the node, so a PE
// whose next call has another group (another mesh axis) still sees its new peers' last call.
__device__ inline void enter_call(const PeerContext& ctx, uint64_t epoch, const char* op) {
  if (threadIdx.x == 0) {
    check_rank(ctx, op);
    Control* mine = control_of(ctx, ctx.rank);
    for (int s = 0; s < ctx.num_ranks; ++s)
      wait_flag(ctx, &mine->done[pe_of(ctx, s)], epoch - 1, op, "previous call finished", s);
  }
  __syncthreads();
}

// Thread 0 of every block waits until every peer has staged its data of this call.
__device__ inline void wait_all_ready(const PeerContext& ctx, uint64_t epoch, const char* op) {
  if (threadIdx.x == 0) {
    Control* mine = control_of(ctx, ctx.rank);
    for (int s = 0; s < ctx.num_ranks; ++s)
      wait_flag(ctx, &mine->ready[pe_of(ctx, s)], epoch, op, "data staged", s);
  }
  __syncthreads();
}

// Called by one thread: set this PE's flag of the given kind on every peer of the group
// (ready, pushed) or on every PE of its node (done: see enter_call; a group never leaves a
// node). One fence releases every flag: the stores after it go out side by side. fenced: the
// caller's last signal_all fenced everything this one releases (two flags, one fence).
__device__ inline void signal_all(const PeerContext& ctx, Flag flag, uint64_t epoch,
                                  bool fenced = false) {
  const int me = pe_of(ctx, ctx.rank);
  if (!fenced) fence_acq_rel_system();
  if (flag != Flag::kDone) {
    for (int p = 0; p < ctx.num_ranks; ++p) {
      Control* peer = control_of(ctx, p);
      store_relaxed(flag == Flag::kReady ? &peer->ready[me] : &peer->pushed[me], epoch);
    }
    return;
  }
  for (int pe = 0; pe < ctx.num_pes; ++pe) {
    Control* control = reinterpret_cast<Control*>(ctx.peers[pe]);
    if (control != nullptr) store_relaxed(&control->done[me], epoch);  // this node's PEs
  }
}

// One thread of the call's last kernel, once every access of call `call` is over: the peers
// may go on (done), and this PE counts the call as completed (its epoch).
__device__ inline void finish_call(const PeerContext& ctx, uint64_t call, bool fenced = false) {
  signal_all(ctx, Flag::kDone, call, fenced);
  control_of(ctx, ctx.rank)->epoch = call;
}

// The call number this kernel belongs to: one more than the calls completed.
__device__ __forceinline__ uint64_t current_call(const PeerContext& ctx) {
  return *reinterpret_cast<volatile uint64_t*>(&control_of(ctx, ctx.rank)->epoch) + 1;
}

// Copy-engine paths: lane 0 waits until chunk c of source s has landed here.
__device__ __forceinline__ void wait_landed(const PeerContext& ctx, int s, int c, int lane,
                                            const char* op) {
  if (lane == 0)
    wait_flag(ctx, &control_of(ctx, ctx.rank)->landed[s][c], 1, op, "rows landed (copy engine)",
              s);
  __syncwarp();
}

// Copy-engine paths, one thread, before done is raised: every chunk of every source has landed
// (a chunk holding none of our rows must not land during the next call), and the flags are
// cleared for it.
__device__ inline void close_copy_engine_call(const PeerContext& ctx, int chunks, const char* op) {
  Control* mine = control_of(ctx, ctx.rank);
  for (int s = 0; s < ctx.num_ranks; ++s) {
    if (s == ctx.rank) continue;
    for (int c = 0; c < chunks; ++c) {
      wait_flag(ctx, &mine->landed[s][c], 1, op, "rows landed (copy engine)", s);
      mine->landed[s][c] = 0;
    }
  }
}

}  // namespace jax_ep
