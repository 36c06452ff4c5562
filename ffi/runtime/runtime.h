// Process-wide communication runtime: one process per GPU, NVSHMEM symmetric heap.
//
// Kernels never talk to NVSHMEM's host API directly; they receive a Transport
// (peer base pointers of the symmetric buffer) so that a CUDA-peer-access or an
// RDMA transport can replace NVSHMEM later without touching the kernels' callers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct CUstream_st;  // cudaStream_t and cudaEvent_t, without the CUDA headers
struct CUevent_st;

namespace jax_ep {

struct XlaWindow;  // runtime/control.h

// What a kernel needs to reach its peers. All pointers are device pointers.
struct Transport {
  int rank = -1;             // this process's PE == index along the EP mesh axis
  int num_ranks = 0;         // PEs taking part
  void* local = nullptr;     // this PE's symmetric buffer
  size_t bytes = 0;          // usable bytes of the symmetric buffer (same on every PE)
  void* const* peers = nullptr;  // device array [num_ranks]: base of PE r's symmetric buffer
                                 // as mapped into this process (nvshmem_ptr); peers[rank] == local
  // The low-latency buffer: a second symmetric allocation (absent when ll_bytes == 0), so
  // that low-latency calls never collide with normal-mode calls.
  void* ll_local = nullptr;
  size_t ll_bytes = 0;
  void* const* ll_peers = nullptr;  // device array [num_ranks], like peers
  // The same bases as `peers`, on the host: copy-engine transfers are enqueued there.
  // peers[pe] and host_peers[pe] are nullptr for a PE on another node (node_of).
  void* const* host_peers = nullptr;
  const int* node_of = nullptr;  // host array [num_ranks]: the node of every PE
  bool spans_nodes = false;      // some PE is on another node than this one
  // A 128-byte line one warp instruction stores reaches every PE of this node whole: every two
  // GPUs of the node joined by NVLink, or one GPU (the same on every PE of the node). Where
  // not, the low-latency calls never read lines as they land (lines_land_whole, runtime.cc).
  bool whole_lines = false;
  // Copy-engine paths: the stream their cached graphs launch on, the event that lets it start
  // after the caller's stream, and the event the caller's stream waits on at the end.
  CUstream_st* copy_stream = nullptr;
  CUevent_st* copy_fork = nullptr;
  CUevent_st* copy_join = nullptr;
  // XLA's allocations of this node's PEs mapped here (open_xla_windows; nullptr before):
  // device array [num_ranks] of XlaWindow, and this PE's own window on the host.
  const XlaWindow* xla_windows = nullptr;
  uint64_t xla_base = 0, xla_size = 0;
};
// Returns nullptr when initialize() has not run (the FFI handlers turn that into an error).
const Transport* transport();

// Host side, called from Python through the nanobind module.
struct InitOptions {
  int rank = 0;
  int num_ranks = 1;
  int local_device = 0;          // CUDA device of this process
  size_t buffer_bytes = 0;       // symmetric buffer size per PE
  size_t low_latency_bytes = 0;  // low-latency buffer size per PE (0: none)
  std::string unique_id;         // bytes of nvshmemx_uniqueid_t (from process 0)
  bool single_host = true;       // default NVSHMEM to loopback bootstrap, no remote transport
  // The node of every PE (empty: one node). The kernels reach the PEs of this PE's node only;
  // runtime.initialize derives it from the hosts' names, or from its node_size for tests.
  std::vector<int> node_of;
};
std::string create_unique_id();                 // process 0 only
void initialize(const InitOptions& options);    // throws std::runtime_error with a clear message
void finalize();                                // idempotent
bool is_initialized();
size_t unique_id_size();
std::string nvshmem_version();                  // of the host library loaded at run time
// The allocation of XLA's that holds device pointer `ptr` (a JAX array's buffer): its base and
// size, and a file descriptor exporting it (virtual-memory API), or -1 when it cannot be
// exported. The caller owns the descriptor.
int export_xla_window(uint64_t ptr, uint64_t* base, uint64_t* size);
// Maps every other PE of this node's exported allocation (fds[pe]: the descriptor received
// from PE pe's export_xla_window, -1 maps nothing; bases[pe], sizes[pe] as it exported them)
// and makes the windows visible to the kernels. Throws if one does not map; the caller keeps
// the descriptors.
void open_xla_windows(const std::vector<int>& fds, const std::vector<uint64_t>& bases,
                      const std::vector<uint64_t>& sizes);

}  // namespace jax_ep
