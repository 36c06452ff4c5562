// Device helpers shared by the communication kernels: phase stamps, launch order, work
// counters, the last-block pattern, row copies. Reaching peers: transport/peers.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/buffer_layout.h"
#include "transport/peers.cuh"

namespace jax_ep {

// Thread 0 of each block stamps a phase of this kernel into Control::profile (one atomic per
// block and phase), where the handler was given a row (only while the host profiles:
// next_profile_row). kEnter/kFirstEnd keep the earliest time, kWaited/kLastEnd the latest.
enum ProfilePhase { kEnter = 0, kWaited = 1, kFirstEnd = 2, kLastEnd = 3, kRetired = 4 };

__device__ __forceinline__ void profile_stamp(const PeerContext& ctx, int slot, ProfilePhase ph) {
  if (ctx.profile == nullptr) return;
  unsigned long long* p = &ctx.profile[slot][ph];
  const unsigned long long now = global_timer_ns();
  if (ph == kEnter || ph == kFirstEnd) atomicMin(p, now); else atomicMax(p, now);
}

__device__ __forceinline__ void profile_mark(const PeerContext& ctx, int slot, ProfilePhase ph) {
  if (threadIdx.x == 0) profile_stamp(ctx, slot, ph);
}

// The same, stamped by lane 0 of the calling warp (a warp group's phase within a block).
__device__ __forceinline__ void profile_mark_lane0(const PeerContext& ctx, int slot,
                                                   ProfilePhase ph) {
  if ((threadIdx.x & 31) == 0) profile_stamp(ctx, slot, ph);
}

__device__ __forceinline__ void profile_end(const PeerContext& ctx, int slot) {
  profile_mark(ctx, slot, kFirstEnd);
  profile_mark(ctx, slot, kLastEnd);
}

// Programmatic dependent launch (Hopper): the communication kernels are launched so that
// they may start while the kernel before them drains (launch_after_previous); the first
// thing each does is wait for that kernel to complete, its memory visible.
__device__ __forceinline__ void wait_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel's blocks be scheduled before this grid has finished (they wait in
// wait_previous_kernel): called once a block has no more work but its closing fences.
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The start of a kernel that runs once every peer has staged its data of the call (the
// dispatch's data kernels, the cached dispatch's gathers, the combine's backward): after the
// previous kernel (launched to overlap its drain), its phases stamped in profile row `slot`;
// returns the call number.
__device__ __forceinline__ uint64_t enter_after_ready(const PeerContext& ctx, int slot,
                                                      const char* op) {
  wait_previous_kernel();
  const uint64_t call = current_call(ctx);
  profile_mark(ctx, slot, kEnter);
  wait_all_ready(ctx, call, op);
  profile_mark(ctx, slot, kWaited);
  return call;
}

// Next item for the calling warp from a work counter (Control::work_cursor); every lane gets it.
__device__ __forceinline__ int claim_item(uint32_t* cursor, int lane) {
  uint32_t item = 0;
  if (lane == 0) item = atomicAdd(cursor, 1u);
  return static_cast<int>(__shfl_sync(0xffffffffu, item, 0));
}

__device__ __forceinline__ void reset_cursor(const PeerContext& ctx, WorkCursor which) {
  if (blockIdx.x == 0 && threadIdx.x == 0) control_of(ctx, ctx.rank)->work_cursor[which] = 0;
}

// What each block's arrival at a last-block counter orders before it.
//  kGpu: its writes, at GPU scope. The closing block then releases them at system scope
//    (signal_all, finish_call, a release store) before any flag another PE acts on: the
//    fence is cumulative, so one system fence there carries every block's writes, their
//    stores into peers included (a system fence takes ~1.6 µs wherever it runs; a GPU one
//    ~0.4: benchmarks/signal_probe.cu).
//  kSystem: at system scope in every block, where something other than this GPU's SMs reads
//    them next (puts through NVSHMEM's proxy).
//  kNone: nothing (the low-latency receives: their signal says only that the region has been
//    read, and every load has returned once the stores it feeds are issued; the kernel's end
//    makes those stores visible to the next kernel).
enum class BlockFence { kNone, kGpu, kSystem };

// True in exactly one block: the last to arrive at `counter` (an arrival counter in this PE's
// control block), after every block's writes are ordered before its arrival (`fence`); the
// last block resets it, with no fence: only a later kernel of this PE uses the counter again,
// and the kernel boundary orders the reset before it (a fence there sat on every kernel's
// critical path). reads_blocks: the last block goes on to load what the other blocks wrote
// (not only to signal).
__device__ inline bool last_block_on(unsigned* counter, BlockFence fence = BlockFence::kGpu,
                                     bool reads_blocks = false) {
  __shared__ bool is_last;
  allow_next_kernel();  // this block has no more work but the closing fences
  // The barrier orders the block's writes before thread 0's fence, which is cumulative: one
  // fence per block, not one per thread.
  __syncthreads();
  if (threadIdx.x == 0) {
    if (fence == BlockFence::kSystem) fence_acq_rel_system();
    if (fence == BlockFence::kGpu) fence_acq_rel_gpu();
    unsigned arrived = atomicAdd(counter, 1u);
    is_last = arrived == gridDim.x - 1;
    if (is_last) {
      *counter = 0;
      if (reads_blocks) fence_acq_rel_gpu();  // their writes before the last block's loads
    }
  }
  __syncthreads();
  return is_last;
}

// last_block_on the normal-mode counter `slot`.
__device__ inline bool last_block(const PeerContext& ctx, int slot, bool reads_blocks = false) {
  return last_block_on(&control_of(ctx, ctx.rank)->block_counter[slot], BlockFence::kGpu,
                       reads_blocks);
}

// A load for copy_row: cached, or (kFromPeer) bypassing L1, for data another PE wrote.
template <bool kFromPeer, typename T>
__device__ __forceinline__ T load_for_copy(const T* p) {
  if constexpr (kFromPeer) return __ldcg(p);
  else return *p;
}

// Copies `bytes` with the widest access that the two addresses and the size allow, the lanes
// of a group of `width` threads striding through the row. kFromPeer: loads bypass L1 (the
// source was written by another PE).
template <bool kFromPeer = false>
__device__ __forceinline__ void copy_row(void* dst, const void* src, size_t bytes, int lane,
                                         int width) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes);
  if ((bits & 15) == 0) {
    const int4* s = static_cast<const int4*>(src);
    int4* d = static_cast<int4*>(dst);
    const size_t n = bytes / 16;
    // Loads issued per lane before the first store (a 14 KB row takes two rounds per warp);
    // the last round is predicated rather than a serial tail of dependent load/store pairs.
    constexpr int kInFlight = 16;
    for (size_t i = lane; i < n; i += kInFlight * width) {
      int4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * width < n) v[u] = load_for_copy<kFromPeer>(s + i + u * width);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * width < n) d[i + u * width] = v[u];
    }
  } else if ((bits & 3) == 0) {
    const int* s = static_cast<const int*>(src);
    int* d = static_cast<int*>(dst);
    for (size_t i = lane; i < bytes / 4; i += width) d[i] = load_for_copy<kFromPeer>(s + i);
  } else {
    const unsigned char* s = static_cast<const unsigned char*>(src);
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (size_t i = lane; i < bytes; i += width) d[i] = load_for_copy<kFromPeer>(s + i);
  }
}

