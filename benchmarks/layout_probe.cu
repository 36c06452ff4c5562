// How long is one get_dispatch_layout kernel? The kernel of ffi/kernels/layout.cu, launched as
// the handler launches it, timed as a CUDA graph of 200 launches (so the host's launch rate does
// not bound it), at several token counts; compiles against whichever commit's kernel is checked
// out. No peers: runs on one GPU, no NVSHMEM.
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -Iffi benchmarks/layout_probe.cu -o build/layout_probe
//   build/layout_probe [ranks=2] [experts=256] [top_k=8]   (run_on_device.sh step `layoutprobe`)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/layout.cu"
#include "probe_common.cuh"

int main(int argc, char** argv) {
  const int R = argc > 1 ? std::atoi(argv[1]) : 2;
  const int E = argc > 2 ? std::atoi(argv[2]) : 256;
  const int K = argc > 3 ? std::atoi(argv[3]) : 8;
  constexpr int kLaunches = 200;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  for (int T : {128, 1024, 4096, 8192, 16384}) {
    std::vector<int32_t> ids(size_t(T) * K);
    std::mt19937 rng(T);
    for (auto& e : ids) e = static_cast<int32_t>(rng() % E);  // repeats only change the counts
    int32_t *topk_idx, *per_rank, *per_expert;
    bool* in_rank;
    CHECK(cudaMalloc(&topk_idx, ids.size() * sizeof(int32_t)));
    CHECK(cudaMemcpy(topk_idx, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&per_rank, R * sizeof(int32_t)));
    CHECK(cudaMalloc(&per_expert, E * sizeof(int32_t)));
    CHECK(cudaMalloc(&in_rank, size_t(T) * R));
    auto once = [&] {
      CHECK(jax_ep::launch_layout(topk_idx, T, K, E, R, per_rank, per_expert, in_rank, stream));
    };
    once();  // the first launch asks for the cluster size, outside the capture
    CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kLaunches; ++i) once();
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    float best = 1e30f;
    for (int repeat = 0; repeat < 5; ++repeat) {
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(begin, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(end, stream));
      CHECK(cudaEventSynchronize(end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, begin, end));
      best = ms < best ? ms : best;
    }
    std::printf("layout T=%5d R=%d E=%d K=%d: %.2f us a launch\n", T, R, E, K,
                best * 1e3f / kLaunches);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaFree(topk_idx));
    CHECK(cudaFree(per_rank));
    CHECK(cudaFree(per_expert));
    CHECK(cudaFree(in_rank));
  }
  return 0;
}
