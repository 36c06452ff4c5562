// Intranode dispatch (rank_major / expert_major) and cached dispatch. See intranode.h.
#include <cub/block/block_scan.cuh>

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ bool valid_expert(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

// ------------------------------------------------------------------------------ stage

// Block w (a destination rank, or an expert) lists this PE's tokens (or (token, k) pairs)
// for w in order, writes each one's rank in that list to send_slot, and publishes the count
// in every peer's matrix. Then all blocks stage the tokens, ids and weights for the peers.
template <bool kExpertMajor>
__global__ void __launch_bounds__(kThreads) dispatch_stage(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  enter_call(ctx, call, "dispatch");
  const int R = ctx.num_ranks, T = a.num_tokens, K = a.num_topk, E = a.num_experts;
  const int L = E / R;
  const int W = kExpertMajor ? E : R;
  const int n = kExpertMajor ? T * K : T;

  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  for (int w = blockIdx.x; w < W; w += gridDim.x) {
    int32_t* list = region<int32_t>(ctx, ctx.rank, a.plan.lists) + size_t(w) * a.plan.list_len;
    int running = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      int hit = 0;
      if (i < n) {
        if (kExpertMajor) {
          const int e = a.topk_idx[i];
          hit = e == w;
          if (w == 0 && !valid_expert(e, E)) a.send_slot[i] = -1;  // masked pairs
        } else {
          for (int k = 0; k < K; ++k) {
            const int e = a.topk_idx[size_t(i) * K + k];
            hit |= valid_expert(e, E) && e / L == w;
          }
        }
      }
      int position, total;
      Scan(scan_storage).ExclusiveSum(hit, position, total);
      if (i < n) {
        if (hit) list[running + position] = i;
        if (kExpertMajor) {
          if (hit) a.send_slot[i] = running + position;
        } else {
          a.send_slot[size_t(i) * R + w] = hit ? running + position : -1;
        }
      }
      running += total;
      __syncthreads();  // scan_storage is reused
    }
    for (int p = threadIdx.x; p < R; p += kThreads)
      region<int32_t>(ctx, p, a.plan.matrix)[size_t(ctx.rank) * W + w] = running;
  }

  // Stage this PE's tokens once; every destination reads the rows it needs.
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  char* rows = region<char>(ctx, ctx.rank, a.plan.rows);
  char* scales = region<char>(ctx, ctx.rank, a.plan.scales);
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  for (int t = warp; t < T; t += warps) {
    copy_row(rows + t * stride, static_cast<const char*>(a.x) + t * a.x_row_bytes, a.x_row_bytes,
             lane, 32);
    if (a.scales != nullptr)
      copy_row(scales + t * scale_stride,
               reinterpret_cast<const char*>(a.scales) + t * a.scale_row_bytes,
               a.scale_row_bytes, lane, 32);
  }
  int32_t* ids = region<int32_t>(ctx, ctx.rank, a.plan.meta_ids);
  float* weights = region<float>(ctx, ctx.rank, a.plan.meta_weights);
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < T * K; i += gridDim.x * kThreads) {
    ids[i] = a.topk_idx[i];
    weights[i] = a.topk_weights[i];
  }
  if (last_block(ctx, 0) && threadIdx.x == 0) signal_all(ctx, /*done=*/false, call);
}

// ------------------------------------------------------------------------------ gather

struct GatherTables {
  // rank_major: src_offset[s] (R + 1 entries) and my_offset_at[r] (R entries).
  // expert_major: pairs[e], base[e] (start of e's group at its rank + my prefix there),
  //               group_start[l] (my groups) and src_offset[l][s] ((R + 1) per local expert).
  int32_t* src_offset;
  int32_t* my_offset_at;
  int32_t* pairs;
  int32_t* base;
  int32_t* group_start;
};

