// The copy-engine transport, device-code side: the sequence of transfers, flags and kernels a
// data path enqueues for one call, and its guard, run and join (transport/copy_engine.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <vector>

#include "transport/copy_engine.h"
#include "transport/peers.cuh"

namespace jax_ep {

// Copy-engine transfers, which the copy-engine dispatch and combine enqueue around their
// kernels: a guard kernel (every peer finished the previous call), then the
// call's copy sequence, then the caller's kernels, which wait for the landed flags, and a join
// (the caller's stream waits for the transfers, so their sources outlive them).
struct CopyPiece {
  size_t dst_offset;  // in the peer's symmetric buffer, where dst is nullptr
  const void* src;
  size_t bytes;
  void* dst = nullptr;  // else here: a peer's XLA output as mapped here (set per call)
};
// One call's copy-engine work: kernels that run one after another (the combine's stage of
// each chunk), and transfers, each a chunk's pieces to one peer followed by the chunk's landed
// flag there, in order per peer, each after the kernel that produced its source (if any).
// Run as one CUDA graph, cached per shape and updated in place where only the source
// addresses or kernel arguments differ: ~5 host calls per call instead of 2-5 per chunk
// (benchmarks/RESULTS.md, copy-engine host time).
class CopySequence {
 public:
  struct Kernel {
    const void* func;
    dim3 grid, block;
    std::vector<unsigned char> args;  // the arguments' bytes, each at its offset
    std::vector<size_t> offsets;
  };
  struct Transfer {
    int peer, chunk, after_kernel;  // after_kernel: index into kernels(), or -1
    CopyPiece pieces[2];
    int num_pieces;
  };
  template <typename... Params, typename... Args>
  int add_kernel(void (*func)(Params...), dim3 grid, dim3 block, const Args&... args) {
    Kernel k{reinterpret_cast<const void*>(func), grid, block, {}, {}};
    (append(k, static_cast<const Params&>(args)), ...);
    kernels_.push_back(std::move(k));
    return static_cast<int>(kernels_.size()) - 1;
  }
  void add_transfer(int peer, int chunk, int after_kernel, const CopyPiece* pieces, int n) {
    Transfer t{peer, chunk, after_kernel, {}, 0};
    for (int i = 0; i < n && i < 2; ++i)
      if (pieces[i].bytes > 0) t.pieces[t.num_pieces++] = pieces[i];
    transfers_.push_back(t);
  }
  const std::vector<Kernel>& kernels() const { return kernels_; }
  const std::vector<Transfer>& transfers() const { return transfers_; }

 private:
  template <typename T>
  static void append(Kernel& k, const T& value) {
    size_t at = (k.args.size() + alignof(T) - 1) / alignof(T) * alignof(T);
    k.args.resize(at + sizeof(T));
    std::memcpy(k.args.data() + at, &value, sizeof(T));
    k.offsets.push_back(at);
  }
  std::vector<Kernel> kernels_;
  std::vector<Transfer> transfers_;
};
// A call's chunks: ~chunk_bytes (> 0) of rows of row_bytes per transfer.
void copy_chunking(int num_tokens, size_t row_bytes, size_t chunk_bytes, int* chunk_rows,
                   int* chunks);
// combine: also resets the combine's work cursor for the reduce that follows. into_outputs:
// the transfers write into the peers' XLA outputs, so every peer must have entered this call
// too (Control::in_call).
cudaError_t copy_engine_guard(const PeerContext& ctx, bool combine, cudaStream_t stream,
                              bool into_outputs = false);
// Starts the sequence after the caller's stream's work so far; the caller's next kernels may
// run alongside it.
cudaError_t copy_engine_run(const PeerContext& ctx, const CopySequence& sequence,
                            cudaStream_t stream);
// The caller's stream waits for the sequence's transfers.
cudaError_t copy_engine_join(const PeerContext& ctx, cudaStream_t stream);
}  // namespace jax_ep
