// Grouped GEMM for few rows per group: a block takes (group, 128 output columns) items in
// turn, streams that slice of its expert's weights through shared memory once per 64 rows of
// the group and multiplies only the group's 16-row tiles (mma.sync, float32 accumulation). At
// decode shapes (a few rows per expert) the work is reading the weights: a batched GEMM over padded blocks
// multiplies every padded row, and a grouped GEMM with 64- or 128-row tiles one tile per
// group, ~16-32x the used rows; here a group of r rows costs ceil(r / 16) tiles and an empty
// group nothing.
#include "kernels/grouped_gemm.h"
#include "kernels/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

namespace jax_ep {
namespace {

constexpr int kThreads = 128;  // four warps, 32 output columns each
constexpr int kWarps = kThreads / 32;
constexpr int kBN = 128, kBK = 64, kBM = 64, kStages = 4;
constexpr int kMTiles = kBM / 16, kNTiles = kBN / kWarps / 8;  // per warp: 4 x 4 mma tiles
constexpr size_t kSmemBytes = size_t(kStages) * (kBM * kBK + kBK * kBN) * 2;

__device__ __forceinline__ void copy16_async(void* smem, const void* global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(global),
               "r"(valid ? 16 : 0));  // 0 bytes read: the 16 zero-filled
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

template <bool kTrans>
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const void* smem) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Shared-memory tiles are rows of 16-byte chunks, chunk c of row r stored at c ^ (r % 8): the
// eight rows one ldmatrix reads at one column then fall in eight different banks (unswizzled,
// rows of 128 or 256 bytes put all eight in the same ones).
__device__ __forceinline__ int swizzled(int row, int chunk, int chunks_per_row) {
  return row * chunks_per_row * 8 + ((chunk ^ (row & 7)) * 8);
}

// The blocks take the work items (group l, 128 output columns n0) in turn: item i is group
// i / nblocks, column block i % nblocks (a group's items side by side, so that blocks working
// at once share its rows), as many blocks as the SMs the call is sized for hold. `ends`: each
// group's end row (the inclusive sum of the sizes, negative ones counted as 0); groups end at
// P. w[l] is [K, N] (smem tiles [kBK][kBN], read by transposing loads) or, kTransW, [N, K]
// ([kBN][kBK]). `index` (or nullptr: row i itself): the x row of each of the P rows, among
// x_rows; one outside them reads as zeros.
template <typename T, bool kTransW>
__global__ void __launch_bounds__(kThreads)
    grouped_gemm_kernel(const T* __restrict__ x, const int32_t* __restrict__ index, int x_rows,
                        const T* __restrict__ w, const int32_t* __restrict__ ends,
                        T* __restrict__ y, int P, int K, int N, int L) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int x_row[kBM];  // the x row of each row of the pass (-1: zeros)
  T* a_tiles = reinterpret_cast<T*>(smem);       // [kStages][kBM][kBK]
  T* b_tiles = a_tiles + kStages * kBM * kBK;    // [kStages][kBK * kBN]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nblocks = (N + kBN - 1) / kBN;

