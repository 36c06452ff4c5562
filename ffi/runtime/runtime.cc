// NVSHMEM-backed implementation of the runtime interface (runtime.h).
#include "runtime/runtime.h"

#include "runtime/control.h"
#include "runtime/diagnostics.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace jax_ep {
namespace {

std::mutex g_mutex;
Transport g_transport;
bool g_initialized = false;
int g_device = -1;
// True while NVSHMEM runs because we started it; an NVSHMEM someone else in the process
// started is reused and left running at finalize().
bool g_owns_nvshmem = false;
void** g_peers_device = nullptr;
void** g_ll_peers_device = nullptr;
std::vector<void*> g_host_peers;
std::vector<int> g_node_of;  // node of every PE (InitOptions::node_of)
cudaStream_t g_copy_stream = nullptr;
cudaEvent_t g_copy_fork = nullptr, g_copy_join = nullptr;
// XLA's allocations of this node's PEs (open_xla_windows): the device array the kernels read,
// and the peers' mappings to close at finalize.
XlaWindow* g_xla_windows_device = nullptr;
std::vector<std::pair<CUdeviceptr, size_t>> g_xla_opened;  // (address, bytes)

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("jax_ep runtime: " + message);
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(status));
}

std::string rank_text(int rank, int num_ranks) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(num_ranks);
}

// Settings NVSHMEM reads at initialisation. A user's own value always wins, except multicast
// (NVLS), which is forced off: it can take a shared host's GPUs out of service.
void set_environment_defaults(size_t buffer_bytes, size_t ll_bytes, bool single_host) {
  setenv("NVSHMEM_DISABLE_NVLS", "1", /*overwrite=*/1);
  if (single_host) {
    setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo", /*overwrite=*/0);
    setenv("NVSHMEM_REMOTE_TRANSPORT", "none", /*overwrite=*/0);
  }
  // The heap holds our buffer plus NVSHMEM's own allocations (teams, barriers, signals).
  // A user's value wins; ours from an earlier initialisation (smaller buffers) does not.
  static std::string ours;
  const char* current = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  const size_t heap = buffer_bytes + ll_bytes + (size_t(256) << 20);
  if (current == nullptr || (!ours.empty() && ours == current)) {
    ours = std::to_string(heap);
    setenv("NVSHMEM_SYMMETRIC_SIZE", ours.c_str(), /*overwrite=*/1);
  }
}