__device__ __forceinline__ int aligned(int n, int alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// Largest index j in [0, n) with table[j] <= value (table ascending, table[0] <= value).
__device__ __forceinline__ int last_at_most(const int32_t* table, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <bool kExpertMajor>
__global__ void __launch_bounds__(kThreads) dispatch_gather(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  wait_all_ready(ctx, call, "dispatch");
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, K = a.num_topk;
  const int E = a.num_experts, L = E / R, C = a.capacity;
  const int W = kExpertMajor ? E : R;
  const int32_t* M = region<int32_t>(ctx, me, a.plan.matrix);  // M[s * W + w]

  extern __shared__ int32_t tables[];
  GatherTables tb;
  if (kExpertMajor) {
    tb.pairs = tables;
    tb.base = tb.pairs + E;
    tb.group_start = tb.base + E;
    tb.src_offset = tb.group_start + L;
    // pairs per expert and this PE's prefix inside each expert's group
    for (int e = threadIdx.x; e < E; e += kThreads) {
      int total = 0, before_me = 0;
      for (int s = 0; s < R; ++s) {
        if (s == me) before_me = total;
        total += M[s * W + e];
      }
      tb.pairs[e] = total;
      tb.base[e] = before_me;
    }
    __syncthreads();
    // group starts of every rank's experts, added into base
    for (int r = threadIdx.x; r < R; r += kThreads) {
      int start = 0;
      for (int l = 0; l < L; ++l) {
        tb.base[r * L + l] += start;
        if (r == me) tb.group_start[l] = start;
        start += aligned(tb.pairs[r * L + l], a.alignment);
      }
    }
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += kThreads) {
      int offset = tb.group_start[l];
      for (int s = 0; s < R; ++s) {
        tb.src_offset[l * (R + 1) + s] = offset;
        offset += M[s * W + me * L + l];
      }
      tb.src_offset[l * (R + 1) + R] = offset;
    }
  } else {
    tb.src_offset = tables;
    tb.my_offset_at = tables + R + 1;
    if (threadIdx.x == 0) {
      int offset = 0;
      for (int s = 0; s < R; ++s) {
        tb.src_offset[s] = offset;
        offset += M[s * W + me];
      }
      tb.src_offset[R] = offset;
    }
    for (int r = threadIdx.x; r < R; r += kThreads) {
      int offset = 0;
      for (int s = 0; s < me; ++s) offset += M[s * W + r];
      tb.my_offset_at[r] = offset;
    }
  }
  __syncthreads();

  // Rows of the output, one warp per row.
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  const int out_k = kExpertMajor ? 1 : K;
  for (int i = warp; i < C; i += warps) {
    int s = -1, t = -1, k = -1, local = -1;
    if (kExpertMajor) {
      const int l = last_at_most(tb.group_start, L, i);
      const int32_t* offsets = tb.src_offset + l * (R + 1);
      if (i >= tb.group_start[l] && i < offsets[R]) {
        s = last_at_most(offsets, R, i);  // the last such source: empty ones are skipped
        const int pair = region<int32_t>(ctx, s, a.plan.lists)[size_t(me * L + l) *
                                                                a.plan.list_len + i - offsets[s]];
        t = pair / K;
        k = pair % K;
        local = l;
      }
    } else if (i < tb.src_offset[R]) {
      s = last_at_most(tb.src_offset, R, i);
      t = region<int32_t>(ctx, s, a.plan.lists)[size_t(me) * a.plan.list_len + i -
                                                 tb.src_offset[s]];
    }
    char* out_row = static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes;
    char* out_scales = reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes;
    if (s < 0) {
      zero_row(out_row, a.x_row_bytes, lane, 32);
      if (a.scales != nullptr) zero_row(out_scales, a.scale_row_bytes, lane, 32);
      for (int j = lane; j < out_k; j += 32) {
        a.out_topk_idx[size_t(i) * out_k + j] = -1;
        a.out_topk_weights[size_t(i) * out_k + j] = 0.f;
      }
      if (lane == 0) a.src_rank[i] = a.src_token[i] = a.src_k[i] = -1;
      continue;
    }
    copy_row(out_row, region<char>(ctx, s, a.plan.rows) + t * stride, a.x_row_bytes, lane, 32);
    if (a.scales != nullptr)
      copy_row(out_scales, region<char>(ctx, s, a.plan.scales) + t * scale_stride,
               a.scale_row_bytes, lane, 32);
    const int32_t* ids = region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K;
    const float* weights = region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K;
    if (kExpertMajor) {
      if (lane == 0) {
        a.out_topk_idx[i] = local;
        a.out_topk_weights[i] = weights[k];
      }
    } else {
      for (int j = lane; j < K; j += 32) {
        const int e = ids[j];
        const bool here = valid_expert(e, E) && e / L == me;
        a.out_topk_idx[size_t(i) * K + j] = here ? e % L : -1;
        a.out_topk_weights[size_t(i) * K + j] = here ? weights[j] : 0.f;
        if (here) atomicAdd(&a.tokens_per_expert[e % L], 1);
      }
    }
    if (lane == 0) {
      a.src_rank[i] = s;
      a.src_token[i] = t;
      a.src_k[i] = k;
    }
  }

  // Where this PE's own tokens landed (the handle's send_slot), -1 when dropped.
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < T * (kExpertMajor ? K : R);
       i += gridDim.x * kThreads) {
    const int rank_in_list = a.send_slot[i];
    if (rank_in_list < 0) continue;
    int row;
    if (kExpertMajor) {
      row = tb.base[a.topk_idx[i]] + rank_in_list;
    } else {
      row = tb.my_offset_at[i % R] + rank_in_list;
    }
    a.send_slot[i] = row < C ? row : -1;
  }

  if (blockIdx.x == 0 && kExpertMajor) {
    for (int l = threadIdx.x; l < L; l += kThreads) {
      const int start = tb.group_start[l], n = tb.pairs[me * L + l];
      const int end = start + aligned(n, a.alignment);
      a.group_sizes[l] = max(0, min(end, C) - min(start, C));
      a.tokens_per_expert[l] = max(0, min(n, C - start));
    }
  }
  if (last_block(ctx, 1) && threadIdx.x == 0) {
    if (kExpertMajor) {
      int received = 0, dropped = 0;
      for (int l = 0; l < L; ++l) {
        received += a.group_sizes[l];
        dropped += tb.pairs[me * L + l] - a.tokens_per_expert[l];
      }
      *a.num_received = received;
      *a.num_dropped = dropped;
    } else {
      const int total = tb.src_offset[R];
      *a.num_received = min(total, C);
      *a.num_dropped = max(total - C, 0);
      for (int l = 0; l < L; ++l) a.group_sizes[l] = a.tokens_per_expert[l];
    }
    signal_all(ctx, /*done=*/true, call);
    control_of(ctx, me)->epoch = call;
  }
}

