// Copy-engine transfers: rows cross NVLink by cudaMemcpyAsync on the runtime's copy streams
// instead of SM loads or stores, so the CTAs only copy locally (docs/design.md, section 4.3). The
// dispatch and the combine enqueue these pieces around their kernels.
//
// The copy engine cannot pick rows (its transfers are set on the host, while which rows go
// where is only known on the device), so whole per-source slots of T rows are sent. With few
// ranks a peer needs nearly all of them anyway (top-8 of 256 experts: 99.6 % on 2 ranks, 90 %
// on 4); the Python side selects these paths only there.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "runtime/host_times.h"
#include "runtime/runtime.h"
#include "transport/copy_engine.h"
#include "transport/copy_sequence.cuh"
#include "transport/peers.cuh"

namespace jax_ep {
namespace {

// Host time of the copy-engine calls by kind (a diagnostic: which host calls a copy-engine
// call spends its host time on, benchmarks/RESULTS.md, copy-engine host time), read by copy_engine_host_times().
enum HostKind {
  kHostGuard, kHostFork, kHostMemcpy, kHostFlag, kHostKernel, kHostJoin,
  kHostGraphLaunch, kHostGraphUpdate, kHostGraphBuild, kHostKinds
};
constexpr const char* kHostKindNames[kHostKinds] = {
    "guard", "fork", "memcpy", "flag", "kernel", "join", "graph launch", "graph update",
    "graph build"};
HostTimeRing g_host_times[kHostKinds];

class HostTimer : public ScopedHostTimer {
 public:
  explicit HostTimer(HostKind kind) : ScopedHostTimer(g_host_times[kind]) {}
};

// Every peer has finished the previous call (it no longer reads what lands in its buffer, and
// it has cleared its landed flags), so this call's transfers may start. The combine's reduce
// claims tokens from a work cursor reset here: its stage kernels may run alongside it.
__global__ void wait_peers_finished(PeerContext ctx, bool combine) {
  enter_call(ctx, current_call(ctx), combine ? "combine" : "dispatch");
  if (combine && threadIdx.x == 0) control_of(ctx, ctx.rank)->work_cursor[kCursorCombine] = 0;
}

// Runs after a chunk's transfers: the chunk is in the peer's memory.
__global__ void raise_landed_flag(uint64_t* flag) {
  __threadfence_system();
  store_release(flag, 1);
}

// Driver entry points, found through the runtime (no link to libcuda).
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult result;
#if CUDART_VERSION >= 12050
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &result);
#else
  const cudaError_t status = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &result);
#endif
  if (status != cudaSuccess || result != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<Fn>(fn);
}

// How the landed flags are raised (JAX_EP_COPY_FLAGS, read on every call like
// JAX_EP_COPY_GRAPHS): "write", by the driver's stream write (cuStreamWriteValue64; in a graph,
// a memory-operation node): no SM and no launch; "kernel", by a one-thread kernel (a kernel
// node in a graph); unset, the write where transfers are enqueued call by call and kernel
// nodes in graphs: a graph launch took ~1.5 µs of host time per memory-operation node against
// ~0.2 µs per kernel node (benchmarks/RESULTS.md), and the copy paths leave SMs free for the flags.
// The write's default flags put a memory barrier before it, and the chunk's copies before it
// have completed. Kernels raise them anyway where the driver lacks the entry points or once it
// refused a write (then for the rest of the process).
using StreamWriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using StreamWaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using GraphAddBatchMemOpNode = CUresult (*)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t,
                                            const CUDA_BATCH_MEM_OP_NODE_PARAMS*);
using CtxGetCurrent = CUresult (*)(CUcontext*);
struct FlagWriters {
  StreamWriteValue64 stream_write = nullptr;
  StreamWaitValue64 stream_wait = nullptr;
  GraphAddBatchMemOpNode graph_node = nullptr;
  CtxGetCurrent current_context = nullptr;
};
std::atomic<bool> g_stream_write_refused{false};