std::string compiled_nvshmem_version() {
  return std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

// The device library is linked statically into the module while the host library is loaded
// from the environment: a mismatch corrupts NVSHMEM's shared device state, so refuse it.
void check_nvshmem_versions() {
  const std::string loaded = nvshmem_version(), compiled = compiled_nvshmem_version();
  if (loaded != compiled) {
    fail("jax_ep._C was built against NVSHMEM " + compiled + " but loaded NVSHMEM " + loaded +
         "'s host library. Rebuild in this environment (pip install --no-build-isolation .) "
         "or install the matching nvidia-nvshmem wheel");
  }
}

bool nvshmem_running() {
  const int status = nvshmemx_init_status();
  return status >= NVSHMEM_STATUS_IS_INITIALIZED && status != NVSHMEM_STATUS_INVALID;
}

void start_nvshmem(const InitOptions& options) {
  if (options.unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    fail("the unique id has " + std::to_string(options.unique_id.size()) +
         " bytes, NVSHMEM's has " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  }
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, options.unique_id.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(options.rank, options.num_ranks, &uid, &attr);
  if (status == 0) {
    // What nvshmemx_init_attr() does, minus its exit(-1) on failure: a failed bootstrap must
    // reach Python as an exception, not end the process silently.
    int provided = 0;
    const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION,
                                        NVSHMEM_VENDOR_MINOR_VERSION,
                                        NVSHMEM_VENDOR_PATCH_VERSION};
    status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                  NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  }
  if (status != 0) {
    fail("NVSHMEM initialisation failed with status " + std::to_string(status) + " (" +
         rank_text(options.rank, options.num_ranks) +
         "); NVSHMEM_DEBUG=INFO shows why. Every rank must call initialize() with the same "
         "unique id");
  }
  g_owns_nvshmem = true;
}

// nvshmem_malloc (collective, same size on every PE), zeroed before any peer may signal into it.
void* allocate_symmetric(size_t bytes, const char* what, int me, int n) {
  void* local = nvshmem_malloc(bytes);
  if (local == nullptr) {
    fail("could not allocate the " + std::to_string(bytes) + "-byte " + what + " (" +
         rank_text(me, n) +
         "). XLA's preallocated pool may hold the GPU memory: start JAX with "
         "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.6) or XLA_PYTHON_CLIENT_PREALLOCATE=false; "
         "NVSHMEM_SYMMETRIC_SIZE, if you set it, must exceed the buffers; or ask for a smaller "
         "buffer");
  }
  // Flags in the buffer start at zero on every PE before any peer may signal into it.
  check_cuda(cudaMemset(local, 0, bytes), "zeroing a symmetric buffer");
  check_cuda(cudaDeviceSynchronize(), "zeroing a symmetric buffer");
  return local;
}

// The driver's virtual-memory calls, through the runtime's entry points: the module links no
// libcuda. Throws when the driver lacks one.
template <typename F>
F driver_entry(const char* name) {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check_cuda(cudaGetDriverEntryPointByVersion(name, &entry, 12000, cudaEnableDefault, &found),
             name);
  if (found != cudaDriverEntryPointSuccess || entry == nullptr)
    fail(std::string("the driver has no ") + name);
  return reinterpret_cast<F>(entry);
}

void check_cu(CUresult status, const std::string& what) {
  if (status != CUDA_SUCCESS) fail(what + " failed (CUresult " + std::to_string(status) + ")");
}

// The peers' mappings of XLA's allocations, unmapped (after every kernel that read them).
void close_xla_windows() {
  if (!g_xla_opened.empty()) {
    auto unmap = driver_entry<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
    auto free_range = driver_entry<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
    for (const auto& [va, bytes] : g_xla_opened) {
      unmap(va, bytes);
      free_range(va, bytes);
    }
  }
  g_xla_opened.clear();
  cudaFree(g_xla_windows_device);
  g_xla_windows_device = nullptr;
  g_transport.xla_windows = nullptr;
  g_transport.xla_base = g_transport.xla_size = 0;
}

// Device array [n] of every PE's copy of `local` as mapped into this process (and, when
// host_copy is given, the same table on the host). PEs on another node (node_of) stay
// nullptr: the kernels reach peers of their own node only, and a call whose EP group leaves
// the node is refused by its handler, naming the peer. A PE of this node that cannot be
// mapped is an error here.
void** map_peers(void* local, int me, int n, const std::vector<int>& node_of,
                 std::vector<void*>* host_copy = nullptr) {
  std::vector<void*> peers(n, nullptr);
  for (int pe = 0; pe < n; ++pe) {
    if (node_of[pe] != node_of[me]) continue;
    peers[pe] = nvshmem_ptr(local, pe);
    if (peers[pe] == nullptr) {
      fail("PE " + std::to_string(pe) + "'s buffer cannot be mapped into PE " +
           std::to_string(me) + " (no peer-to-peer access) although both are on node " +
           std::to_string(node_of[me]) + "; jax_ep reaches the peers of a node over "
           "NVLink/PCIe");
    }
  }
  void** peers_device = nullptr;
  cudaError_t status = cudaMalloc(&peers_device, sizeof(void*) * n);
  if (status == cudaSuccess) {
    status = cudaMemcpy(peers_device, peers.data(), sizeof(void*) * n, cudaMemcpyHostToDevice);
  }
  if (status != cudaSuccess) {
    cudaFree(peers_device);
    check_cuda(status, "copying the peer table to the GPU");
  }
  if (host_copy != nullptr) *host_copy = peers;
  return peers_device;
}

// Whether the GPUs with PCI bus ids a and b are joined by NVLink, by NVML (loaded at run time:
// the driver ships it; false where it is missing or does not know).
bool nvlink_between(const std::string& a, const std::string& b) {
  using Init = int (*)();
  using Shutdown = int (*)();
  using ByBusId = int (*)(const char*, void**);
  using P2PStatus = int (*)(void*, void*, int, int*);
  constexpr int kCapsNvlink = 2, kStatusOk = 0;  // NVML_P2P_CAPS_INDEX_NVLINK, _STATUS_OK
  static void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<Shutdown>(dlsym(lib, "nvmlShutdown"));
  auto by_bus_id = reinterpret_cast<ByBusId>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  auto p2p_status = reinterpret_cast<P2PStatus>(dlsym(lib, "nvmlDeviceGetP2PStatus"));
  if (init == nullptr || shutdown == nullptr || by_bus_id == nullptr || p2p_status == nullptr ||
      init() != 0)
    return false;
  void* da = nullptr;
  void* db = nullptr;
  int status = -1;
  const bool joined = by_bus_id(a.c_str(), &da) == 0 && by_bus_id(b.c_str(), &db) == 0 &&
                      p2p_status(da, db, kCapsNvlink, &status) == 0 && status == kStatusOk;
  shutdown();
  return joined;
}

// Whether a 128-byte line that one warp instruction stores reaches every PE of this node whole,
// which the low-latency calls' reads of lines as they land lean on (docs/design.md, section
// 6.2): as NCCL's LL128 protocol, only over NVLink (or within one GPU); over PCIe a line may
// land in pieces. Collective over every PE: each publishes its GPU's PCI bus id, then its
// verdict on its node's pairs, in a small symmetric allocation, and every PE of a node takes
// the same AND (a sender that raises no arrival beside a receiver that waits for one would
// hang). A CUDA call that fails here makes the verdict false, never skips a barrier.
bool lines_land_whole(int me, int n, int device, const std::vector<int>& node_of) {
  constexpr size_t kId = 32;  // bytes of a PCI bus id ("0000:3b:00.0" and its terminator)
  char* scratch = static_cast<char*>(nvshmem_malloc(kId + 8));
  if (scratch == nullptr) fail("could not allocate the runtime's topology exchange");
  auto peer = [&](int pe) { return static_cast<char*>(nvshmem_ptr(scratch, pe)); };
  char mine[kId] = {};
  bool whole = cudaMemset(scratch, 0, kId + 8) == cudaSuccess &&  // a verdict not set reads 0
               cudaDeviceGetPCIBusId(mine, int(kId), device) == cudaSuccess &&
               cudaMemcpy(scratch, mine, kId, cudaMemcpyHostToDevice) == cudaSuccess;
  nvshmem_barrier_all();
  for (int pe = 0; pe < n && whole; ++pe) {
    if (pe == me || node_of[pe] != node_of[me]) continue;
    char theirs[kId] = {};
    whole = peer(pe) != nullptr &&
            cudaMemcpy(theirs, peer(pe), kId, cudaMemcpyDeviceToHost) == cudaSuccess;
    theirs[kId - 1] = 0;
    whole = whole && (std::strcmp(mine, theirs) == 0 || nvlink_between(mine, theirs));
  }
  const char verdict = whole ? 1 : 0;
  if (cudaMemcpy(scratch + kId, &verdict, 1, cudaMemcpyHostToDevice) != cudaSuccess)
    whole = false;  // the peers read the 0 set above
  nvshmem_barrier_all();
  for (int pe = 0; pe < n; ++pe) {
    if (pe == me || node_of[pe] != node_of[me]) continue;
    char theirs = 0;
    whole = whole && peer(pe) != nullptr &&
            cudaMemcpy(&theirs, peer(pe) + kId, 1, cudaMemcpyDeviceToHost) == cudaSuccess &&
            theirs != 0;
  }
  nvshmem_barrier_all();  // every PE has read before any frees
  nvshmem_free(scratch);
  return whole;
}

// The stream and events of the copy-engine paths (non-blocking: it orders only by events).
void create_copy_engine_stream() {
  check_cuda(cudaStreamCreateWithFlags(&g_copy_stream, cudaStreamNonBlocking),
             "creating the copy-engine stream");
  check_cuda(cudaEventCreateWithFlags(&g_copy_fork, cudaEventDisableTiming),
             "creating a copy-engine event");
  check_cuda(cudaEventCreateWithFlags(&g_copy_join, cudaEventDisableTiming),
             "creating a copy-engine event");
}

void destroy_copy_engine_stream() {
  if (g_copy_stream != nullptr) cudaStreamDestroy(g_copy_stream);
  if (g_copy_fork != nullptr) cudaEventDestroy(g_copy_fork);
  if (g_copy_join != nullptr) cudaEventDestroy(g_copy_join);
  g_copy_stream = nullptr;
  g_copy_fork = g_copy_join = nullptr;
}

}  // namespace

