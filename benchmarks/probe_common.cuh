// What the standalone probes (nvlink_store_probe.cu, local_copy_probe.cu) share: the
// bulk-copy helpers (bulk_copy.cuh) and a CUDA error check that ends the probe.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "bulk_copy.cuh"

using jax_ep::barrier_init;
using jax_ep::barrier_wait;
using jax_ep::bulk_commit;
using jax_ep::bulk_load;
using jax_ep::bulk_store;
using jax_ep::bulk_wait_all;
using jax_ep::bulk_wait_read;

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// Bulk (TMA) copy of `bytes` (whole chunks) into local memory or a peer's. Thread 0 of the
// first `pipes` warps: piece j of a pipeline is loaded into stage j % stages and stored from
// there; a stage is refilled once the store that read it has read it, G stores left in flight
// (G < stages).
template <int G>
__global__ void tma_copy(const char* src, char* dst, size_t bytes, uint32_t chunk, int pipes,
                         int stages) {
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= pipes || lane != 0) return;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + size_t(warp) * stages;
  char* bufs = smem + 1024 + size_t(warp) * stages * chunk;
  for (int s = 0; s < stages; ++s) barrier_init(&bars[s]);
  const size_t chunks = bytes / chunk, pipe = size_t(blockIdx.x) * pipes + warp;
  const size_t all = size_t(gridDim.x) * pipes;
  auto load = [&](size_t j) {
    const size_t c = pipe + j * all;
    if (c < chunks) bulk_load(bufs + (j % stages) * chunk, src + c * chunk, chunk, &bars[j % stages]);
  };
  for (int s = 0; s < stages; ++s) load(s);
  for (size_t j = 0; pipe + j * all < chunks; ++j) {
    barrier_wait(&bars[j % stages], uint32_t(j / stages) & 1);
    bulk_store(dst + (pipe + j * all) * chunk, bufs + (j % stages) * chunk, chunk);
    bulk_commit();
    if (j >= G) {
      bulk_wait_read<G>();  // the store of piece j - G has read its stage
      load(j - G + stages);
    }
  }
  bulk_wait_all();
}
