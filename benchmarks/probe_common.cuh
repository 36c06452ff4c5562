// What the standalone probes (nvlink_store_probe.cu, local_copy_probe.cu) share: the
// extension's bulk-copy helpers and a CUDA error check that ends the probe.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "../ffi/kernels/bulk_copy.cuh"

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
