// Copy-engine dispatch: the rows cross NVLink by cudaMemcpyAsync on the runtime's copy streams
// instead of SM loads or stores, so the CTAs of the gather only copy locally (NOTES item 26).
//
// The copy engine cannot pick rows (its transfers are set on the host, while which rows go
// where is only known on the device), so every source sends all of its T rows to every peer.
// With few ranks a peer needs nearly all of them anyway (top-8 of 256 experts: 99.6 % on 2
// ranks, 90 % on 4); the Python side selects this path only there.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/intranode.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

// Every peer has finished the previous call (it no longer reads its landing area, and it has
// cleared its landed flags), so this call's transfers may start.
__global__ void copy_engine_guard(PeerContext ctx) {
  enter_call(ctx, current_call(ctx), "dispatch");
}

// Runs on a copy stream after a chunk's transfer: the chunk is in the peer's memory.
__global__ void raise_landed_flag(uint64_t* flag) {
  __threadfence_system();
  store_release(flag, 1);
}

cudaStream_t copy_stream(const Transport& t, int pe, int j) {
  return t.copy_streams[pe * kCopyStreamsPerPeer + j];
}

}  // namespace

cudaError_t enqueue_dispatch_copies(const DispatchArgs& a, cudaStream_t stream) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  const int R = a.ctx.num_ranks, me = a.ctx.rank, T = a.num_tokens;
  copy_engine_guard<<<1, 32, 0, stream>>>(a.ctx);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || R == 1) return status;
  if ((status = cudaEventRecord(t->copy_fork, stream)) != cudaSuccess) return status;
  for (int p = 0; p < R; ++p)
    for (int j = 0; p != me && j < kCopyStreamsPerPeer; ++j)
      if ((status = cudaStreamWaitEvent(copy_stream(*t, p, j), t->copy_fork)) != cudaSuccess)
        return status;
  const char* x = static_cast<const char*>(a.x);
  const char* scales = reinterpret_cast<const char*>(a.scales);
  // Chunk-major, so that every peer's first chunk is under way before anyone's second.
  for (int c = 0; c < a.copy_chunks; ++c) {
    const int first = c * a.copy_chunk_rows, rows = std::min(a.copy_chunk_rows, T - first);
    for (int step = 1; step < R; ++step) {
      const int p = (me + step) % R;
      cudaStream_t s = copy_stream(*t, p, c % kCopyStreamsPerPeer);
      char* peer = static_cast<char*>(t->host_peers[p]);
      const size_t landing = size_t(me) * T + first;
      status = cudaMemcpyAsync(peer + a.plan.rows + landing * a.x_row_bytes,
                               x + size_t(first) * a.x_row_bytes, rows * a.x_row_bytes,
                               cudaMemcpyDeviceToDevice, s);
      if (status == cudaSuccess && scales != nullptr)
        status = cudaMemcpyAsync(peer + a.plan.scales + landing * a.scale_row_bytes,
                                 scales + size_t(first) * a.scale_row_bytes,
                                 rows * a.scale_row_bytes, cudaMemcpyDeviceToDevice, s);
      if (status != cudaSuccess) return status;
      raise_landed_flag<<<1, 1, 0, s>>>(&reinterpret_cast<Control*>(peer)->landed[me][c]);
      if ((status = cudaGetLastError()) != cudaSuccess) return status;
    }
  }
  return cudaSuccess;
}

cudaError_t join_copy_streams(const DispatchArgs& a, cudaStream_t stream) {
  const Transport* t = transport();
  if (t == nullptr) return cudaErrorNotReady;
  for (int p = 0; p < a.ctx.num_ranks; ++p) {
    for (int j = 0; p != a.ctx.rank && j < kCopyStreamsPerPeer; ++j) {
      cudaEvent_t joined = t->copy_joins[p * kCopyStreamsPerPeer + j];
      cudaError_t status = cudaEventRecord(joined, copy_stream(*t, p, j));
      if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, joined);
      if (status != cudaSuccess) return status;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_ep
