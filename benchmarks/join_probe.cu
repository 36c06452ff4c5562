// What a split call's hand-offs between the program's stream and a second stream cost the
// program's stream, without XLA: a chain of iterations, each two "work" kernels on the
// program's stream (every SM, a fixed time each) with a short kernel of few blocks on a
// second, high-priority stream beside the second one, handed its inputs after the first and
// joined before the next iteration, as the split low-latency calls are. Per iteration: the
// chain's time less the same chain with no second stream. Hand-offs compared: CUDA events
// (record on one stream, wait on the other), stream memory operations (a word written by one
// stream, waited for by the other), and the side kernel launched plain, cooperatively, or in
// clusters of two. One GPU; the host enqueues the whole chain ahead of the GPU.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/join_probe.cu -o build/join_probe && build/join_probe
#include <cuda.h>

#include <cstdint>
#include <cstdio>

#include "probe_common.cuh"

namespace {

constexpr int kIterations = 100;  // few enough for the launch queues to hold

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Holds its SM for `ns` (every block), then writes one word.
__global__ void busy(uint64_t ns, int* sink) {
  const uint64_t end = now_ns() + ns;
  while (now_ns() < end) {
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) *sink = 1;
}

// The side kernel: 512 threads a block, as the low-latency kernels (a whole SM each with
// their registers), busy for `ns`.
__global__ void __launch_bounds__(512) side(uint64_t ns, int* sink) {
  const uint64_t end = now_ns() + ns;
  while (now_ns() < end) {
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) *sink = 2;
}

enum class Handoff { kNone, kEvents, kValues };
enum class Launch { kPlain, kCooperative, kClusters };

using WriteValue = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WaitValue = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
WriteValue write_value = nullptr;
WaitValue wait_value = nullptr;

void check_cu(CUresult r, int line) {
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "CUresult %d at line %d\n", int(r), line);
    std::exit(1);
  }
}

template <typename F>
F entry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || p == nullptr) {
    std::fprintf(stderr, "no %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<F>(p);
}

void launch_side(cudaStream_t s, int blocks, Launch how, uint64_t ns, int* sink) {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attributes[2];
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(512);
  config.stream = s;
  config.attrs = attributes;
  if (how == Launch::kCooperative || how == Launch::kClusters) {
    attributes[config.numAttrs].id = cudaLaunchAttributeCooperative;
    attributes[config.numAttrs++].val.cooperative = 1;
  }
  if (how == Launch::kClusters) {
    attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attributes[config.numAttrs].val.clusterDim.x = 2;
    attributes[config.numAttrs].val.clusterDim.y = 1;
    attributes[config.numAttrs++].val.clusterDim.z = 1;
  }
  CHECK(cudaLaunchKernelEx(&config, side, ns, sink));
}

// µs per iteration of the chain.
double chain_us(cudaStream_t program, cudaStream_t other, Handoff handoff, Launch how,
                int side_blocks, uint64_t work_ns, uint64_t side_ns, int* sink,
                CUdeviceptr words, uint32_t& sequence) {
  const int sms = [] {
    int d = 0, n = 0;
    cudaGetDevice(&d);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d);
    return n;
  }();
  cudaEvent_t start, stop, inputs, done;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventCreateWithFlags(&inputs, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  auto run = [&](int iterations) {
    for (int i = 0; i < iterations; ++i) {
      busy<<<sms, 128, 0, program>>>(work_ns, sink);
      const uint32_t n = ++sequence;
      if (handoff == Handoff::kEvents) {
        CHECK(cudaEventRecord(inputs, program));
        CHECK(cudaStreamWaitEvent(other, inputs, 0));
      } else if (handoff == Handoff::kValues) {
        check_cu(write_value(reinterpret_cast<CUstream>(program), words, n, 0), __LINE__);
        check_cu(wait_value(reinterpret_cast<CUstream>(other), words, n,
                            CU_STREAM_WAIT_VALUE_GEQ),
                 __LINE__);
      }
      if (handoff != Handoff::kNone) launch_side(other, side_blocks, how, side_ns, sink);
      busy<<<sms - side_blocks, 128, 0, program>>>(work_ns, sink);
      if (handoff == Handoff::kEvents) {
        CHECK(cudaEventRecord(done, other));
        CHECK(cudaStreamWaitEvent(program, done, 0));
      } else if (handoff == Handoff::kValues) {
        check_cu(write_value(reinterpret_cast<CUstream>(other), words + 4, n, 0), __LINE__);
        check_cu(wait_value(reinterpret_cast<CUstream>(program), words + 4, n,
                            CU_STREAM_WAIT_VALUE_GEQ),
                 __LINE__);
      }
    }
  };
  run(20);  // warm-up
  CHECK(cudaStreamSynchronize(program));
  CHECK(cudaStreamSynchronize(other));
  busy<<<1, 32, 0, program>>>(20000000, sink);  // 20 ms for the host to enqueue the chain
  CHECK(cudaEventRecord(start, program));
  run(kIterations);
  CHECK(cudaEventRecord(stop, program));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  for (cudaEvent_t e : {start, stop, inputs, done}) CHECK(cudaEventDestroy(e));
  return 1e3 * ms / kIterations;
}

}  // namespace

int main() {
  write_value = entry<WriteValue>("cuStreamWriteValue32");
  wait_value = entry<WaitValue>("cuStreamWaitValue32");
  int least = 0, greatest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t program, other;
  CHECK(cudaStreamCreateWithFlags(&program, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithPriority(&other, cudaStreamNonBlocking, greatest));
  int* sink = nullptr;
  void* words = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(int)));
  CHECK(cudaMalloc(&words, 8));
  CHECK(cudaMemset(words, 0, 8));
  uint32_t sequence = 0;
  const CUdeviceptr w = reinterpret_cast<CUdeviceptr>(words);
  std::printf("µs per iteration (two work kernels of W µs on the program's stream, the side "
              "kernel of 8 blocks beside the second); cost = that less the chain alone\n");
  std::printf("| W µs | side µs | alone | events, plain | events, cooperative | events, "
              "clusters | values, plain | values, cooperative | values, clusters |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (uint64_t work : {5000ull, 20000ull}) {
    for (uint64_t side_ns : {2000ull, 10000ull}) {
      const double alone = chain_us(program, other, Handoff::kNone, Launch::kPlain, 8, work,
                                    side_ns, sink, w, sequence);
      std::printf("| %.0f | %.0f | %.2f |", work / 1e3, side_ns / 1e3, alone);
      for (Handoff h : {Handoff::kEvents, Handoff::kValues})
        for (Launch how : {Launch::kPlain, Launch::kCooperative, Launch::kClusters}) {
          const double t = chain_us(program, other, h, how, 8, work, side_ns, sink, w,
                                    sequence);
          std::printf(" %.2f (+%.2f) |", t, t - alone);
        }
      std::printf("\n");
    }
  }
  return 0;
}