const FlagWriters& flag_writers() {
  static const FlagWriters found = [] {
    FlagWriters w;
    w.stream_write = driver_entry<StreamWriteValue64>("cuStreamWriteValue64");
    w.stream_wait = driver_entry<StreamWaitValue64>("cuStreamWaitValue64");
    w.graph_node = driver_entry<GraphAddBatchMemOpNode>("cuGraphAddBatchMemOpNode");
    w.current_context = driver_entry<CtxGetCurrent>("cuCtxGetCurrent");
    return w;
  }();
  return found;
}

enum class FlagChoice { kDefault, kWrite, kKernel };
FlagChoice flag_choice() {
  const char* env = std::getenv("JAX_EP_COPY_FLAGS");
  if (env != nullptr && std::strcmp(env, "kernel") == 0) return FlagChoice::kKernel;
  if (env != nullptr && std::strcmp(env, "write") == 0) return FlagChoice::kWrite;
  return FlagChoice::kDefault;
}

bool stream_writes_refused() { return g_stream_write_refused.load(std::memory_order_relaxed); }

void refuse_stream_writes(const char* where, int status) {
  if (!g_stream_write_refused.exchange(true))
    std::fprintf(stderr, "jax_ep: the driver refused a landed flag's write (%s, CUresult %d); "
                 "one-thread kernels raise them from now on\n", where, status);
}