const Transport* transport() { return g_initialized ? &g_transport : nullptr; }

bool is_initialized() { return g_initialized; }

size_t unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

std::string nvshmem_version() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string create_unique_id() {
  check_nvshmem_versions();
  setenv("NVSHMEM_DISABLE_NVLS", "1", /*overwrite=*/1);
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&uid);
  if (status != 0) fail("nvshmemx_get_uniqueid failed with status " + std::to_string(status));
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

void initialize(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_initialized) {
    if (options.rank != g_transport.rank || options.num_ranks != g_transport.num_ranks) {
      fail("already initialised as " + rank_text(g_transport.rank, g_transport.num_ranks) +
           "; call finalize() first");
    }
    if (options.buffer_bytes > g_transport.bytes) {
      fail("already initialised with a " + std::to_string(g_transport.bytes) +
           "-byte buffer, " + std::to_string(options.buffer_bytes) +
           " bytes requested; call finalize() first");
    }
    if (options.low_latency_bytes > g_transport.ll_bytes) {
      fail("already initialised with a " + std::to_string(g_transport.ll_bytes) +
           "-byte low-latency buffer, " + std::to_string(options.low_latency_bytes) +
           " bytes requested; call finalize() first");
    }
    return;
  }
  if (options.num_ranks < 1 || options.rank < 0 || options.rank >= options.num_ranks) {
    fail("invalid " + rank_text(options.rank, options.num_ranks));
  }
  if (options.buffer_bytes == 0) fail("buffer_bytes must be positive");
  check_nvshmem_versions();
  check_cuda(cudaSetDevice(options.local_device),
             ("cudaSetDevice(" + std::to_string(options.local_device) + ")").c_str());
  set_environment_defaults(options.buffer_bytes, options.low_latency_bytes, options.single_host);
  if (!nvshmem_running()) start_nvshmem(options);

  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  if (me != options.rank || n != options.num_ranks) {
    fail("NVSHMEM runs as PE " + std::to_string(me) + " of " + std::to_string(n) +
         " but this process is " + rank_text(options.rank, options.num_ranks));
  }

  g_node_of = options.node_of.empty() ? std::vector<int>(n, 0) : options.node_of;
  if (static_cast<int>(g_node_of.size()) != n)
    fail("node_of names " + std::to_string(g_node_of.size()) + " PEs, NVSHMEM runs " +
         std::to_string(n));
  void* local = allocate_symmetric(options.buffer_bytes, "symmetric buffer", me, n);
  void** peers_device = nullptr;
  try {
    peers_device = map_peers(local, me, n, g_node_of, &g_host_peers);
    create_copy_engine_stream();
  } catch (...) {
    destroy_copy_engine_stream();
    nvshmem_free(local);  // collective: reachability is symmetric, so every PE gets here
    throw;
  }
  void* ll_local = nullptr;
  void** ll_peers_device = nullptr;
  if (options.low_latency_bytes > 0) {
    try {
      ll_local = allocate_symmetric(options.low_latency_bytes, "low-latency buffer", me, n);
      ll_peers_device = map_peers(ll_local, me, n, g_node_of);
    } catch (...) {
      if (ll_local != nullptr) nvshmem_free(ll_local);
      destroy_copy_engine_stream();
      cudaFree(peers_device);
      nvshmem_free(local);
      throw;
    }
  }
  nvshmem_barrier_all();
  const bool whole_lines = lines_land_whole(me, n, options.local_device, g_node_of);

  g_device = options.local_device;
  g_peers_device = peers_device;
  g_ll_peers_device = ll_peers_device;
  g_transport.ll_local = ll_local;
  g_transport.ll_bytes = ll_local != nullptr ? options.low_latency_bytes : 0;
  g_transport.ll_peers = ll_peers_device;
  g_transport.rank = me;
  g_transport.num_ranks = n;
  g_transport.local = local;
  g_transport.bytes = options.buffer_bytes;
  g_transport.peers = peers_device;
  g_transport.host_peers = g_host_peers.data();
  g_transport.node_of = g_node_of.data();
  g_transport.spans_nodes = false;
  for (int pe = 0; pe < n; ++pe) g_transport.spans_nodes |= g_node_of[pe] != g_node_of[me];
  g_transport.whole_lines = whole_lines;
  g_transport.copy_stream = g_copy_stream;
  g_transport.copy_fork = g_copy_fork;
  g_transport.copy_join = g_copy_join;
  g_initialized = true;
  start_fault_watchdog();
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_initialized) return;
  // May run on a thread (atexit) whose current device is not ours.
  cudaSetDevice(g_device);
  cudaDeviceSynchronize();  // kernels still reading peers' buffers finish first
  stop_fault_watchdog();
  nvshmem_barrier_all();    // ... on every PE, before anyone frees
  nvshmem_free(g_transport.local);
  if (g_transport.ll_local != nullptr) nvshmem_free(g_transport.ll_local);
  cudaFree(g_peers_device);
  cudaFree(g_ll_peers_device);
  close_xla_windows();
  destroy_copy_engine_stream();
  g_host_peers.clear();
  g_node_of.clear();
  g_peers_device = nullptr;
  g_ll_peers_device = nullptr;
  g_transport = Transport{};
  g_initialized = false;
  if (g_owns_nvshmem) {
    nvshmem_finalize();
    g_owns_nvshmem = false;
  }
}