__device__ __forceinline__ void zero_row(void* dst, size_t bytes, int lane, int width) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if ((bits & 15) == 0) {
    int4* d = static_cast<int4*>(dst);
    for (size_t i = lane; i < bytes / 16; i += width) d[i] = make_int4(0, 0, 0, 0);
  } else {
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < bytes; i += width) d[i] = 0;
  }
}

// Copies one row to every non-null destination, reading it once; the lanes of a warp stride
// through it with the widest access all addresses allow. kFromPeer: the row was written by
// another PE during this kernel (loads bypass L1).
// 4 loads in flight per lane: 8 or 16 were no faster, and made the push kernel spill
// registers.
template <int kSources, bool kFromPeer = false, int kInFlight = 4>
__device__ __forceinline__ void broadcast_row(char* (&dsts)[kSources], const char* src,
                                              size_t bytes, int lane) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
#pragma unroll
  for (int j = 0; j < kSources; ++j) bits |= reinterpret_cast<uintptr_t>(dsts[j]);
  if ((bits & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const size_t n = bytes / 16;
    for (size_t i = lane; i < n; i += 32 * kInFlight) {
      int4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n) v[u] = kFromPeer ? __ldcg(s + i + u * 32) : s[i + u * 32];
#pragma unroll
      for (int j = 0; j < kSources; ++j) {
        if (dsts[j] == nullptr) continue;
        int4* d = reinterpret_cast<int4*>(dsts[j]);
#pragma unroll
        for (int u = 0; u < kInFlight; ++u)
          if (i + u * 32 < n) d[i + u * 32] = v[u];
      }
    }
  } else {
    for (size_t i = lane; i < bytes; i += 32) {
      const char v = kFromPeer ? __ldcg(src + i) : src[i];
#pragma unroll
      for (int j = 0; j < kSources; ++j)
        if (dsts[j] != nullptr) dsts[j][i] = v;
    }
  }
}

}  // namespace jax_ep
