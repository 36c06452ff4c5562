// The NVSHMEM put transport's device side: how a kernel reaches a PE of its group that is on
// another node (not mapped into this process: its peers[] entry is nullptr). Data is written
// into this PE's own copy of the symmetric buffer first, then put at the same offset into the
// peer's copy (a symmetric address names both); small words go as single puts; signals are
// NVSHMEM signal operations on the same uint64 flags the NVLink transport stores into. The
// calls are NVSHMEM's, so the remote transport is whatever NVSHMEM chose (IBGDA, IBRC, UCX);
// between PEs of one host (virtual nodes, for tests) they are NVSHMEM's own NVLink copies.
//
// Ordering: a put is complete at the peer once the issuing PE has called nvshmem_quiet; the
// kernels quiet every block's puts before its "last block" count, so the last block's signal
// follows every put of the call. Waits are the NVLink transport's (acquire loads of flags in
// this PE's own buffer).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "transport/peers.cuh"

namespace jax_ep {

// Rank r of the group is on another node: reached by puts only. kPuts: the kernel's
// instantiation for jobs that span nodes (ctx.spans_nodes); the other one has no put at all,
// so the single-node path's loops keep their registers and speed.
template <bool kPuts>
__device__ __forceinline__ bool off_node(const PeerContext& ctx, int r) {
  return kPuts && ctx.peers[pe_of(ctx, r)] == nullptr;
}

// This PE's own copy of the symmetric object at `offset`: a put's source where the data is
// staged here, and the symmetric address that names the peer's copy as the put's destination.
__device__ __forceinline__ char* own_at(const PeerContext& ctx, size_t offset) {
  return static_cast<char*>(ctx.peers[pe_of(ctx, ctx.rank)]) + offset;
}

// The whole warp: bytes [offset, offset + bytes) of this PE's buffer into the same bytes of rank
// r's (non-blocking: complete after quiet_puts).
__device__ __forceinline__ void put_own_warp(const PeerContext& ctx, int r, size_t offset,
                                             size_t bytes) {
  void* p = own_at(ctx, offset);
  nvshmemx_putmem_nbi_warp(p, p, bytes, pe_of(ctx, r));
}

// The whole warp: `bytes` from `source` (this PE's memory) to `offset` of rank r's buffer.
__device__ __forceinline__ void put_warp(const PeerContext& ctx, int r, size_t offset,
                                         const void* source, size_t bytes) {
  nvshmemx_putmem_nbi_warp(own_at(ctx, offset), source, bytes, pe_of(ctx, r));
}

// The whole warp: bytes [offset, offset + bytes) of this PE's buffer into rank r's, then
// `*flag = value` there (flag: a uint64 of this PE's buffer, naming the peer's), after the data.
__device__ __forceinline__ void put_own_signal_warp(const PeerContext& ctx, int r, size_t offset,
                                                    size_t bytes, uint64_t* flag, uint64_t value) {
  void* p = own_at(ctx, offset);
  nvshmemx_putmem_signal_nbi_warp(p, p, bytes, flag, value, NVSHMEM_SIGNAL_SET, pe_of(ctx, r));
}

// One thread: single words at `offset` of PE pe's buffer.
__device__ __forceinline__ void put_u64(const PeerContext& ctx, int pe, size_t offset,
                                        uint64_t value) {
  nvshmem_uint64_p(reinterpret_cast<uint64_t*>(own_at(ctx, offset)), value, pe);
}

__device__ __forceinline__ void put_u32(const PeerContext& ctx, int pe, size_t offset,
                                        uint32_t value) {
  nvshmem_uint32_p(reinterpret_cast<uint32_t*>(own_at(ctx, offset)), value, pe);
}

// One thread: PE pe's copy of `flag` (a uint64 of this PE's buffer) = value.
__device__ __forceinline__ void signal_pe(int pe, uint64_t* flag, uint64_t value) {
  nvshmemx_signal_op(flag, value, NVSHMEM_SIGNAL_SET, pe);
}

// One thread, after a barrier of the threads that issued puts: every put this PE issued is
// complete at its destination.
__device__ __forceinline__ void quiet_puts() { nvshmem_quiet(); }

}  // namespace jax_ep