int export_xla_window(uint64_t ptr, uint64_t* base, uint64_t* size) {
  auto range = driver_entry<CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr)>(
      "cuMemGetAddressRange");
  CUdeviceptr start = 0;
  size_t bytes = 0;
  check_cu(range(&start, &bytes, static_cast<CUdeviceptr>(ptr)),
           "cuMemGetAddressRange(a JAX array's buffer)");
  *base = start;
  *size = bytes;
  // XLA's allocator maps its memory through the virtual-memory API with file-descriptor
  // handles; an allocation made otherwise (cudaMalloc) has no handle to retain: no window.
  auto retain = driver_entry<CUresult (*)(CUmemGenericAllocationHandle*, void*)>(
      "cuMemRetainAllocationHandle");
  auto export_fd = driver_entry<CUresult (*)(void*, CUmemGenericAllocationHandle,
                                             CUmemAllocationHandleType, unsigned long long)>(
      "cuMemExportToShareableHandle");
  auto release = driver_entry<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
  CUmemGenericAllocationHandle handle = 0;
  if (retain(&handle, reinterpret_cast<void*>(start)) != CUDA_SUCCESS) return -1;
  int fd = -1;
  const CUresult exported =
      export_fd(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  release(handle);
  return exported == CUDA_SUCCESS ? fd : -1;
}