cudaError_t raise_landed(cudaStream_t stream, uint64_t* flag) {
  HostTimer timer(kHostFlag);
  const bool allowed = flag_choice() != FlagChoice::kKernel && !stream_writes_refused();
  if (StreamWriteValue64 write = allowed ? flag_writers().stream_write : nullptr) {
    const CUresult status =
        write(stream, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (status == CUDA_SUCCESS) return cudaSuccess;
    refuse_stream_writes("cuStreamWriteValue64", static_cast<int>(status));
  }
  raise_landed_flag<<<1, 1, 0, stream>>>(flag);
  return cudaGetLastError();
}

cudaStream_t copy_stream(const Transport& t, int pe, int j) {
  return t.copy_streams[pe * kCopyStreamsPerPeer + j];
}

// The stream of a transfer in the direct path: its peer's (local copies: this PE's own).
int stream_index(const Transport& t, const CopySequence::Transfer& x) {
  const int pe = x.peer == CopySequence::kLocal ? t.rank : x.peer;
  return pe * kCopyStreamsPerPeer + x.chunk % kCopyStreamsPerPeer;
}

// Where a piece lands: a local copy's own destination, or the peer's buffer.
void* piece_destination(const Transport& t, const CopySequence::Transfer& x,
                        const CopyPiece& p) {
  if (x.peer == CopySequence::kLocal) return p.dst;
  return static_cast<char*>(t.host_peers[x.peer]) + p.dst_offset;
}

// The graphs launch on this PE's own copy stream 0 (the per-peer ones are this PE's slots'
// neighbours; its own slot carries only local copies in the direct path).
cudaStream_t graph_stream(const Transport& t) { return copy_stream(t, t.rank, 0); }
cudaEvent_t graph_join_event(const Transport& t) {
  return t.copy_joins[t.rank * kCopyStreamsPerPeer];
}

// Read on every call (tests switch it within a process); a call's run and join agree, since
// both run within one execution of its handler.
bool use_graphs() {
  const char* env = std::getenv("JAX_EP_COPY_GRAPHS");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

uint64_t* landed_flag(const Transport& t, int peer, int rank, int chunk) {
  char* base = static_cast<char*>(t.host_peers[peer]);
  return &reinterpret_cast<Control*>(base)->landed[rank][chunk];
}

// The arguments' addresses inside a kernel step's bytes, as cudaLaunchKernel wants them.
std::vector<void*> argument_pointers(const CopySequence::Kernel& k) {
  std::vector<void*> out;
  for (size_t at : k.offsets) out.push_back(const_cast<unsigned char*>(k.args.data() + at));
  return out;
}

// A kernel node's parameters; `args` (argument_pointers of the kernel) must outlive them.
cudaKernelNodeParams kernel_node_params(const CopySequence::Kernel& kernel,
                                        std::vector<void*>& args) {
  cudaKernelNodeParams p = {};
  p.func = const_cast<void*>(kernel.func);
  p.gridDim = kernel.grid;
  p.blockDim = kernel.block;
  p.kernelParams = args.data();
  return p;
}

// ---- the direct path: the sequence enqueued call by call (JAX_EP_COPY_GRAPHS=0) ----

// The copy streams of the transfers that follow kernel `after` (-1: before any) wait for the
// caller's stream; a peer's chunks alternate between its two streams, so a copy engine has the
// next transfer queued while the previous flag is written.
cudaError_t fork_for(const Transport& t, const CopySequence& seq, int after, cudaStream_t stream) {
  HostTimer timer(kHostFork);
  bool waiting[kMaxCopyRanks * kCopyStreamsPerPeer] = {};
  cudaError_t status = cudaSuccess;
  bool recorded = false;
  for (const CopySequence::Transfer& x : seq.transfers()) {
    if (x.after_kernel != after) continue;
    const int index = stream_index(t, x);
    if (waiting[index]) continue;
    if (!recorded && (status = cudaEventRecord(t.copy_fork, stream)) != cudaSuccess) return status;
    recorded = waiting[index] = true;
    if ((status = cudaStreamWaitEvent(t.copy_streams[index], t.copy_fork)) != cudaSuccess)
      return status;
  }
  return status;
}

cudaError_t enqueue_transfers(const Transport& t, const CopySequence& seq, int after) {
  for (const CopySequence::Transfer& x : seq.transfers()) {
    if (x.after_kernel != after) continue;
    cudaStream_t s = t.copy_streams[stream_index(t, x)];
    if (x.wait_source >= 0) {  // a local copy of a chunk that a peer's copy engine lands
      HostTimer timer(kHostFlag);
      const StreamWaitValue64 wait = flag_writers().stream_wait;
      if (wait == nullptr) return cudaErrorNotSupported;
      const CUresult result =
          wait(s, reinterpret_cast<CUdeviceptr>(landed_flag(t, t.rank, x.wait_source, x.chunk)),
               1, CU_STREAM_WAIT_VALUE_EQ);
      if (result != CUDA_SUCCESS) return cudaErrorNotSupported;
    }
    for (int i = 0; i < x.num_pieces; ++i) {
      HostTimer timer(kHostMemcpy);
      const CopyPiece& p = x.pieces[i];
      const cudaError_t status = cudaMemcpyAsync(piece_destination(t, x, p), p.src, p.bytes,
                                                 cudaMemcpyDeviceToDevice, s);
      if (status != cudaSuccess) return status;
    }
    if (x.peer == CopySequence::kLocal) continue;
    const cudaError_t status = raise_landed(s, landed_flag(t, x.peer, t.rank, x.chunk));
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t run_direct(const Transport& t, const CopySequence& seq, cudaStream_t stream) {
  cudaError_t status = fork_for(t, seq, -1, stream);
  if (status == cudaSuccess) status = enqueue_transfers(t, seq, -1);
  const auto& kernels = seq.kernels();
  for (int k = 0; k < static_cast<int>(kernels.size()) && status == cudaSuccess; ++k) {
    {
      HostTimer timer(kHostKernel);
      std::vector<void*> args = argument_pointers(kernels[k]);
      status = cudaLaunchKernel(kernels[k].func, kernels[k].grid, kernels[k].block, args.data(),
                                0, stream);
    }
    if (status == cudaSuccess) status = fork_for(t, seq, k, stream);
    if (status == cudaSuccess) status = enqueue_transfers(t, seq, k);
  }
  return status;
}

// ---- the graph path: the sequence as one CUDA graph, cached ----

// What fixes a graph's nodes and edges; the pieces' sources and the kernels' arguments may
// change (set in place, see GraphCache::update).
using GraphShape = std::vector<unsigned char>;

// Dependency chains per peer in a graph (JAX_EP_COPY_CHAINS, default 1, read on every call):
// chunk c follows chunk c - chains of its peer, so `chains` transfers per peer are in flight.
// One chain lands the chunks strictly in order but waits, between two transfers, for the
// graph to start the next node; two behave like the direct path's two streams per peer.
int graph_chains() {
  const char* env = std::getenv("JAX_EP_COPY_CHAINS");
  const int n = env != nullptr ? std::atoi(env) : 1;
  return std::clamp(n, 1, kMaxCopyChunks);
}

template <typename T>
void put(std::vector<unsigned char>& out, const T& value) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof(T));
}

GraphShape shape_of(const CopySequence& seq, bool memop_flags, int chains) {
  GraphShape shape;
  put(shape, memop_flags);
  put(shape, chains);
  for (const CopySequence::Kernel& kernel : seq.kernels()) {
    put(shape, kernel.func);
    put(shape, kernel.grid);
    put(shape, kernel.block);
    put(shape, kernel.args.size());
  }
  for (const CopySequence::Transfer& x : seq.transfers()) {
    put(shape, x.peer);
    put(shape, x.chunk);
    put(shape, x.after_kernel);
    put(shape, x.wait_source);
    put(shape, x.num_pieces);
    for (int i = 0; i < x.num_pieces; ++i) {
      put(shape, x.pieces[i].dst_offset);
      put(shape, x.pieces[i].bytes);
    }
  }
  return shape;
}

struct CachedGraph {
  GraphShape shape;
  cudaGraph_t graph = nullptr;  // kept: updating the executable graph names its nodes
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaGraphNode_t> kernel_nodes, piece_nodes;  // in the sequence's order
  std::vector<std::vector<unsigned char>> kernel_args;  // what the nodes hold now
  std::vector<const void*> piece_sources;
  std::vector<void*> piece_destinations;  // local copies' (the others' are fixed by the shape)
  unsigned long long last_used = 0;

  // Whether the nodes hold `seq`'s sources and arguments (the shape being the same).
  bool holds(const CopySequence& seq) const {
    for (size_t k = 0; k < kernel_args.size(); ++k)
      if (kernel_args[k] != seq.kernels()[k].args) return false;
    size_t n = 0;
    for (const CopySequence::Transfer& x : seq.transfers())
      for (int i = 0; i < x.num_pieces; ++i, ++n)
        if (piece_sources[n] != x.pieces[i].src || piece_destinations[n] != x.pieces[i].dst)
          return false;
    return true;
  }
};

// Graphs kept: a few shapes (dispatch BF16 / FP8, combine, their backward passes) times the
// few source addresses XLA alternates between; on a miss with a known shape the least
// recently used graph of that shape is updated in place instead (no instantiation).
constexpr int kMaxGraphs = 16, kMaxGraphsPerShape = 3;

class GraphCache {
 public:
  // Every graph destroyed (no launch of them may be in flight: the device is synchronised).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (CachedGraph& g : graphs_) {
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
      if (g.graph != nullptr) cudaGraphDestroy(g.graph);
    }
    graphs_.clear();
  }

  // The executable graph for `seq`, built, updated or found; nullptr and an error otherwise.
  cudaError_t get(const Transport& t, const CopySequence& seq, cudaGraphExec_t* out) {
    const bool memop = flag_choice() == FlagChoice::kWrite && !stream_writes_refused() &&
                       flag_writers().graph_node != nullptr &&
                       flag_writers().current_context != nullptr;
    const int chains = graph_chains();
    GraphShape shape = shape_of(seq, memop, chains);
    std::lock_guard<std::mutex> lock(mutex_);
    ++clock_;
    CachedGraph* same_shape_lru = nullptr;
    int same_shape = 0;
    for (CachedGraph& g : graphs_) {
      if (g.shape != shape) continue;
      if (g.holds(seq)) {
        g.last_used = clock_;
        *out = g.exec;
        return cudaSuccess;
      }
      ++same_shape;
      if (same_shape_lru == nullptr || g.last_used < same_shape_lru->last_used) same_shape_lru = &g;
    }
    if (same_shape_lru != nullptr && same_shape >= kMaxGraphsPerShape) {
      HostTimer timer(kHostGraphUpdate);
      if (update(t, seq, *same_shape_lru) == cudaSuccess) {
        same_shape_lru->last_used = clock_;
        *out = same_shape_lru->exec;
        return cudaSuccess;
      }
      // the driver refused an in-place update: drop that graph, build anew below
      cudaGetLastError();
      cudaGraphExecDestroy(same_shape_lru->exec);
      cudaGraphDestroy(same_shape_lru->graph);
      graphs_.erase(graphs_.begin() + (same_shape_lru - graphs_.data()));
    }
    HostTimer timer(kHostGraphBuild);
    CachedGraph g;
    cudaError_t status = build(t, seq, memop, chains, g);
    if (status == cudaErrorNotSupported && memop) {
      // The driver refused the flags' memory-operation nodes: kernels raise them from now on.
      refuse_stream_writes("memory-operation graph node", static_cast<int>(status));
      cudaGetLastError();
      shape = shape_of(seq, false, chains);
      status = build(t, seq, false, chains, g);
    }
    if (status != cudaSuccess) return status;
    g.shape = std::move(shape);
    g.last_used = clock_;
    if (static_cast<int>(graphs_.size()) >= kMaxGraphs) {
      auto lru = std::min_element(graphs_.begin(), graphs_.end(),
                                  [](const CachedGraph& a, const CachedGraph& b) {
                                    return a.last_used < b.last_used;
                                  });
      cudaGraphExecDestroy(lru->exec);  // freed by the driver once its launches are done
      cudaGraphDestroy(lru->graph);
      graphs_.erase(lru);
    }
    graphs_.push_back(std::move(g));
    *out = graphs_.back().exec;
    return cudaSuccess;
  }

 private:
  // Kernels in a chain; each peer's pieces in chunk order over `chains` chains (a copy engine
  // lands the chunks one after another, so the receiver can start on the first), each chunk's
  // flag after its own pieces only (the next chunk's transfer need not wait for it).
  static cudaError_t build(const Transport& t, const CopySequence& seq, bool memop, int chains,
                           CachedGraph& g) {
    cudaError_t status = cudaGraphCreate(&g.graph, 0);
    if (status != cudaSuccess) return status;
    cudaGraph_t graph = g.graph;
    CUcontext context = nullptr;
    if (flag_writers().current_context == nullptr ||
        flag_writers().current_context(&context) != CUDA_SUCCESS)
      context = nullptr;
    if (context == nullptr) memop = false;
    // One memory-operation node (a flag's write, or a local copy's wait), after `deps`.
    // Its failure: cudaErrorNotSupported for a flag's write (the caller then falls back to
    // kernel flags), cudaErrorNotPermitted for a wait (probed at initialisation: unexpected).
    auto add_memop = [&](CUstreamBatchMemOpParams op, const std::vector<cudaGraphNode_t>& deps,
                         cudaGraphNode_t* node) {
      const bool wait = op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_64;
      const cudaError_t refused = wait ? cudaErrorNotPermitted : cudaErrorNotSupported;
      CUDA_BATCH_MEM_OP_NODE_PARAMS params = {};
      params.ctx = context;
      params.count = 1;
      params.paramArray = &op;
      if (context == nullptr || flag_writers().graph_node == nullptr) return refused;
      const CUresult result = flag_writers().graph_node(
          reinterpret_cast<CUgraphNode*>(node), graph,
          reinterpret_cast<const CUgraphNode*>(deps.data()), deps.size(), &params);
      return result == CUDA_SUCCESS ? cudaSuccess : refused;
    };
    // A local copy's wait for chunk c comes after every transfer *and flag* of this PE's
    // chunks <= c (an empty node per chunk joins them): were the graph to run its branches
    // one after another, no wait could then hold up a flag that a peer's wait needs (each PE
    // flags its chunk c before it waits for its peers' chunk c; by induction over c).
    std::vector<std::vector<cudaGraphNode_t>> flagged(kMaxCopyChunks);
    std::vector<cudaGraphNode_t> sent_through(kMaxCopyChunks, nullptr);
    auto all_sent_through = [&](int chunk, cudaGraphNode_t* node) {
      for (int c = 0; c <= chunk; ++c) {
        if (sent_through[c] != nullptr) continue;
        std::vector<cudaGraphNode_t> deps = flagged[c];
        if (c > 0) deps.push_back(sent_through[c - 1]);
        const cudaError_t status =
            cudaGraphAddEmptyNode(&sent_through[c], graph, deps.data(), deps.size());
        if (status != cudaSuccess) return status;
      }
      *node = sent_through[chunk];
      return cudaSuccess;
    };
    // Chains: per peer (transfers), then per source (local copies; this PE's own rows last).
    std::vector<std::vector<cudaGraphNode_t>> last_pieces(size_t(2 * t.num_ranks + 1) * chains);
    for (size_t k = 0; k < seq.kernels().size() && status == cudaSuccess; ++k) {
      const CopySequence::Kernel& kernel = seq.kernels()[k];
      std::vector<void*> args = argument_pointers(kernel);
      const cudaKernelNodeParams p = kernel_node_params(kernel, args);
      cudaGraphNode_t node = nullptr;
      status = cudaGraphAddKernelNode(&node, graph, k > 0 ? &g.kernel_nodes.back() : nullptr,
                                      k > 0 ? 1 : 0, &p);
      g.kernel_nodes.push_back(node);
      g.kernel_args.push_back(kernel.args);
    }
    for (const CopySequence::Transfer& x : seq.transfers()) {
      if (status != cudaSuccess) break;
      const bool local = x.peer == CopySequence::kLocal;
      const int source = x.wait_source < 0 ? t.num_ranks : x.wait_source;
      const size_t key = local ? size_t(t.num_ranks) + source : size_t(x.peer);
      std::vector<cudaGraphNode_t>& chain = last_pieces[key * chains + x.chunk % chains];
      std::vector<cudaGraphNode_t> deps = chain;
      if (x.after_kernel >= 0) deps.push_back(g.kernel_nodes[x.after_kernel]);
      if (x.wait_source >= 0) {  // the chunk has landed here: the flag its sender raised
        cudaGraphNode_t through = nullptr;
        if ((status = all_sent_through(x.chunk, &through)) != cudaSuccess) break;
        deps.push_back(through);
        CUstreamBatchMemOpParams op = {};
        op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        op.waitValue.address =
            reinterpret_cast<CUdeviceptr>(landed_flag(t, t.rank, x.wait_source, x.chunk));
        op.waitValue.value64 = 1;
        op.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
        cudaGraphNode_t node = nullptr;
        if ((status = add_memop(op, deps, &node)) != cudaSuccess) break;
        deps = {node};
      }
      std::vector<cudaGraphNode_t> pieces;
      for (int i = 0; i < x.num_pieces && status == cudaSuccess; ++i) {
        const CopyPiece& piece = x.pieces[i];
        cudaGraphNode_t node = nullptr;
        status = cudaGraphAddMemcpyNode1D(&node, graph, deps.data(), deps.size(),
                                          piece_destination(t, x, piece), piece.src, piece.bytes,
                                          cudaMemcpyDeviceToDevice);
        pieces.push_back(node);
        g.piece_nodes.push_back(node);
        g.piece_sources.push_back(piece.src);
        g.piece_destinations.push_back(piece.dst);
      }
      if (status != cudaSuccess) break;
      if (!pieces.empty()) chain = pieces;
      if (local) continue;
      const std::vector<cudaGraphNode_t>& before = pieces.empty() ? deps : pieces;
      uint64_t* flag = landed_flag(t, x.peer, t.rank, x.chunk);
      cudaGraphNode_t node = nullptr;
      if (memop) {
        CUstreamBatchMemOpParams op = {};
        op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        op.writeValue.address = reinterpret_cast<CUdeviceptr>(flag);
        op.writeValue.value64 = 1;
        op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
        status = add_memop(op, before, &node);
      } else {
        void* args[] = {&flag};
        cudaKernelNodeParams p = {};
        p.func = reinterpret_cast<void*>(raise_landed_flag);
        p.gridDim = dim3(1);
        p.blockDim = dim3(1);
        p.kernelParams = args;
        status = cudaGraphAddKernelNode(&node, graph, before.data(), before.size(), &p);
      }
      flagged[x.chunk].push_back(node);
    }
    if (status == cudaSuccess) status = cudaGraphInstantiate(&g.exec, graph, 0);
    if (status == cudaSuccess) status = cudaGraphUpload(g.exec, graph_stream(t));
    if (status != cudaSuccess && g.exec != nullptr) {
      cudaGraphExecDestroy(g.exec);
      g.exec = nullptr;
    }
    if (status != cudaSuccess) {
      cudaGraphDestroy(graph);
      g.graph = nullptr;
      g.kernel_nodes.clear();
      g.piece_nodes.clear();
      g.kernel_args.clear();
      g.piece_sources.clear();
      g.piece_destinations.clear();
    }
    return status;
  }

  // Same shape, new sources or kernel arguments: set the parameters of the nodes that differ,
  // in place.
  static cudaError_t update(const Transport& t, const CopySequence& seq, CachedGraph& g) {
    cudaError_t status = cudaSuccess;
    for (size_t k = 0; k < seq.kernels().size() && status == cudaSuccess; ++k) {
      const CopySequence::Kernel& kernel = seq.kernels()[k];
      if (g.kernel_args[k] == kernel.args) continue;
      std::vector<void*> args = argument_pointers(kernel);
      const cudaKernelNodeParams p = kernel_node_params(kernel, args);
      status = cudaGraphExecKernelNodeSetParams(g.exec, g.kernel_nodes[k], &p);
      if (status == cudaSuccess) g.kernel_args[k] = kernel.args;
    }
    size_t n = 0;
    for (const CopySequence::Transfer& x : seq.transfers()) {
      for (int i = 0; i < x.num_pieces && status == cudaSuccess; ++i, ++n) {
        const CopyPiece& piece = x.pieces[i];
        if (g.piece_sources[n] == piece.src && g.piece_destinations[n] == piece.dst) continue;
        status = cudaGraphExecMemcpyNodeSetParams1D(
            g.exec, g.piece_nodes[n], piece_destination(t, x, piece), piece.src, piece.bytes,
            cudaMemcpyDeviceToDevice);
        if (status == cudaSuccess) {
          g.piece_sources[n] = piece.src;
          g.piece_destinations[n] = piece.dst;
        }
      }
    }
    return status;
  }


  std::mutex mutex_;
  std::vector<CachedGraph> graphs_;
  unsigned long long clock_ = 0;
};

