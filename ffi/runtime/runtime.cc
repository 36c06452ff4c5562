// NVSHMEM-backed implementation of the runtime interface (runtime.h).
#include "runtime/runtime.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_ep {
namespace {

std::mutex g_mutex;
Transport g_transport;
bool g_initialized = false;
bool g_we_initialized_nvshmem = false;
void** g_peers_device = nullptr;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("jax_ep runtime: ") + what + ": " +
                             cudaGetErrorString(status));
  }
}

// Environment defaults that NVSHMEM reads at init; a user's own setting always wins,
// except multicast (NVLS), which stays off: it can take a shared host's GPUs out of service.
void set_env_defaults(size_t buffer_bytes, bool single_host) {
  setenv("NVSHMEM_DISABLE_NVLS", "1", /*overwrite=*/1);
  if (single_host) {
    setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo", 0);
    setenv("NVSHMEM_REMOTE_TRANSPORT", "none", 0);
  }
  // The symmetric heap must hold our buffer plus NVSHMEM's own allocations.
  size_t heap = buffer_bytes + (size_t(256) << 20);
  setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 0);
}

}  // namespace

const Transport* transport() { return g_initialized ? &g_transport : nullptr; }

bool is_initialized() { return g_initialized; }

std::string create_unique_id() {
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  int status = nvshmemx_get_uniqueid(&uid);
  if (status != 0) {
    throw std::runtime_error("jax_ep runtime: nvshmemx_get_uniqueid failed with status " +
                             std::to_string(status));
  }
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

size_t unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

void initialize(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_initialized) {
    if (options.rank != g_transport.rank || options.num_ranks != g_transport.num_ranks) {
      throw std::runtime_error("jax_ep runtime: already initialised as rank " +
                               std::to_string(g_transport.rank) + " of " +
                               std::to_string(g_transport.num_ranks) + "; call finalize() first");
    }
    if (options.buffer_bytes > g_transport.bytes) {
      throw std::runtime_error("jax_ep runtime: already initialised with a " +
                               std::to_string(g_transport.bytes) + "-byte buffer, " +
                               std::to_string(options.buffer_bytes) +
                               " requested; call finalize() first");
    }
    return;
  }
  if (options.num_ranks < 1 || options.rank < 0 || options.rank >= options.num_ranks) {
    throw std::runtime_error("jax_ep runtime: invalid rank " + std::to_string(options.rank) +
                             " of " + std::to_string(options.num_ranks));
  }
  if (options.buffer_bytes == 0) throw std::runtime_error("jax_ep runtime: buffer_bytes is 0");
  check_cuda(cudaSetDevice(options.local_device), "cudaSetDevice");

  int status = nvshmemx_init_status();
  if (status == NVSHMEM_STATUS_IS_INITIALIZED) {
    // Someone in this process (XLA's own NVSHMEM path, another library) already did: reuse it.
    g_we_initialized_nvshmem = false;
  } else {
    if (options.unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
      throw std::runtime_error("jax_ep runtime: unique id has " +
                               std::to_string(options.unique_id.size()) + " bytes, expected " +
                               std::to_string(sizeof(nvshmemx_uniqueid_t)));
    }
    set_env_defaults(options.buffer_bytes, options.single_host);
    nvshmemx_uniqueid_t uid;
    std::memcpy(&uid, options.unique_id.data(), sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    status = nvshmemx_set_attr_uniqueid_args(options.rank, options.num_ranks, &uid, &attr);
    if (status == 0) status = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    if (status != 0) {
      throw std::runtime_error("jax_ep runtime: NVSHMEM initialisation failed with status " +
                               std::to_string(status) + " (rank " + std::to_string(options.rank) +
                               " of " + std::to_string(options.num_ranks) + ")");
    }
    g_we_initialized_nvshmem = true;
  }
  int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  if (me != options.rank || n != options.num_ranks) {
    throw std::runtime_error("jax_ep runtime: NVSHMEM says PE " + std::to_string(me) + " of " +
                             std::to_string(n) + ", but this process is rank " +
                             std::to_string(options.rank) + " of " +
                             std::to_string(options.num_ranks));
  }

  void* local = nvshmem_malloc(options.buffer_bytes);
  if (local == nullptr) {
    throw std::runtime_error(
        "jax_ep runtime: could not allocate a " + std::to_string(options.buffer_bytes) +
        "-byte symmetric buffer. The GPU memory may be held by XLA's preallocated pool: set "
        "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.7) or XLA_PYTHON_CLIENT_PREALLOCATE=false "
        "before JAX starts, or ask for a smaller buffer");
  }
  check_cuda(cudaMemset(local, 0, options.buffer_bytes), "zeroing the symmetric buffer");

  std::vector<void*> peers(n);
  for (int pe = 0; pe < n; ++pe) {
    peers[pe] = nvshmem_ptr(local, pe);
    if (peers[pe] == nullptr) {
      nvshmem_free(local);
      throw std::runtime_error("jax_ep runtime: PE " + std::to_string(pe) +
                               " is not reachable by peer-to-peer loads and stores from PE " +
                               std::to_string(me) +
                               "; only NVLink/PCIe peers on one host are supported so far");
    }
  }
  check_cuda(cudaMalloc(&g_peers_device, sizeof(void*) * n), "allocating the peer table");
  check_cuda(cudaMemcpy(g_peers_device, peers.data(), sizeof(void*) * n, cudaMemcpyHostToDevice),
             "copying the peer table");
  nvshmem_barrier_all();  // every PE's buffer is zeroed before anyone signals into it

  g_transport.rank = me;
  g_transport.num_ranks = n;
  g_transport.local = local;
  g_transport.bytes = options.buffer_bytes;
  g_transport.peers = g_peers_device;
  g_initialized = true;
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_initialized) return;
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g_transport.local);
  cudaFree(g_peers_device);
  g_peers_device = nullptr;
  g_transport = Transport{};
  g_initialized = false;
  if (g_we_initialized_nvshmem) nvshmem_finalize();
  g_we_initialized_nvshmem = false;
}

std::string nvshmem_version() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace jax_ep
