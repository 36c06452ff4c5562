// Kernel launches shared by the normal-mode and the low-latency kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace jax_ep {

// The GPU's SM count (queried once; 1 if the query fails).
inline int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 1;
  }();
  return count;
}

// The streams this process's kernels that wait for other blocks (their own or a peer's) were
// launched on: a low-latency call skips the cooperative launch only where none of them can run
// beside it on another stream (LLPlacement). Programs with every call on XLA's compute stream
// see one stream (and the split calls' own); a call on another stream (Config.stream,
// jax_ep.on_stream) makes the low-latency calls cooperative from then on.
class KernelStreams {
 public:
  static KernelStreams& get() {
    static KernelStreams* one = new KernelStreams;  // never destroyed
    return *one;
  }
  void note(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream == a_ || stream == b_ || many_) return;
    if (a_ == kNone) {
      a_ = stream;
    } else if (b_ == kNone) {
      b_ = stream;
    } else {
      many_ = true;
    }
  }
  // Whether every such kernel so far ran on `one` or `other`.
  bool only_on(cudaStream_t one, cudaStream_t other) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto in = [&](cudaStream_t s) { return s == kNone || s == one || s == other; };
    return !many_ && in(a_) && in(b_);
  }

 private:
  static inline const cudaStream_t kNone = reinterpret_cast<cudaStream_t>(~uintptr_t(0));
  std::mutex mutex_;
  cudaStream_t a_ = kNone, b_ = kNone;
  bool many_ = false;
};

// Kernels are launched to start while the kernel before them drains (programmatic stream
// serialization; each such kernel waits in wait_previous_kernel before reading anything):
// 2-4 µs less per normal-mode call on 2×H200 (benchmarks/RESULTS.md). Not while the stream
// is captured into a CUDA graph (JAX_EP_COMMAND_BUFFERS=1): the low-latency tests passed
// there with plain launches, and programmatic edges in captured graphs, cooperative launches
// among them, have not been run.
inline bool programmatic_launch_on(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
         capture == cudaStreamCaptureStatusNone;
}

// The configuration of a launch that may start while the previous kernel on the stream
// drains; cooperative: every block resident as well. `attributes` (two) must outlive it.
inline cudaLaunchConfig_t config_after_previous(dim3 grid, dim3 block, size_t smem,
                                                cudaStream_t stream, bool cooperative,
                                                cudaLaunchAttribute* attributes) {
  KernelStreams::get().note(stream);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = programmatic_launch_on(stream) ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeCooperative;
  attributes[1].val.cooperative = 1;
  config.attrs = attributes;
  config.numAttrs = cooperative ? 2 : 1;
  return config;
}

// Launches `kernel` so that it may start while the previous kernel on the stream drains.
template <typename... Params, typename... Args>
cudaError_t launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                  cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attributes[2];
  const cudaLaunchConfig_t config =
      config_after_previous(grid, block, smem, stream, /*cooperative=*/false, attributes);
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// A grid of at most the blocks the device holds at once, the arguments as an array;
// cooperative: launched as such (every block resident before any starts), else the grid's
// size alone keeps its blocks resident once the SMs are free, which holds where no other
// kernel waiting for its own blocks runs beside it (no cooperative launch: 1-1.6 µs less a
// low-latency call). `cluster` > 1: the blocks in thread-block clusters of that many (it
// divides grid.x).
inline cudaError_t launch_grid_after_previous(const void* kernel, dim3 grid, dim3 block,
                                              size_t smem, cudaStream_t stream, void** args,
                                              bool cooperative, unsigned cluster = 1) {
  cudaLaunchAttribute attributes[3];
  cudaLaunchConfig_t config =
      config_after_previous(grid, block, smem, stream, cooperative, attributes);
  if (cluster > 1) {
    cudaLaunchAttribute& clusters = attributes[config.numAttrs++];
    clusters.id = cudaLaunchAttributeClusterDimension;
    clusters.val.clusterDim.x = cluster;
    clusters.val.clusterDim.y = 1;
    clusters.val.clusterDim.z = 1;
  }
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace jax_ep
