// Copy-engine transfers: rows cross NVLink by cudaMemcpyAsync on the runtime's copy streams
// instead of SM loads or stores, so the CTAs only copy locally (NOTES items 26 and 30). The
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
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/intranode.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

// Host time of the copy-engine calls by kind (a diagnostic: which host calls a copy-engine
// call spends its ~130 µs of host time on, NOTES item 37), read by copy_engine_host_times().
enum HostKind { kHostGuard, kHostFork, kHostMemcpy, kHostFlag, kHostJoin, kHostKinds };
constexpr const char* kHostKindNames[kHostKinds] = {"guard", "fork", "memcpy", "flag", "join"};
std::atomic<unsigned long long> g_host_calls[kHostKinds], g_host_ns[kHostKinds];

class HostTimer {
 public:
  explicit HostTimer(HostKind kind) : kind_(kind), start_(std::chrono::steady_clock::now()) {}
  ~HostTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_)
                        .count();
    g_host_calls[kind_].fetch_add(1, std::memory_order_relaxed);
    g_host_ns[kind_].fetch_add(static_cast<unsigned long long>(ns), std::memory_order_relaxed);
  }

 private:
  HostKind kind_;
  std::chrono::steady_clock::time_point start_;
};

// Every peer has finished the previous call (it no longer reads what lands in its buffer, and
// it has cleared its landed flags), so this call's transfers may start.
__global__ void wait_peers_finished(PeerContext ctx, bool combine) {
  enter_call(ctx, current_call(ctx), combine ? "combine" : "dispatch");
}

// Runs on a copy stream after a chunk's transfers: the chunk is in the peer's memory.
__global__ void raise_landed_flag(uint64_t* flag) {
  __threadfence_system();
  store_release(flag, 1);
}

// The driver's stream write (cuStreamWriteValue64, found through the runtime: no link to
// libcuda) raises a flag without a kernel, so it needs no SM and no launch: the landed flags
// use it unless JAX_EP_COPY_FLAGS=kernel, the driver lacks it, or it once refused a write
// (then the kernel above for the rest of the process). Its default flags put a memory barrier
// before the write, and the chunk's copies before it on the stream have completed.
using StreamWriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
std::atomic<bool> g_stream_write_refused{false};

StreamWriteValue64 stream_write_value() {
  static const StreamWriteValue64 found = []() -> StreamWriteValue64 {
    const char* env = std::getenv("JAX_EP_COPY_FLAGS");
    if (env != nullptr && std::strcmp(env, "kernel") == 0) return nullptr;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult result;
#if CUDART_VERSION >= 12050
    const cudaError_t status = cudaGetDriverEntryPointByVersion(
        "cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &result);
#else
    const cudaError_t status =
        cudaGetDriverEntryPoint("cuStreamWriteValue64", &fn, cudaEnableDefault, &result);
#endif
    if (status != cudaSuccess || result != cudaDriverEntryPointSuccess) return nullptr;
    return reinterpret_cast<StreamWriteValue64>(fn);
  }();
  return g_stream_write_refused.load(std::memory_order_relaxed) ? nullptr : found;
}

cudaError_t raise_landed(cudaStream_t stream, uint64_t* flag) {
  HostTimer timer(kHostFlag);
  if (StreamWriteValue64 write = stream_write_value()) {
    const CUresult status =
        write(stream, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (status == CUDA_SUCCESS) return cudaSuccess;
    if (!g_stream_write_refused.exchange(true))
      std::fprintf(stderr, "jax_ep: cuStreamWriteValue64 refused a landed flag (CUresult %d); "
                   "one-thread kernels raise them from now on\n", static_cast<int>(status));
  }
  raise_landed_flag<<<1, 1, 0, stream>>>(flag);
  return cudaGetLastError();
}

cudaStream_t copy_stream(const Transport& t, int pe, int j) {
  return t.copy_streams[pe * kCopyStreamsPerPeer + j];
}

template <typename Fn>
cudaError_t for_each_copy_stream(const PeerContext& ctx, Fn fn) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  for (int p = 0; p < ctx.num_ranks; ++p) {
    for (int j = 0; p != ctx.rank && j < kCopyStreamsPerPeer; ++j) {
      const cudaError_t status = fn(*t, p * kCopyStreamsPerPeer + j, copy_stream(*t, p, j));
      if (status != cudaSuccess) return status;
    }
  }
  return cudaSuccess;
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
    out.push_back({kHostKindNames[k], g_host_calls[k].load(), g_host_ns[k].load()});
    if (reset) {
      g_host_calls[k].store(0);
      g_host_ns[k].store(0);
    }
  }
  return out;
}

const char* copy_flag_mode() {
  return stream_write_value() != nullptr ? "stream write" : "kernel";
}

cudaError_t copy_engine_guard(const PeerContext& ctx, bool combine, cudaStream_t stream) {
  HostTimer timer(kHostGuard);
  wait_peers_finished<<<1, 32, 0, stream>>>(ctx, combine);
  return cudaGetLastError();
}

cudaError_t copy_engine_fork(const PeerContext& ctx, cudaStream_t stream, int chunk) {
  HostTimer timer(kHostFork);
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  if (ctx.num_ranks == 1) return cudaSuccess;
  // Re-recording is safe: each wait below takes the record made just before it.
  const cudaError_t status = cudaEventRecord(t->copy_fork, stream);
  if (status != cudaSuccess) return status;
  return for_each_copy_stream(ctx, [&](const Transport& t, int index, cudaStream_t s) {
    const bool carries = chunk < 0 || index % kCopyStreamsPerPeer == chunk % kCopyStreamsPerPeer;
    return carries ? cudaStreamWaitEvent(s, t.copy_fork) : cudaSuccess;
  });
}

cudaError_t copy_engine_send_chunk(const PeerContext& ctx, int peer, int chunk,
                                   const CopyPiece* pieces, int num_pieces) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  cudaStream_t s = copy_stream(*t, peer, chunk % kCopyStreamsPerPeer);
  char* base = static_cast<char*>(t->host_peers[peer]);
  for (int i = 0; i < num_pieces; ++i) {
    if (pieces[i].bytes == 0) continue;
    HostTimer timer(kHostMemcpy);
    const cudaError_t status = cudaMemcpyAsync(base + pieces[i].dst_offset, pieces[i].src,
                                               pieces[i].bytes, cudaMemcpyDeviceToDevice, s);
    if (status != cudaSuccess) return status;
  }
  return raise_landed(s, &reinterpret_cast<Control*>(base)->landed[ctx.rank][chunk]);
}

cudaError_t copy_engine_join(const PeerContext& ctx, cudaStream_t stream) {
  HostTimer timer(kHostJoin);
  return for_each_copy_stream(ctx, [&](const Transport& t, int index, cudaStream_t s) {
    cudaError_t status = cudaEventRecord(t.copy_joins[index], s);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, t.copy_joins[index]);
    return status;
  });
}

}  // namespace jax_ep