  {  // rows past every group are zero (16 bytes a store, the blocks striding)
    const int total = min(max(__ldg(ends + L - 1), 0), P), chunks = N / 8;
    for (size_t i = size_t(blockIdx.x) * kThreads + tid; i < size_t(P - total) * chunks;
         i += size_t(gridDim.x) * kThreads)
      *reinterpret_cast<int4*>(y + (total + i / chunks) * N + (i % chunks) * 8) =
          int4{0, 0, 0, 0};
  }
  const int ktiles = (K + kBK - 1) / kBK;
  const int group = lane >> 2, quad = lane & 3;
  for (int item = blockIdx.x; item < L * nblocks; item += gridDim.x) {
    const int l = item / nblocks, n0 = (item % nblocks) * kBN;
    const int start = l == 0 ? 0 : min(max(__ldg(ends + l - 1), 0), P);
    const int count = max(min(__ldg(ends + l), P) - start, 0);
    for (int m0 = 0; m0 < count; m0 += kBM) {
      const int rows = min(kBM, count - m0), mtiles = (rows + 15) / 16;
      // every thread's loads of the previous pass came before its loop's last barrier
      if (tid < kBM) {
        const int r = start + m0 + tid;
        int from = tid < rows ? (index != nullptr ? __ldg(index + r) : r) : -1;
        x_row[tid] = from < x_rows ? from : -1;
      }
      auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * kBK;
        T* a = a_tiles + stage * kBM * kBK;
        for (int c = tid; c < mtiles * 16 * (kBK / 8); c += kThreads) {
          const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8, from = x_row[r];
          const bool valid = from >= 0 && k0 + kc < K;
          copy16_async(a + swizzled(r, kc / 8, kBK / 8),
                       valid ? x + size_t(from) * K + k0 + kc : x, valid);
        }
        T* b = b_tiles + stage * kBK * kBN;
        for (int c = tid; c < kBK * kBN / 8; c += kThreads) {
          if constexpr (kTransW) {
            const int nr = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
            const bool valid = n0 + nr < N && k0 + kc < K;
            copy16_async(b + swizzled(nr, kc / 8, kBK / 8),
                         valid ? w + (size_t(l) * N + n0 + nr) * K + k0 + kc : w, valid);
          } else {
            const int kr = c / (kBN / 8), nc = (c % (kBN / 8)) * 8;
            const bool valid = k0 + kr < K && n0 + nc < N;
            copy16_async(b + swizzled(kr, nc / 8, kBN / 8),
                         valid ? w + (size_t(l) * K + k0 + kr) * N + n0 + nc : w, valid);
          }
        }
      };

      float acc[kMTiles][kNTiles][4];
#pragma unroll
      for (int i = 0; i < kMTiles; ++i)
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

      __syncthreads();  // the previous pass's tiles are read; x_row is written
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < ktiles) load_stage(s, s);
        commit_async();
      }
      for (int kt = 0; kt < ktiles; ++kt) {
        wait_async<kStages - 2>();
        __syncthreads();  // tile kt landed for every thread; tile kt - 1's stage is free
        if (kt + kStages - 1 < ktiles) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
        commit_async();
        const T* a = a_tiles + (kt % kStages) * kBM * kBK;
        const T* b = b_tiles + (kt % kStages) * kBK * kBN;
#pragma unroll
        for (int kk = 0; kk < kBK; kk += 16) {
          uint32_t bf[kNTiles / 2][4];  // pairs of 8-column tiles
#pragma unroll
          for (int p = 0; p < kNTiles / 2; ++p) {
            const int nb = warp * (kBN / kWarps) + p * 16;
            if constexpr (kTransW)
              load_matrices<false>(bf[p], b + swizzled(nb + (lane & 7) + ((lane >> 4) << 3),
                                                       kk / 8 + ((lane >> 3) & 1), kBK / 8));
            else
              load_matrices<true>(bf[p], b + swizzled(kk + (lane & 15), nb / 8 + (lane >> 4),
                                                      kBN / 8));
          }
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            if (mt >= mtiles) break;
            uint32_t af[4];
            load_matrices<false>(af, a + swizzled(mt * 16 + (lane & 15), kk / 8 + (lane >> 4),
                                                  kBK / 8));
#pragma unroll
            for (int p = 0; p < kNTiles / 2; ++p) {
              mma16816<T>(acc[mt][2 * p], af, bf[p][0], bf[p][1]);
              mma16816<T>(acc[mt][2 * p + 1], af, bf[p][2], bf[p][3]);
            }
          }
        }
      }
      wait_async<0>();

#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (mt >= mtiles) break;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const int col = n0 + warp * (kBN / kWarps) + nt * 8 + 2 * quad;
          if (col >= N) continue;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + group + 8 * half;
            if (r < rows)
              *reinterpret_cast<uint32_t*>(y + size_t(start + m0 + r) * N + col) =
                  pack2<T>(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
          }
        }
      }
    }
  }
}

template <typename T, bool kTransW>
cudaError_t launch(const void* x, const int32_t* index, int64_t x_rows, const void* w,
                   const int32_t* ends, void* y, int64_t rows, int64_t k, int64_t n,
                   int64_t groups, int sm_count, cudaStream_t stream) {
  auto kernel = grouped_gemm_kernel<T, kTransW>;
  static const cudaError_t configured = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  if (configured != cudaSuccess) return configured;
  static const int per_sm = [&] {
    int blocks = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads,
                                                         kSmemBytes) == cudaSuccess &&
                   blocks > 0
               ? blocks
               : 1;
  }();
  const int sms = sm_count > 0 ? std::min(sm_count, multiprocessors()) : multiprocessors();
  const int64_t items = groups * ((n + kBN - 1) / kBN);
  const int grid = static_cast<int>(std::min<int64_t>(items, int64_t(sms) * per_sm));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(x), index, static_cast<int>(x_rows), static_cast<const T*>(w), ends,
      static_cast<T*>(y),
      static_cast<int>(rows), static_cast<int>(k), static_cast<int>(n),
      static_cast<int>(groups));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_grouped_gemm(const void* x, const int32_t* row_index, int64_t x_rows,
                                const void* w, const int32_t* group_ends, void* y,
                                ElementType type, int64_t rows, int64_t k, int64_t n,
                                int64_t groups, bool transpose_w, int sm_count,
                                cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  if (groups == 0 || k == 0)  // no group, or no contraction: every row is zero
    return cudaMemsetAsync(y, 0, size_t(rows) * size_t(n) * 2, stream);
  auto run = [&](auto kernel_launch) {
    return kernel_launch(x, row_index, x_rows, w, group_ends, y, rows, k, n, groups, sm_count,
                         stream);
  };
  if (type == ElementType::kBF16)
    return transpose_w ? run(launch<__nv_bfloat16, true>) : run(launch<__nv_bfloat16, false>);
  if (type == ElementType::kF16)
    return transpose_w ? run(launch<__half, true>) : run(launch<__half, false>);
  return cudaErrorInvalidValue;
}

}  // namespace jax_ep