void open_xla_windows(const std::vector<int>& fds, const std::vector<uint64_t>& bases,
                      const std::vector<uint64_t>& sizes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_initialized) fail("open_xla_windows before initialize");
  const int n = g_transport.num_ranks, me = g_transport.rank;
  if (static_cast<int>(fds.size()) != n || static_cast<int>(bases.size()) != n ||
      static_cast<int>(sizes.size()) != n)
    fail("open_xla_windows needs a descriptor, base and size for each of the " +
         std::to_string(n) + " PEs");
  close_xla_windows();
  std::vector<XlaWindow> windows(n, XlaWindow{0, 0, 0});
  try {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    for (int pe = 0; pe < n; ++pe) {
      if (fds[pe] < 0 || g_node_of[pe] != g_node_of[me]) continue;
      if (pe == me) {
        windows[pe] = XlaWindow{bases[pe], bases[pe], sizes[pe]};
        continue;
      }
      const std::string of = "(XLA's allocation of PE " + std::to_string(pe) + ")";
      auto import_fd = driver_entry<CUresult (*)(CUmemGenericAllocationHandle*, void*,
                                                 CUmemAllocationHandleType)>(
          "cuMemImportFromShareableHandle");
      auto reserve = driver_entry<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                               unsigned long long)>("cuMemAddressReserve");
      auto map = driver_entry<CUresult (*)(CUdeviceptr, size_t, size_t,
                                           CUmemGenericAllocationHandle, unsigned long long)>(
          "cuMemMap");
      auto access = driver_entry<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*,
                                              size_t)>("cuMemSetAccess");
      auto release = driver_entry<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
      CUmemGenericAllocationHandle handle = 0;
      check_cu(import_fd(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fds[pe])),
                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               "cuMemImportFromShareableHandle" + of);
      CUdeviceptr va = 0;
      const CUresult reserved = reserve(&va, sizes[pe], 0, 0, 0);
      if (reserved != CUDA_SUCCESS) release(handle);
      check_cu(reserved, "cuMemAddressReserve" + of);
      const CUresult mapped = map(va, sizes[pe], 0, handle, 0);
      release(handle);  // the mapping holds the allocation from here
      if (mapped != CUDA_SUCCESS) {
        driver_entry<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree")(va, sizes[pe]);
        check_cu(mapped, "cuMemMap" + of);
      }
      g_xla_opened.emplace_back(va, sizes[pe]);
      CUmemAccessDesc desc{};
      desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc.location.id = device;
      desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      check_cu(access(va, sizes[pe], &desc, 1), "cuMemSetAccess" + of);
      windows[pe] = XlaWindow{static_cast<uint64_t>(va), bases[pe], sizes[pe]};
    }
    void* table = nullptr;
    check_cuda(cudaMalloc(&table, sizeof(XlaWindow) * n), "cudaMalloc(XLA windows)");
    g_xla_windows_device = static_cast<XlaWindow*>(table);
    check_cuda(cudaMemcpy(table, windows.data(), sizeof(XlaWindow) * n, cudaMemcpyHostToDevice),
               "cudaMemcpy(XLA windows)");
  } catch (...) {
    close_xla_windows();
    throw;
  }
  g_transport.xla_windows = g_xla_windows_device;
  g_transport.xla_base = windows[me].remote;
  g_transport.xla_size = windows[me].size;
}

}  // namespace jax_ep
