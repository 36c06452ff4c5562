// The node exchange of the hierarchical normal mode; the protocol is in node_exchange.h.
#include "kernels/node_exchange.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/device_utils.cuh"
#include "kernels/launch.h"
#include "transport/puts.cuh"

namespace jax_ep {
namespace {

constexpr int kNodeThreads = 512;
constexpr int kNodeWarps = kNodeThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
// Control::block_counter slots of these kernels (the intranode kernels use 0-5).
constexpr int kCounterNodeSend = 10;
constexpr int kCounterNodeReceive = 11;

// PE pe's copy of `flag` (a word of this PE's Control) = value: a release store where pe is
// mapped (this node), a signal put otherwise.
__device__ inline void raise_at(const PeerContext& ctx, int pe, uint64_t* flag, uint64_t value) {
  if (ctx.peers[pe] == nullptr) {
    signal_pe(pe, flag, value);
    return;
  }
  const size_t offset =
      reinterpret_cast<char*>(flag) - static_cast<char*>(ctx.peers[pe_of(ctx, ctx.rank)]);
  store_release(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.peers[pe]) + offset), value);
}

// Thread 0 of every block, before the block touches symmetric memory: every PE of this node
// has finished the previous call (nothing of it reads or writes our buffer any more); block 0
// then tells every peer that it may put (entered), and each block waits until every peer has
// said the same, so that no put lands in a buffer its node still uses.
__device__ void enter_exchange(const PeerContext& ctx, uint64_t call, const char* op) {
  if (threadIdx.x == 0) {
    check_rank(ctx, op);
    Control* mine = control_of(ctx, ctx.rank);
    for (int pe = 0; pe < ctx.num_pes; ++pe)
      if (ctx.peers[pe] != nullptr)
        wait_flag_pe(ctx, &mine->done[pe], call - 1, op, "previous call finished", pe);
    const int me = pe_of(ctx, ctx.rank);
    if (blockIdx.x == 0)
      for (int r = 0; r < ctx.num_ranks; ++r)
        if (r != ctx.rank) raise_at(ctx, pe_of(ctx, r), &mine->entered[me], call);
    for (int r = 0; r < ctx.num_ranks; ++r)
      if (r != ctx.rank)
        wait_flag(ctx, &mine->entered[pe_of(ctx, r)], call, op, "entered the call", r);
  }
  __syncthreads();
}

// Every block, after its puts: they are complete at their destinations (quiet); the last
// block then may put what the whole grid staged and raise ready at every peer.
__device__ bool quiet_and_last(const PeerContext& ctx) {
  __syncthreads();
  if (threadIdx.x == 0) quiet_puts();
  return last_block_on(&control_of(ctx, ctx.rank)->block_counter[kCounterNodeSend],
                       BlockFence::kSystem);
}

__device__ void raise_ready(const PeerContext& ctx, uint64_t call) {
  Control* mine = control_of(ctx, ctx.rank);
  const int me = pe_of(ctx, ctx.rank);
  for (int r = 0; r < ctx.num_ranks; ++r)
    if (r != ctx.rank) raise_at(ctx, pe_of(ctx, r), &mine->ready[me], call);
}

// Thread 0 of every block of a receiving kernel: every peer's puts of this call have landed.
__device__ void wait_peers_ready(const PeerContext& ctx, uint64_t call, const char* op) {
  if (threadIdx.x == 0) {
    Control* mine = control_of(ctx, ctx.rank);
    for (int r = 0; r < ctx.num_ranks; ++r)
      if (r != ctx.rank)
        wait_flag(ctx, &mine->ready[pe_of(ctx, r)], call, op, "rows put", r);
  }
  __syncthreads();
}

__device__ __forceinline__ void zero_row(void* dst, size_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | bytes) & 15) == 0) {
    int4* d = static_cast<int4*>(dst);
    for (size_t i = lane; i < bytes / 16; i += 32) d[i] = make_int4(0, 0, 0, 0);
  } else {
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < bytes; i += 32) d[i] = 0;
  }
}