// ------------------------------------------------------------------------------ cached

__global__ void __launch_bounds__(kThreads) stage_rows(CachedDispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  enter_call(ctx, call, "cached_dispatch");
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  char* rows = region<char>(ctx, ctx.rank, plan.rows);
  for (int t = warp; t < a.num_tokens; t += gridDim.x * kWarps)
    copy_row(rows + t * row_stride(a.row_bytes), static_cast<const char*>(a.x) + t * a.row_bytes,
             a.row_bytes, lane, 32);
  if (last_block(ctx, 2) && threadIdx.x == 0) signal_all(ctx, /*done=*/false, call);
}

__global__ void __launch_bounds__(kThreads) gather_rows(CachedDispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = current_call(ctx);
  wait_all_ready(ctx, call, "cached_dispatch");
  const RegionPlan plan = plan_combine(a.num_tokens, a.row_bytes);
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < a.capacity; i += gridDim.x * kWarps) {
    char* out = static_cast<char*>(a.out) + size_t(i) * a.row_bytes;
    const int s = a.src_rank[i];
    if (s < 0) {
      zero_row(out, a.row_bytes, lane, 32);
    } else {
      copy_row(out, region<char>(ctx, s, plan.rows) + a.src_token[i] * row_stride(a.row_bytes),
               a.row_bytes, lane, 32);
    }
  }
  if (last_block(ctx, 3) && threadIdx.x == 0) {
    signal_all(ctx, /*done=*/true, call);
    control_of(ctx, ctx.rank)->epoch = call;
  }
}

}  // namespace

cudaError_t launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  const int R = a.ctx.num_ranks, E = a.num_experts, L = E / R;
  const int W = a.expert_major ? E : R;
  cudaError_t status = cudaSuccess;
  if (!a.expert_major)
    status = cudaMemsetAsync(a.tokens_per_expert, 0, sizeof(int32_t) * L, stream);
  if (status != cudaSuccess) return status;
  const int stage_blocks = W > a.num_blocks ? W : a.num_blocks;
  const size_t tables = a.expert_major ? sizeof(int32_t) * (2 * E + L + L * (R + 1))
                                       : sizeof(int32_t) * (2 * R + 1);
  if (a.expert_major) {
    dispatch_stage<true><<<stage_blocks, kThreads, 0, stream>>>(a);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
    if (tables > 48 * 1024 &&
        (status = cudaFuncSetAttribute(dispatch_gather<true>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(tables))) != cudaSuccess)
      return status;
    dispatch_gather<true><<<a.num_blocks, kThreads, tables, stream>>>(a);
  } else {
    dispatch_stage<false><<<stage_blocks, kThreads, 0, stream>>>(a);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
    dispatch_gather<false><<<a.num_blocks, kThreads, tables, stream>>>(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_cached_dispatch(const CachedDispatchArgs& a, cudaStream_t stream) {
  stage_rows<<<a.num_blocks, kThreads, 0, stream>>>(a);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  gather_rows<<<a.num_blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace jax_ep