GraphCache& graph_cache() {
  // never destroyed: the CUDA runtime may be gone by the process's end (no CUDA calls at exit)
  static GraphCache* cache = new GraphCache;
  return *cache;
}

cudaError_t run_graph(const Transport& t, const CopySequence& seq, cudaStream_t stream) {
  cudaGraphExec_t exec = nullptr;
  cudaError_t status = graph_cache().get(t, seq, &exec);
  if (status != cudaSuccess) return status;
  {
    HostTimer timer(kHostFork);
    status = cudaEventRecord(t.copy_fork, stream);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(graph_stream(t), t.copy_fork);
  }
  if (status != cudaSuccess) return status;
  HostTimer timer(kHostGraphLaunch);
  return cudaGraphLaunch(exec, graph_stream(t));
}

}  // namespace

void copy_chunking(int num_tokens, size_t row_bytes, double default_mb, int* chunk_rows,
                   int* chunks) {
  // ~JAX_EP_COPY_CHUNK_MB (else default_mb) of rows per transfer, in at least 4 chunks (the
  // receiving CTAs start early, and small calls exercise the protocol), at most
  // kMaxCopyChunks (flags in Control).
  const char* env = std::getenv("JAX_EP_COPY_CHUNK_MB");
  const double mb = env && std::atof(env) > 0 ? std::atof(env) : default_mb;
  const int T = std::max(num_tokens, 1);
  int rows = static_cast<int>(mb * (1 << 20) / std::max<size_t>(row_bytes, 1));
  rows = std::min(std::max(rows, 1), (T + 3) / 4);
  rows = std::max(rows, (T + kMaxCopyChunks - 1) / kMaxCopyChunks);
  *chunk_rows = rows;
  *chunks = (num_tokens + rows - 1) / rows;
}