__device__ __forceinline__ int global_warp() {
  return (blockIdx.x * kNodeThreads + threadIdx.x) >> 5;
}

// ----------------------------------------------------------------------------- send

__global__ void __launch_bounds__(kNodeThreads) node_send_kernel(NodeSendArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  const char* op = "dispatch across nodes (send)";
  enter_exchange(ctx, call, op);
  const int me = ctx.rank, N = ctx.num_ranks, T = a.num_tokens, K = a.num_topk;
  const int lane = threadIdx.x & 31, warps = gridDim.x * kNodeWarps;
  const int E = a.experts_per_node * N;
  // this PE's ids and weights, staged in its own block for the last block's puts
  char* meta = own_at(ctx, a.plan.meta + a.plan.meta_stride * me);
  int32_t* ids = reinterpret_cast<int32_t*>(meta);
  float* weights = reinterpret_cast<float*>(meta + sizeof(int32_t) * size_t(T) * K);
  for (int i = blockIdx.x * kNodeThreads + threadIdx.x; i < T * K; i += gridDim.x * kNodeThreads) {
    ids[i] = a.topk_idx[i];
    weights[i] = a.topk_weights[i];
  }
  for (int t = global_warp(); t < T; t += warps) {
    int node = -1;
    if (lane < K) {
      const int e = a.topk_idx[size_t(t) * K + lane];
      if (e >= 0 && e < E) node = e / a.experts_per_node;
    }
    // one put per other node the token reaches: the first lane naming each node leads
    const unsigned same = __match_any_sync(kFull, node);
    const bool lead = node >= 0 && node != me && __ffs(same) - 1 == lane;
    unsigned leaders = __ballot_sync(kFull, lead);
    if (leaders == 0) continue;
    const size_t slot = size_t(me) * T + t;  // where it lands: the peer's block [me]
    const size_t row_at = a.plan.rows + a.plan.row_stride * slot;
    const size_t scale_at = a.plan.scales + a.plan.scale_stride * slot;
    copy_row(own_at(ctx, row_at), static_cast<const char*>(a.x) + a.row_bytes * t, a.row_bytes,
             lane, 32);
    if (a.scale_bytes > 0)
      copy_row(own_at(ctx, scale_at), reinterpret_cast<const char*>(a.scales) + a.scale_bytes * t,
               a.scale_bytes, lane, 32);
    __syncwarp();
    while (leaders != 0) {
      const int leader = __ffs(leaders) - 1;
      leaders &= leaders - 1;
      const int n = __shfl_sync(kFull, node, leader);
      put_own_warp(ctx, n, row_at, a.row_bytes);
      if (a.scale_bytes > 0) put_own_warp(ctx, n, scale_at, a.scale_bytes);
    }
  }
  if (!quiet_and_last(ctx)) return;
  for (int r = threadIdx.x >> 5; r < N; r += kNodeWarps)
    if (r != me)
      put_own_warp(ctx, r, a.plan.meta + a.plan.meta_stride * me, 8 * size_t(T) * K);
  __syncthreads();
  if (threadIdx.x == 0) {
    quiet_puts();
    raise_ready(ctx, call);
  }
}

