// The cost of the closing steps of a call on two GPUs (fences, release stores, the last-block
// counter) and a flag's round trip over NVLink, each timed by one thread of GPU 0 over many
// repetitions. One process, both GPUs, CUDA peer access.
//
//   nvcc -O3 -arch=sm_90 benchmarks/signal_probe.cu -o build/signal_probe && build/signal_probe
#include <cstdint>
#include <cstdio>

#include "probe_common.cuh"

namespace {

constexpr int kReps = 200;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_ar_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_ar_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void st_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

constexpr const char* kNames[] = {
    "nothing (timer)",
    "fence.sc.sys",
    "fence.acq_rel.sys",
    "fence.acq_rel.gpu",
    "local store + fence.sc.sys",
    "local store + fence.acq_rel.sys",
    "peer store + fence.sc.sys",
    "peer store + fence.acq_rel.sys",
    "st.release.sys to the peer",
    "st.release.sys to self, then to the peer (a 2-rank signal)",
    "fence.acq_rel.sys, st.relaxed to self and the peer",
    "4 pointer stores (2 peer), then 2 st.release.sys (the stage's close)",
    "4 pointer stores (2 peer), fence.acq_rel.sys, 2 st.relaxed",
    "fence.sc.sys + atomicAdd local (a block's arrival)",
    "fence.acq_rel.sys + atomicAdd local",
    "warp: 32 peer stores + fence.acq_rel.sys",
};
constexpr int kVariants = sizeof(kNames) / sizeof(kNames[0]);

// Thread 0 (or the warp, variant 15) repeats variant v kReps times; ns per repetition.
__global__ void closing_steps(uint64_t* local, uint64_t* peer, unsigned* counter, int v,
                              double* out) {
  const int lane = threadIdx.x;
  if (v != 15 && lane != 0) return;
  const uint64_t start = now_ns();
  for (int i = 1; i <= kReps; ++i) {
    switch (v) {
      case 0: break;
      case 1: fence_sc_sys(); break;
      case 2: fence_ar_sys(); break;
      case 3: fence_ar_gpu(); break;
      case 4: local[8] = i; fence_sc_sys(); break;
      case 5: local[8] = i; fence_ar_sys(); break;
      case 6: peer[8] = i; fence_sc_sys(); break;
      case 7: peer[8] = i; fence_ar_sys(); break;
      case 8: st_release(&peer[0], i); break;
      case 9: st_release(&local[0], i); st_release(&peer[0], i); break;
      case 10: fence_ar_sys(); st_relaxed(&local[0], i); st_relaxed(&peer[0], i); break;
      case 11:
        local[2] = i; local[3] = i; peer[2] = i; peer[3] = i;
        st_release(&local[0], i); st_release(&peer[0], i);
        break;
      case 12:
        local[2] = i; local[3] = i; peer[2] = i; peer[3] = i;
        fence_ar_sys(); st_relaxed(&local[0], i); st_relaxed(&peer[0], i);
        break;
      case 13: fence_sc_sys(); atomicAdd(counter, 1u); break;
      case 14: fence_ar_sys(); atomicAdd(counter, 1u); break;
      case 15: peer[16 + lane] = i; fence_ar_sys(); break;
    }
  }
  __syncwarp();
  if (lane == 0) *out = double(now_ns() - start) / kReps;
}

// Ping-pong: GPU 0 raises the flag at GPU 1, which answers at GPU 0; ns per round trip.
__global__ void ping(uint64_t* at_peer, const uint64_t* mine, double* out) {
  const uint64_t start = now_ns();
  for (uint64_t i = 1; i <= kReps; ++i) {
    st_release(at_peer, i);
    while (ld_acquire(mine) != i) {
    }
  }
  *out = double(now_ns() - start) / kReps;
}
__global__ void pong(uint64_t* at_peer, const uint64_t* mine) {
  for (uint64_t i = 1; i <= kReps; ++i) {
    while (ld_acquire(mine) != i) {
    }
    st_release(at_peer, i);
  }
}

}  // namespace

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::fprintf(stderr, "needs two GPUs\n");
    return 1;
  }
  uint64_t* buf[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaMalloc(&buf[d], 4096));
    CHECK(cudaMemset(buf[d], 0, 4096));
  }
  CHECK(cudaSetDevice(0));
  unsigned* counter = nullptr;
  double* out = nullptr;
  CHECK(cudaMalloc(&counter, sizeof(unsigned)));
  CHECK(cudaMallocManaged(&out, sizeof(double)));
  std::printf("| step (thread 0 of GPU 0; the peer is GPU 1) | ns |\n|---|---:|\n");
  for (int v = 0; v < kVariants; ++v) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      closing_steps<<<1, 32>>>(buf[0], buf[1], counter, v, out);
      CHECK(cudaDeviceSynchronize());
      best = *out < best ? *out : best;
    }
    std::printf("| %s | %.0f |\n", kNames[v], best);
  }
  for (int r = 0; r < 3; ++r) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaMemset(buf[d] + 256, 0, 8));
      CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaSetDevice(1));
    pong<<<1, 1>>>(buf[0] + 256, buf[1] + 256);
    CHECK(cudaSetDevice(0));
    ping<<<1, 1>>>(buf[1] + 256, buf[0] + 256, out);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaSetDevice(1));
    CHECK(cudaDeviceSynchronize());
    std::printf("| flag round trip GPU 0 → GPU 1 → GPU 0 (st.release / ld.acquire) | %.0f |\n",
                *out);
  }
  return 0;
}