std::vector<CopyHostTime> copy_engine_host_times(bool reset) {
  std::vector<CopyHostTime> out;
  for (int k = 0; k < kHostKinds; ++k) {
    out.push_back({kHostKindNames[k], g_host_times[k].count(), g_host_times[k].recent()});
    if (reset) g_host_times[k].reset();
  }
  return out;
}

const char* copy_flag_mode() {
  const FlagWriters& w = flag_writers();
  const FlagChoice choice = flag_choice();
  if (choice == FlagChoice::kKernel || stream_writes_refused()) return "kernel";
  if (use_graphs())
    return choice == FlagChoice::kWrite && w.graph_node && w.current_context ? "stream write"
                                                                             : "kernel";
  return w.stream_write != nullptr ? "stream write" : "kernel";
}

const char* copy_sequence_mode() { return use_graphs() ? "graph" : "direct"; }

void release_copy_engine_graphs() { graph_cache().clear(); }

namespace {
std::atomic<bool> g_stream_waits{false}, g_graph_waits{false};
}  // namespace

void probe_copy_engine_waits(cudaStream_t stream, void* symmetric_word) {
  const FlagWriters& w = flag_writers();
  const CUdeviceptr word = reinterpret_cast<CUdeviceptr>(symmetric_word);
  // GEQ 0 holds for the buffer's zeroed words (the zeroing done: the device synchronised):
  // each wait must return at once
  cudaDeviceSynchronize();
  const bool stream_ok = w.stream_wait != nullptr &&
                         w.stream_wait(stream, word, 0, CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS &&
                         cudaStreamSynchronize(stream) == cudaSuccess;
  bool graph_ok = false;
  CUcontext context = nullptr;
  cudaGraph_t graph = nullptr;
  if (stream_ok && w.graph_node != nullptr && w.current_context != nullptr &&
      w.current_context(&context) == CUDA_SUCCESS && cudaGraphCreate(&graph, 0) == cudaSuccess) {
    CUstreamBatchMemOpParams op = {};
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = word;
    op.waitValue.value64 = 0;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    CUDA_BATCH_MEM_OP_NODE_PARAMS params = {};
    params.ctx = context;
    params.count = 1;
    params.paramArray = &op;
    CUgraphNode node = nullptr;
    cudaGraphExec_t exec = nullptr;
    graph_ok = w.graph_node(&node, reinterpret_cast<CUgraph>(graph), nullptr, 0, &params) ==
                   CUDA_SUCCESS &&
               cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
               cudaGraphLaunch(exec, stream) == cudaSuccess &&
               cudaStreamSynchronize(stream) == cudaSuccess;
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaGetLastError();  // a refusal here only means: no waits
  g_stream_waits = stream_ok;
  g_graph_waits = graph_ok;
}

bool copy_engine_waits_available() {
  return use_graphs() ? g_graph_waits.load() : g_stream_waits.load();
}

bool slots_copy_by_engine() {
  const char* env = std::getenv("JAX_EP_SLOTS_COPY");
  return env != nullptr && std::strcmp(env, "engine") == 0;
}

cudaError_t copy_engine_guard(const PeerContext& ctx, bool combine, cudaStream_t stream) {
  HostTimer timer(kHostGuard);
  wait_peers_finished<<<1, 32, 0, stream>>>(ctx, combine);
  return cudaGetLastError();
}

cudaError_t copy_engine_run(const PeerContext& ctx, const CopySequence& sequence,
                            cudaStream_t stream) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  if (sequence.kernels().empty() && sequence.transfers().empty()) return cudaSuccess;
  return use_graphs() ? run_graph(*t, sequence, stream) : run_direct(*t, sequence, stream);
}

cudaError_t copy_engine_join(const PeerContext& ctx, cudaStream_t stream, bool local_copies) {
  HostTimer timer(kHostJoin);
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  if (use_graphs()) {
    cudaError_t status = cudaEventRecord(graph_join_event(*t), graph_stream(*t));
    if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, graph_join_event(*t));
    return status;
  }
  for (int p = 0; p < ctx.num_ranks; ++p) {  // this PE's own streams: its local copies only
    for (int j = 0; (p != ctx.rank || local_copies) && j < kCopyStreamsPerPeer; ++j) {
      const int index = p * kCopyStreamsPerPeer + j;
      cudaError_t status = cudaEventRecord(t->copy_joins[index], t->copy_streams[index]);
      if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, t->copy_joins[index]);
      if (status != cudaSuccess) return status;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_ep
