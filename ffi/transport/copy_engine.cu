// Copy-engine transfers: rows cross NVLink by the copy engines (the memcpy nodes of one cached
// CUDA graph per call) instead of SM loads or stores, so the CTAs only copy locally
// (docs/design.md, section 4.3). The dispatch and the combine enqueue these pieces around their
// kernels.
//
// The copy engine cannot pick rows (its transfers are set on the host, while which rows go
// where is only known on the device), so whole per-source slots of T rows are sent. With few
// ranks a peer needs nearly all of them anyway (top-8 of 256 experts: 99.6 % on 2 ranks, 90 %
// on 4); the Python side selects these paths only there.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/launch.h"
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
  kHostGuard, kHostFork, kHostJoin, kHostGraphLaunch, kHostGraphUpdate, kHostGraphBuild,
  kHostKinds
};
constexpr const char* kHostKindNames[kHostKinds] = {
    "guard", "fork", "join", "graph launch", "graph update", "graph build"};
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

// Runs after a chunk's transfers (a one-thread kernel node: a graph launch costs ~0.2 µs of
// host time per kernel node against ~1.5 µs per memory-operation node, benchmarks/RESULTS.md):
// the chunk is in the peer's memory.
__global__ void raise_landed_flag(uint64_t* flag) {
  __threadfence_system();
  store_release(flag, 1);
}

// Where a piece lands: the peer's buffer.
void* piece_destination(const Transport& t, const CopySequence::Transfer& x,
                        const CopyPiece& p) {
  return static_cast<char*>(t.host_peers[x.peer]) + p.dst_offset;
}

cudaStream_t graph_stream(const Transport& t) { return t.copy_stream; }
cudaEvent_t graph_join_event(const Transport& t) { return t.copy_join; }

uint64_t* landed_flag(const Transport& t, int peer, int rank, int chunk) {
  char* base = static_cast<char*>(t.host_peers[peer]);
  return &reinterpret_cast<Control*>(base)->landed[rank][chunk];
}

// The arguments' addresses inside a kernel step's bytes, as a kernel node wants them.
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

// What fixes a graph's nodes and edges; the pieces' sources and the kernels' arguments may
// change (set in place, see GraphCache::update).
using GraphShape = std::vector<unsigned char>;

template <typename T>
void put(std::vector<unsigned char>& out, const T& value) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof(T));
}

GraphShape shape_of(const CopySequence& seq) {
  GraphShape shape;
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
  unsigned long long last_used = 0;

  // Whether the nodes hold `seq`'s sources and arguments (the shape being the same).
  bool holds(const CopySequence& seq) const {
    for (size_t k = 0; k < kernel_args.size(); ++k)
      if (kernel_args[k] != seq.kernels()[k].args) return false;
    size_t n = 0;
    for (const CopySequence::Transfer& x : seq.transfers())
      for (int i = 0; i < x.num_pieces; ++i, ++n)
        if (piece_sources[n] != x.pieces[i].src) return false;
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
    GraphShape shape = shape_of(seq);
    for (int r = 0; r < t.num_ranks; ++r) put(shape, t.host_peers[r]);  // the group's buffers
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
    const cudaError_t status = build(t, seq, g);
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
  // Kernels in a chain; each peer's pieces in one chain, in chunk order (a copy engine lands
  // the chunks one after another, so the receiver can start on the first; more chains per
  // peer measured no faster), each chunk's flag after its own pieces only (the next chunk's
  // transfer need not wait for it).
  static cudaError_t build(const Transport& t, const CopySequence& seq, CachedGraph& g) {
    cudaError_t status = cudaGraphCreate(&g.graph, 0);
    if (status != cudaSuccess) return status;
    cudaGraph_t graph = g.graph;
    std::vector<std::vector<cudaGraphNode_t>> last_pieces(t.num_ranks);  // per peer
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
      std::vector<cudaGraphNode_t>& chain = last_pieces[x.peer];
      std::vector<cudaGraphNode_t> deps = chain;
      if (x.after_kernel >= 0) deps.push_back(g.kernel_nodes[x.after_kernel]);
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
      }
      if (status != cudaSuccess) break;
      if (!pieces.empty()) chain = pieces;
      const std::vector<cudaGraphNode_t>& before = pieces.empty() ? deps : pieces;
      uint64_t* flag = landed_flag(t, x.peer, t.rank, x.chunk);
      void* args[] = {&flag};
      cudaKernelNodeParams p = {};
      p.func = reinterpret_cast<void*>(raise_landed_flag);
      p.gridDim = dim3(1);
      p.blockDim = dim3(1);
      p.kernelParams = args;
      cudaGraphNode_t node = nullptr;
      status = cudaGraphAddKernelNode(&node, graph, before.data(), before.size(), &p);
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
    }
    return status;
  }

  // Same shape, new sources or kernel arguments: set the parameters of the nodes that differ,
  // in place (the destinations are fixed by the shape).
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
        if (g.piece_sources[n] == piece.src) continue;
        status = cudaGraphExecMemcpyNodeSetParams1D(
            g.exec, g.piece_nodes[n], piece_destination(t, x, piece), piece.src, piece.bytes,
            cudaMemcpyDeviceToDevice);
        if (status == cudaSuccess) g.piece_sources[n] = piece.src;
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

void copy_chunking(int num_tokens, size_t row_bytes, size_t chunk_bytes, int* chunk_rows,
                   int* chunks) {
  // ~chunk_bytes of rows per transfer, in at least 4 chunks (the receiving CTAs start early,
  // and small calls exercise the protocol), at most kMaxCopyChunks (flags in Control).
  const int T = std::max(num_tokens, 1);
  const size_t fit = std::max<size_t>(chunk_bytes / std::max<size_t>(row_bytes, 1), 1);
  int rows = static_cast<int>(std::min<size_t>(fit, (T + 3) / 4));
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

void release_copy_engine_graphs() { graph_cache().clear(); }

cudaError_t copy_engine_guard(const PeerContext& ctx, bool combine, cudaStream_t stream) {
  HostTimer timer(kHostGuard);
  // it waits for the peers
  if (cudaError_t status = KernelStreams::get().order(stream); status != cudaSuccess)
    return status;
  wait_peers_finished<<<1, 32, 0, stream>>>(ctx, combine);
  return cudaGetLastError();
}

cudaError_t copy_engine_run(const PeerContext& ctx, const CopySequence& sequence,
                            cudaStream_t stream) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  if (sequence.kernels().empty() && sequence.transfers().empty()) return cudaSuccess;
  // The call's EP group as a transport of its own: its ranks' buffers, this PE's rank in it.
  Transport group = *t;
  std::vector<void*> peers(ctx.num_ranks);
  for (int r = 0; r < ctx.num_ranks; ++r) peers[r] = t->host_peers[pe_of(ctx, r)];
  group.host_peers = peers.data();
  group.rank = ctx.rank;
  group.num_ranks = ctx.num_ranks;
  return run_graph(group, sequence, stream);
}

cudaError_t copy_engine_join(const PeerContext& ctx, cudaStream_t stream) {
  HostTimer timer(kHostJoin);
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  cudaError_t status = cudaEventRecord(graph_join_event(*t), graph_stream(*t));
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, graph_join_event(*t));
  return status;
}

}  // namespace jax_ep