// N blocks of T virtual tokens: block s = node s's tokens (this PE's own from x), with the ids
// of this node's experts made relative to it and the rest -1; rows of tokens with none are zero.
__global__ void __launch_bounds__(kNodeThreads) node_receive_kernel(NodeSendArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  wait_peers_ready(ctx, call, "dispatch across nodes (receive)");
  const int me = ctx.rank, N = ctx.num_ranks, T = a.num_tokens, K = a.num_topk;
  const int lane = threadIdx.x & 31, warps = gridDim.x * kNodeWarps;
  const int lo = me * a.experts_per_node, hi = lo + a.experts_per_node;
  for (int v = global_warp(); v < N * T; v += warps) {
    const int s = v / T, t = v % T;
    const bool own = s == me;
    const char* meta = own_at(ctx, a.plan.meta + a.plan.meta_stride * s);
    int rel = -1;
    float w = 0.f;
    if (lane < K) {
      const size_t i = size_t(t) * K + lane;
      const int e = own ? a.topk_idx[i] : __ldcg(reinterpret_cast<const int32_t*>(meta) + i);
      if (e >= lo && e < hi) {
        rel = e - lo;
        w = own ? a.topk_weights[i]
                : __ldcg(reinterpret_cast<const float*>(meta + sizeof(int32_t) * size_t(T) * K) +
                         i);
      }
      a.out_ids[size_t(v) * K + lane] = rel;
      a.out_weights[size_t(v) * K + lane] = w;
    }
    const bool present = __any_sync(kFull, rel >= 0);
    char* dst = static_cast<char*>(a.out_x) + a.row_bytes * v;
    char* dst_scales = reinterpret_cast<char*>(a.out_scales) + a.scale_bytes * v;
    const size_t slot = size_t(s) * T + t;
    if (!present) {
      zero_row(dst, a.row_bytes, lane);
      if (a.scale_bytes > 0) zero_row(dst_scales, a.scale_bytes, lane);
    } else if (own) {
      copy_row(dst, static_cast<const char*>(a.x) + a.row_bytes * t, a.row_bytes, lane, 32);
      if (a.scale_bytes > 0)
        copy_row(dst_scales, reinterpret_cast<const char*>(a.scales) + a.scale_bytes * t,
                 a.scale_bytes, lane, 32);
    } else {
      copy_row<true>(dst, own_at(ctx, a.plan.rows + a.plan.row_stride * slot), a.row_bytes, lane,
                     32);
      if (a.scale_bytes > 0)
        copy_row<true>(dst_scales, own_at(ctx, a.plan.scales + a.plan.scale_stride * slot),
                       a.scale_bytes, lane, 32);
    }
  }
  if (last_block_on(&control_of(ctx, me)->block_counter[kCounterNodeReceive]) &&
      threadIdx.x == 0)
    finish_call(ctx, call);
}

// ----------------------------------------------------------------------------- return

__global__ void __launch_bounds__(kNodeThreads) node_return_send_kernel(NodeReturnArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  enter_exchange(ctx, call, "combine across nodes (send)");
  const int me = ctx.rank, N = ctx.num_ranks, T = a.num_tokens, K = a.num_topk;
  const int lane = threadIdx.x & 31, warps = gridDim.x * kNodeWarps;
  for (int v = global_warp(); v < N * T; v += warps) {
    const int s = v / T, t = v % T;
    if (s == me) continue;  // this PE's own tokens: its receive reads them from `partial`
    const bool here = lane < K && a.node_ids[size_t(v) * K + lane] >= 0;
    if (!__any_sync(kFull, here)) continue;  // the token reached no expert of this node
    // staged in symmetric memory (a put's source must be, for a network transport), put into
    // the owner's block [me]
    const size_t staged = a.plan.staged + a.plan.row_stride * v;
    copy_row(own_at(ctx, staged), static_cast<const char*>(a.partial) + a.row_bytes * v,
             a.row_bytes, lane, 32);
    __syncwarp();
    put_warp(ctx, s, a.plan.rows + a.plan.row_stride * (size_t(me) * T + t), own_at(ctx, staged),
             a.row_bytes);
  }
  if (quiet_and_last(ctx) && threadIdx.x == 0) raise_ready(ctx, call);
}

