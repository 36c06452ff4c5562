// How fast can a few SMs copy rows within one GPU, and with which instructions? The local half
// of a dispatch or combine (issue 8): at most 24 SMs must move 58.7 MB (4096 rows of 14 KB)
// from a landing area or x into the output while the copy engines carry the peers' rows.
// No peers: runs on one GPU, no NVSHMEM.
//
//   nvcc -O3 -arch=sm_90 benchmarks/local_copy_probe.cu -o build/local_copy_probe
//   build/local_copy_probe            (benchmarks/run_on_device.sh step `copyprobe`)
//
// Variants, each at several CTA counts (512 threads a CTA), GB/s = bytes copied / time (the
// memory moves twice that, a read and a write):
//   plain<N>   every thread N 16-byte loads in flight before its stores, grid-strided
//   row<N>     one warp a row (as the gathers copy), N loads a lane in flight per round
//   tma P×S×C  P pipelines a CTA (one thread each), S shared stages of C bytes: bulk loads
//              global -> shared, bulk stores shared -> global, G stores in flight
//   copy engine: one cudaMemcpyAsync
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe_common.cuh"

namespace {

constexpr int kThreads = 512;
constexpr size_t kRowBytes = 7168 * 2;  // a BF16 row of DeepSeek-V3's hidden size
constexpr int kRows = 4096;

template <int N>
__global__ void __launch_bounds__(kThreads) plain(const int4* src, int4* dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride * N) {
    int4 v[N];
#pragma unroll
    for (int u = 0; u < N; ++u)
      if (i + u * stride < n) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < N; ++u)
      if (i + u * stride < n) dst[i + u * stride] = v[u];
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads) row(const char* src, char* dst, int rows, size_t row_bytes) {
  const int lane = threadIdx.x % 32, warps = gridDim.x * (kThreads / 32);
  const size_t n = row_bytes / 16;
  for (int r = (blockIdx.x * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const int4* s = reinterpret_cast<const int4*>(src + size_t(r) * row_bytes);
    int4* d = reinterpret_cast<int4*>(dst + size_t(r) * row_bytes);
    for (size_t i = lane; i < n; i += N * 32) {
      int4 v[N];
#pragma unroll
      for (int u = 0; u < N; ++u)
        if (i + u * 32 < n) v[u] = s[i + u * 32];
#pragma unroll
      for (int u = 0; u < N; ++u)
        if (i + u * 32 < n) d[i + u * 32] = v[u];
    }
  }
}

template <typename Run>
double gbps(Run run, size_t bytes, int iters) {
  static cudaEvent_t a, b;
  static bool made = false;
  if (!made) {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    made = true;
  }
  run();
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(a, 0));
  for (int i = 0; i < iters; ++i) run();
  CHECK(cudaEventRecord(b, 0));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return double(bytes) * iters / (ms * 1e-3) / 1e9;
}

struct TmaConfig {
  int pipes, stages;
  uint32_t chunk;
  int in_flight;  // stores
};

}  // namespace

int main() {
  const size_t bytes = size_t(kRows) * kRowBytes;
  char *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMemset(src, 1, bytes));
  const int iters = 20;
  const int grids[] = {16, 24, 32, 48};
  const TmaConfig tmas[] = {{3, 4, 16384, 1},  {3, 4, 16384, 2},  {1, 12, 16384, 1},
                            {1, 12, 16384, 4}, {2, 6, 16384, 2},  {6, 2, 16384, 1},
                            {2, 3, 32768, 1},  {1, 6, 32768, 2},  {4, 6, 8192, 2},
                            {8, 3, 8192, 1},   {12, 4, 4096, 2},  {3, 4, 14336, 1},
                            {4, 3, 14336, 1},  {2, 6, 14336, 2},  {1, 13, 14336, 4}};
  int smem = 0;  // the largest configuration's
  for (const TmaConfig& t : tmas) smem = std::max(smem, 1024 + t.pipes * t.stages * int(t.chunk));
  CHECK(cudaFuncSetAttribute(tma_copy<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(tma_copy<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(tma_copy<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::printf("one GPU, %zu MB copied per launch (%d rows of %zu bytes); GB/s copied "
              "(the memory moves twice that)\n| variant |", bytes >> 20, kRows, kRowBytes);
  for (int g : grids) std::printf(" %d CTAs |", g);
  std::printf("\n|---|");
  for (size_t i = 0; i < sizeof(grids) / sizeof(grids[0]); ++i) std::printf("---:|");
  std::printf("\n");
  auto row_of = [&](const char* name, auto launch) {
    std::printf("| %s |", name);
    for (int g : grids) std::printf(" %.0f |", gbps([&] { launch(g); }, bytes, iters));
    std::printf("\n");
  };
  const int4* s4 = reinterpret_cast<const int4*>(src);
  int4* d4 = reinterpret_cast<int4*>(dst);
  row_of("plain<8>", [&](int g) { plain<8><<<g, kThreads>>>(s4, d4, bytes / 16); });
  row_of("plain<16>", [&](int g) { plain<16><<<g, kThreads>>>(s4, d4, bytes / 16); });
  row_of("plain<20>", [&](int g) { plain<20><<<g, kThreads>>>(s4, d4, bytes / 16); });
  row_of("row<16> (the gathers' copy_row)",
         [&](int g) { row<16><<<g, kThreads>>>(src, dst, kRows, kRowBytes); });
  row_of("row<8>", [&](int g) { row<8><<<g, kThreads>>>(src, dst, kRows, kRowBytes); });
  for (const TmaConfig& t : tmas) {
    char name[96];
    std::snprintf(name, sizeof(name), "tma %d×%d×%u B, %d store%s in flight", t.pipes, t.stages,
                  t.chunk, t.in_flight, t.in_flight > 1 ? "s" : "");
    const size_t smem = 1024 + size_t(t.pipes) * t.stages * t.chunk;
    const size_t whole = bytes / t.chunk * t.chunk;  // whole chunks only
    row_of(name, [&](int g) {
      if (t.in_flight == 1) tma_copy<1><<<g, kThreads, smem>>>(src, dst, whole, t.chunk, t.pipes, t.stages);
      else if (t.in_flight == 2) tma_copy<2><<<g, kThreads, smem>>>(src, dst, whole, t.chunk, t.pipes, t.stages);
      else tma_copy<4><<<g, kThreads, smem>>>(src, dst, whole, t.chunk, t.pipes, t.stages);
    });
  }
  std::printf("copy engine (one cudaMemcpyAsync): %.0f GB/s\n",
              gbps([&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0)); },
                   bytes, iters));
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 0;
}
