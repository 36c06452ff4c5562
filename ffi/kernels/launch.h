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

// The order of this process's kernels across streams. A kernel of ours that waits for other
// blocks (its own or a peer's) must not run beside another such kernel: each could hold part of
// the SMs the other waits for, and on two ranks that met them in opposite orders neither would
// end. So a kernel launched on a stream other than the last one ours used first waits for that
// stream's work so far (an event), which puts this process's kernels in the order its handlers
// enqueued them, the same on every rank of an SPMD program; programs with every call on one
// stream pay nothing. Not across a CUDA graph's capture (a captured stream cannot wait for
// work outside its graph): there a low-latency call stays a cooperative launch (LLPlacement).
class KernelStreams {
 public:
  static KernelStreams& get() {
    static KernelStreams* one = new KernelStreams;  // never destroyed
    return *one;
  }
  // Before a launch on `stream`: it waits for the last stream's work unless that is `stream`
  // or `joined` (a stream the caller has made `stream` wait for already).
  cudaError_t order(cudaStream_t stream, cudaStream_t joined = kNone) {
    std::lock_guard<std::mutex> lock(mutex_);
    const cudaStream_t last = last_;
    last_ = stream;
    if (last == kNone || last == stream || last == joined || captured(stream) || captured(last))
      return cudaSuccess;
    cudaError_t status = cudaSuccess;
    if (event_ == nullptr) status = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (status == cudaSuccess) status = cudaEventRecord(event_, last);
    // (the wait takes the event's state now: the next record may reuse it at once)
    if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, event_, 0);
    return status;
  }
  // `stream` has waited for `other`'s kernels of ours so far (a split call's receive).
  void joined(cudaStream_t stream, cudaStream_t other) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (last_ == other) last_ = stream;
  }

  static inline const cudaStream_t kNone = reinterpret_cast<cudaStream_t>(~uintptr_t(0));

 private:
  static bool captured(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
           capture != cudaStreamCaptureStatusNone;
  }

  std::mutex mutex_;
  cudaStream_t last_ = kNone;
  cudaEvent_t event_ = nullptr;
};

// Kernels are launched to start while the kernel before them drains (programmatic stream
// serialization; each such kernel waits in wait_previous_kernel before reading anything):
// 2-4 µs less per normal-mode call on 2×H200 (benchmarks/RESULTS.md). Not while the stream
// is captured into a CUDA graph (the local targets' calls; every call under
// JAX_EP_COMMAND_BUFFERS=1): the low-latency tests passed there with plain launches, and
// programmatic edges in captured graphs, cooperative launches among them, have not been run.
inline bool programmatic_launch_on(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
         capture == cudaStreamCaptureStatusNone;
}

// The configuration of a launch that may start while the previous kernel on the stream
// drains; cooperative: every block resident as well. `attributes` (two) must outlive it. The
// caller orders the stream first (KernelStreams::order).
inline cudaLaunchConfig_t config_after_previous(dim3 grid, dim3 block, size_t smem,
                                                cudaStream_t stream, bool cooperative,
                                                cudaLaunchAttribute* attributes) {
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

// Launches `kernel` so that it may start while the previous kernel on the stream drains, for a
// kernel that waits for no other block (it ends whatever runs beside it, so it is left out of
// the order across streams: work of ours on another stream need not wait for it).
template <typename... Params, typename... Args>
cudaError_t launch_local_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block,
                                        size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attributes[2];
  const cudaLaunchConfig_t config =
      config_after_previous(grid, block, smem, stream, /*cooperative=*/false, attributes);
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Any other kernel of ours: after those of ours on other streams (KernelStreams).
template <typename... Params, typename... Args>
cudaError_t launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                  cudaStream_t stream, Args... args) {
  if (cudaError_t status = KernelStreams::get().order(stream); status != cudaSuccess)
    return status;
  return launch_local_after_previous(kernel, grid, block, smem, stream, args...);
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
  if (cudaError_t status = KernelStreams::get().order(stream); status != cudaSuccess)
    return status;
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