template <typename E>
__device__ __forceinline__ float to_f32(E v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <typename E>
__device__ __forceinline__ E from_f32(float v) {
  return static_cast<E>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half(v);
}

// out[t] = the partials of the nodes holding any of t's experts, added in node order in
// float32 and rounded once. kVec: rows of whole 16-byte pieces.
template <typename E, bool kVec>
__global__ void __launch_bounds__(kNodeThreads) node_return_receive_kernel(NodeReturnArgs a) {
  wait_previous_kernel();
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  wait_peers_ready(ctx, call, "combine across nodes (receive)");
  const int me = ctx.rank, N = ctx.num_ranks, T = a.num_tokens, K = a.num_topk;
  const int lane = threadIdx.x & 31, warps = gridDim.x * kNodeWarps;
  const int E_total = a.experts_per_node * N;
  const int H = static_cast<int>(a.row_bytes / sizeof(E));
  constexpr int kPer = kVec ? 16 / sizeof(E) : 1;
  for (int t = global_warp(); t < T; t += warps) {
    int node = -1;
    if (lane < K) {
      const int e = a.topk_idx[size_t(t) * K + lane];
      if (e >= 0 && e < E_total) node = e / a.experts_per_node;
    }
    // the token's nodes (at most 64: the handler checks), ascending
    unsigned long long nodes = 0;
    for (int k = 0; k < K; ++k) {
      const int n = __shfl_sync(kFull, node, k);
      if (n >= 0) nodes |= 1ull << n;
    }
    E* out = reinterpret_cast<E*>(static_cast<char*>(a.out) + a.row_bytes * t);
    for (int c = lane * kPer; c < H; c += 32 * kPer) {
      float acc[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) acc[u] = 0.f;
      for (unsigned long long left = nodes; left != 0; left &= left - 1) {
        const int s = __ffsll(left) - 1;
        const E* src = s == me
                           ? reinterpret_cast<const E*>(static_cast<const char*>(a.partial) +
                                                        a.row_bytes * (size_t(me) * T + t))
                           : reinterpret_cast<const E*>(own_at(
                                 ctx, a.plan.rows + a.plan.row_stride * (size_t(s) * T + t)));
        if constexpr (kVec) {
          const int4 raw = s == me ? *reinterpret_cast<const int4*>(src + c)
                                   : __ldcg(reinterpret_cast<const int4*>(src + c));
          const E* v = reinterpret_cast<const E*>(&raw);
#pragma unroll
          for (int u = 0; u < kPer; ++u) acc[u] += to_f32(v[u]);
        } else {
          acc[0] += to_f32(src[c]);
        }
      }
      if constexpr (kVec) {
        int4 raw;
        E* v = reinterpret_cast<E*>(&raw);
#pragma unroll
        for (int u = 0; u < kPer; ++u) v[u] = from_f32<E>(acc[u]);
        *reinterpret_cast<int4*>(out + c) = raw;
      } else {
        out[c] = from_f32<E>(acc[0]);
      }
    }
  }
  if (last_block_on(&control_of(ctx, me)->block_counter[kCounterNodeReceive]) &&
      threadIdx.x == 0)
    finish_call(ctx, call);
}

template <typename E>
cudaError_t launch_return_receive(const NodeReturnArgs& a, int blocks, cudaStream_t stream) {
  if (a.row_bytes % 16 == 0)
    return launch_after_previous(node_return_receive_kernel<E, true>, dim3(blocks),
                                 dim3(kNodeThreads), 0, stream, a);
  return launch_after_previous(node_return_receive_kernel<E, false>, dim3(blocks),
                               dim3(kNodeThreads), 0, stream, a);
}

}  // namespace

cudaError_t launch_node_send(const NodeSendArgs& a, int blocks, cudaStream_t stream) {
  cudaError_t status = launch_after_previous(node_send_kernel, dim3(blocks), dim3(kNodeThreads),
                                             0, stream, a);
  if (status != cudaSuccess) return status;
  return launch_after_previous(node_receive_kernel, dim3(blocks), dim3(kNodeThreads), 0, stream,
                               a);
}

cudaError_t launch_node_return(const NodeReturnArgs& a, int blocks, cudaStream_t stream) {
  cudaError_t status = launch_after_previous(node_return_send_kernel, dim3(blocks),
                                             dim3(kNodeThreads), 0, stream, a);
  if (status != cudaSuccess) return status;
  switch (a.element) {
    case NodeElement::kBF16: return launch_return_receive<__nv_bfloat16>(a, blocks, stream);
    case NodeElement::kF16: return launch_return_receive<__half>(a, blocks, stream);
    default: return launch_return_receive<float>(a, blocks, stream);
  }
}

}  // namespace jax_ep
