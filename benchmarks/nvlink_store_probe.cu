// How fast can a few SMs write into a peer GPU over NVLink, and with which instructions?
// The question behind the normal-mode target (issue 8): ≥ 338 GB/s per direction from at most
// 24 SMs, where plain 16-byte stores were measured at 285 GB/s with 24 blocks.
//
// One process per GPU; every PE writes BYTES into the next PE's symmetric buffer while the
// previous PE writes into its own (all directions busy at once). Variants, each at several
// CTA counts:
//   plain_copy   16-byte loads from local memory, 16-byte stores to the peer (8 in flight/lane)
//   plain_store  16-byte stores of register values to the peer (no loads)
//   tma_store    bulk (TMA) stores of a shared-memory chunk, several pipelines per CTA
//   tma_copy     bulk loads global -> shared and bulk stores shared -> peer, S stages a pipeline
//   copy_engine  cudaMemcpyAsync to the peer's address (no SM)
// and the fused dispatch's pattern (row_push): 14 KB rows, a warp each, to consecutive or
// scattered rows of the peer, with or without a local copy of each row; the pull combine's
// (row_pull): 14 KB rows read from the peer, a warp each, alone or summed with a local row,
// and the copy engine reading the peer.
// Then the latency a copy-engine low-latency send would add (docs/design.md 6.3): per call,
// to the peer, its records (0.95 MB: 128 FP8 tokens of hidden 7168), its pair headers (8 KB)
// and its counts (256 B) by three cudaMemcpyAsync on a stream of their own, then a
// one-thread kernel raising the peer's flag; µs from the first copy's enqueue to the flag,
// the flag by a one-thread kernel (it needs an SM) or by the stream's own write
// (cuStreamWriteValue64), alone and while short blocks keep every SM of this GPU busy.
//
//   NV=$(python -c "import nvidia.nvshmem as m; print(m.__path__[0])")
//   nvcc -O3 -rdc=true -arch=sm_90 -I$NV/include benchmarks/nvlink_store_probe.cu -o probe \
//        -L$NV/lib -l:libnvshmem_host.so.3 -lnvshmem_device -Xlinker -rpath=$NV/lib
//   for r in 0 1; do NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_REMOTE_TRANSPORT=none \
//       NVSHMEM_DISABLE_NVLS=1 ./probe $r 2 /tmp/uid & done; wait
//
// (benchmarks/run_on_device.sh step `storeprobe` does exactly that.)
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "probe_common.cuh"

namespace {

constexpr int kThreads = 512;

__global__ void raise_flag(unsigned long long* flag, unsigned long long value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// Keeps every SM busy for about `ns` (a stand-in for the work between a send and its receive).
__global__ void busy(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// The driver's cuStreamWriteValue64, found through the runtime (no link to libcuda).
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
WriteValue64 write_value64 = nullptr;

// µs per call of the send's pieces and flag on `stream`, averaged over `calls`; with
// `loaded`, a kernel on the default stream occupies every SM meanwhile.
double pieces_us(char* local, char* remote, unsigned long long* flag, cudaStream_t stream,
                 int sms, bool loaded, bool write_value, int calls) {
  const size_t sizes[] = {size_t(128) * 7424, 8 * 1024, 256};
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float total = 0;
  for (int c = 0; c < calls; ++c) {
    if (loaded) busy<<<40 * sms, kThreads>>>(20000ull);  // 20 µs blocks, ~800 µs in all
    CHECK(cudaEventRecord(a, stream));
    size_t offset = 0;
    for (size_t bytes : sizes) {
      CHECK(cudaMemcpyAsync(remote + offset, local + offset, bytes, cudaMemcpyDeviceToDevice,
                            stream));
      offset += bytes;
    }
    if (write_value) {  // the stream's front end writes it: no SM needed
      if (write_value64(stream, reinterpret_cast<CUdeviceptr>(flag), c + 1, 0) !=
          CUDA_SUCCESS) {
        std::fprintf(stderr, "cuStreamWriteValue64 failed\n");
        std::exit(1);
      }
    } else {
      raise_flag<<<1, 1, 0, stream>>>(flag, c + 1);
    }
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaDeviceSynchronize());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (c > 0) total += ms;  // the first call warms up
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return total * 1e3 / (calls - 1);
}

__global__ void plain_copy(const int4* src, int4* dst, size_t n) {
  constexpr int kInFlight = 8;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (i + u * stride < n) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (i + u * stride < n) dst[i + u * stride] = v[u];
  }
}

__global__ void plain_store(int4* dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = make_int4(int(i), 1, 2, 3);
}

// Lane 0 of the first `pipes` warps of each CTA streams its shared chunk to successive peer
// chunks; nothing waits until the end (the shared source never changes).
__global__ void tma_store(char* dst, size_t bytes, uint32_t chunk, int pipes) {
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= pipes) return;
  char* buf = smem + size_t(warp) * chunk;
  for (uint32_t i = lane * 16; i < chunk; i += 32 * 16)
    *reinterpret_cast<int4*>(buf + i) = make_int4(int(i), warp, 7, 9);
  __syncwarp();
  if (lane != 0) return;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> bulk reads
  const size_t chunks = bytes / chunk, pipe = size_t(blockIdx.x) * pipes + warp;
  const size_t all = size_t(gridDim.x) * pipes;
  for (size_t c = pipe; c < chunks; c += all) {
    bulk_store(dst + c * chunk, buf, chunk);
    bulk_commit();
  }
  bulk_wait_all();
}

// The next row for the calling warp from `counter`; every lane gets it.
__device__ __forceinline__ int claim_row(unsigned* counter, int lane) {
  unsigned claimed = 0;
  if (lane == 0) claimed = atomicAdd(counter, 1u);
  return int(__shfl_sync(0xffffffffu, claimed, 0));
}

// The fused dispatch's pattern: one warp per row of row_bytes (a token's row), rows claimed
// from a counter, row r read from src and stored to the peer's row r, or to row r * 7919 mod
// rows (consecutive claims land far apart) with `scatter`; with `own`, also stored to a local
// row (the PE's own copy of a token that goes to both ranks).
__global__ void row_push(const char* src, char* dst, char* own, int rows, size_t row_bytes,
                         unsigned* counter, bool scatter) {
  constexpr int kInFlight = 8;
  const int lane = threadIdx.x % 32;
  const size_t n = row_bytes / 16;
  for (int r = claim_row(counter, lane); r < rows; r = claim_row(counter, lane)) {
    const int d = scatter ? int(size_t(r) * 7919 % size_t(rows)) : r;
    const int4* from = reinterpret_cast<const int4*>(src + size_t(r) * row_bytes);
    int4* to = reinterpret_cast<int4*>(dst + size_t(d) * row_bytes);
    int4* mine = own != nullptr ? reinterpret_cast<int4*>(own + size_t(r) * row_bytes) : nullptr;
    for (size_t i = lane; i < n; i += 32 * kInFlight) {
      int4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n) v[u] = from[i + u * 32];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n) {
          to[i + u * 32] = v[u];
          if (mine != nullptr) mine[i + u * 32] = v[u];
        }
    }
  }
}

// The pull combine's pattern: one warp per row, rows claimed from a counter, the row read
// from the peer (its symmetric buffer, over NVLink) and, with `own`, summed with this PE's row
// of the same index, into a local output row; kInFlight 16-byte loads per lane before the
// stores, as the combine's weighted sum keeps them.
__global__ void row_pull(const char* peer_src, const char* own, char* out, int rows,
                         size_t row_bytes, unsigned* counter) {
  constexpr int kInFlight = 8;
  const int lane = threadIdx.x % 32;
  const size_t n = row_bytes / 16;
  for (int r = claim_row(counter, lane); r < rows; r = claim_row(counter, lane)) {
    const int4* far = reinterpret_cast<const int4*>(peer_src + size_t(r) * row_bytes);
    const int4* near =
        own != nullptr ? reinterpret_cast<const int4*>(own + size_t(r) * row_bytes) : nullptr;
    int4* to = reinterpret_cast<int4*>(out + size_t(r) * row_bytes);
    for (size_t i = lane; i < n; i += 32 * kInFlight) {
      int4 v[kInFlight], w[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n) {
          v[u] = __ldcg(far + i + u * 32);
          w[u] = near != nullptr ? near[i + u * 32] : make_int4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i + u * 32 < n)
          to[i + u * 32] = make_int4(v[u].x + w[u].x, v[u].y + w[u].y, v[u].z + w[u].z,
                                     v[u].w + w[u].w);
    }
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
};

// GB/s this PE wrote into its peer: `run` launched `iters` times between two barriers.
template <typename Run>
double measure(Run run, size_t bytes, int iters) {
  static Timer t;
  run();  // warm-up
  CHECK(cudaGetLastError());
  nvshmemx_barrier_all_on_stream(0);
  CHECK(cudaEventRecord(t.a, 0));
  for (int i = 0; i < iters; ++i) run();
  CHECK(cudaEventRecord(t.b, 0));
  nvshmemx_barrier_all_on_stream(0);
  CHECK(cudaEventSynchronize(t.b));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t.a, t.b));
  return double(bytes) * iters / (ms * 1e-3) / 1e9;
}

nvshmemx_uniqueid_t shared_unique_id(int rank, const std::string& path) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (rank == 0) {
    nvshmemx_get_uniqueid(&id);
    std::ofstream out(path + ".part", std::ios::binary);
    out.write(reinterpret_cast<const char*>(&id), sizeof(id));
    out.close();
    std::rename((path + ".part").c_str(), path.c_str());
    return id;
  }
  for (;;) {  // the others wait for process 0's file
    std::ifstream in(path, std::ios::binary);
    if (in.good() && in.read(reinterpret_cast<char*>(&id), sizeof(id)) && in.gcount() == sizeof(id))
      return id;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s RANK WORLD UNIQUE_ID_FILE\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]), world = std::atoi(argv[2]);
  CHECK(cudaSetDevice(rank));
  nvshmemx_uniqueid_t id = shared_unique_id(rank, argv[3]);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr);
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    std::fprintf(stderr, "rank %d: NVSHMEM init failed\n", rank);
    return 1;
  }
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes(), peer = (me + 1) % n;
  const size_t bytes = size_t(64) << 20;  // written into the peer per launch
  char* local = static_cast<char*>(nvshmem_malloc(2 * bytes));  // [source | landing zone]
  CHECK(cudaMemset(local, 1, 2 * bytes));
  char* remote = static_cast<char*>(nvshmem_ptr(local + bytes, peer));
  if (remote == nullptr) {
    std::fprintf(stderr, "rank %d: no peer-to-peer mapping of PE %d\n", me, peer);
    return 1;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, rank));
  const int iters = 10;
  const uint32_t chunk = 16 * 1024;
  const int stages = 4;
  const int store_pipes = 8, copy_pipes = 3;
  const size_t store_smem = size_t(store_pipes) * chunk;
  const size_t copy_smem = 1024 + size_t(copy_pipes) * stages * chunk;
  CHECK(cudaFuncSetAttribute(tma_store, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(store_smem)));
  CHECK(cudaFuncSetAttribute(tma_copy<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(copy_smem)));
  const int grids[] = {8, 16, 24, 32, 64, sms};
  if (me == 0)
    std::printf("%d×GPU, every PE writes %zu MB into the next one, all at once; GB/s per "
                "direction (one PE's writes / time)\n| CTAs | plain_copy | plain_store | "
                "tma_store (%d×%u KB) | tma_copy (%d pipes × %d × %u KB) |\n|---:|---:|---:|---:|---:|\n",
                n, bytes >> 20, store_pipes, chunk >> 10, copy_pipes, stages, chunk >> 10);
  for (int g : grids) {
    const double a = measure([&] {
      plain_copy<<<g, kThreads>>>(reinterpret_cast<const int4*>(local),
                                  reinterpret_cast<int4*>(remote), bytes / 16);
    }, bytes, iters);
    const double b = measure([&] {
      plain_store<<<g, kThreads>>>(reinterpret_cast<int4*>(remote), bytes / 16);
    }, bytes, iters);
    const double c = measure([&] {
      tma_store<<<g, kThreads, store_smem>>>(remote, bytes, chunk, store_pipes);
    }, bytes, iters);
    const double d = measure([&] {
      tma_copy<1><<<g, kThreads, copy_smem>>>(local, remote, bytes, chunk, copy_pipes, stages);
    }, bytes, iters);
    if (me == 0) std::printf("| %d | %.1f | %.1f | %.1f | %.1f |\n", g, a, b, c, d);
  }
  // Rows of a DeepSeek-V3 token (hidden 7168, BF16), one warp each, as the fused dispatch.
  const size_t row_bytes = 7168 * 2;
  const int rows = int(bytes / row_bytes);
  char* own = nullptr;
  unsigned* counter = nullptr;
  CHECK(cudaMalloc(&own, bytes));
  CHECK(cudaMalloc(&counter, sizeof(unsigned)));
  if (me == 0)
    std::printf("rows of %zu B, a warp each, claimed from a counter (the fused dispatch's "
                "pattern); GB/s to the peer per direction\n| CTAs | consecutive rows | "
                "scattered rows | consecutive + own local copy |\n|---:|---:|---:|---:|\n",
                row_bytes);
  for (int g : {24, 64, sms}) {
    double rate[3];
    for (int v = 0; v < 3; ++v)
      rate[v] = measure([&] {
        CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned), 0));
        row_push<<<g, kThreads>>>(local, remote, v == 2 ? own : nullptr, rows, row_bytes,
                                  counter, v == 1);
      }, size_t(rows) * row_bytes, iters);
    if (me == 0) std::printf("| %d | %.1f | %.1f | %.1f |\n", g, rate[0], rate[1], rate[2]);
  }
  const double ce = measure([&] {
    CHECK(cudaMemcpyAsync(remote, local, bytes, cudaMemcpyDeviceToDevice, 0));
  }, bytes, iters);
  if (me == 0) std::printf("copy engine (cudaMemcpyAsync to the peer's address): %.1f GB/s\n", ce);
  // Reads: the pull combine's side of the link. Every PE reads the peer's source rows while
  // the peer reads its own (all directions busy); GB/s read from the peer per direction.
  const char* peer_source = static_cast<const char*>(nvshmem_ptr(local, peer));
  char* pulled = nullptr;
  CHECK(cudaMalloc(&pulled, bytes));
  if (me == 0)
    std::printf("rows pulled from the peer, a warp each, claimed from a counter (the pull "
                "combine's pattern); GB/s read from the peer per direction\n| CTAs | peer row "
                "only | peer row + own row summed |\n|---:|---:|---:|\n");
  for (int g : {24, 64, sms}) {
    double rate[2];
    for (int v = 0; v < 2; ++v)
      rate[v] = measure([&] {
        CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned), 0));
        row_pull<<<g, kThreads>>>(peer_source, v == 1 ? own : nullptr, pulled, rows, row_bytes,
                                  counter);
      }, size_t(rows) * row_bytes, iters);
    if (me == 0) std::printf("| %d | %.1f | %.1f |\n", g, rate[0], rate[1]);
  }
  const double ce_read = measure([&] {
    CHECK(cudaMemcpyAsync(pulled, peer_source, bytes, cudaMemcpyDeviceToDevice, 0));
  }, bytes, iters);
  if (me == 0)
    std::printf("copy engine reading the peer (cudaMemcpyAsync from its address): %.1f GB/s\n",
                ce_read);
  CHECK(cudaFree(pulled));
  cudaStream_t side;
  int lowest = 0, highest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  CHECK(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, highest));
  // Both at once: the copy engine takes the first share of the rows (one copy on a stream of
  // its own), the SMs push the rest (the row pattern with the own local copy beside), so the
  // link carries both; GB/s of all rows to the peer per direction.
  cudaEvent_t fork, join;
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  if (me == 0)
    std::printf("rows split: the copy engine's share, the SMs' the rest; GB/s per direction\n"
                "| CTAs | CE 0 %% | CE 25 %% | CE 40 %% | CE 50 %% | CE 60 %% |\n"
                "|---:|---:|---:|---:|---:|---:|\n");
  for (int g : {24, 64}) {
    double rate[5];
    const double shares[] = {0.0, 0.25, 0.4, 0.5, 0.6};
    for (int v = 0; v < 5; ++v) {
      const int ce_rows = int(rows * shares[v]);
      rate[v] = measure([&] {
        CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned), 0));
        CHECK(cudaEventRecord(fork, 0));
        CHECK(cudaStreamWaitEvent(side, fork, 0));
        if (ce_rows > 0)
          CHECK(cudaMemcpyAsync(remote, local, size_t(ce_rows) * row_bytes,
                                cudaMemcpyDeviceToDevice, side));
        row_push<<<g, kThreads>>>(local + size_t(ce_rows) * row_bytes,
                                  remote + size_t(ce_rows) * row_bytes,
                                  own + size_t(ce_rows) * row_bytes, rows - ce_rows, row_bytes,
                                  counter, false);
        CHECK(cudaEventRecord(join, side));
        CHECK(cudaStreamWaitEvent(0, join, 0));
      }, size_t(rows) * row_bytes, iters);
    }
    if (me == 0)
      std::printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f |\n", g, rate[0], rate[1], rate[2],
                  rate[3], rate[4]);
  }
  CHECK(cudaEventDestroy(fork));
  CHECK(cudaEventDestroy(join));
  CHECK(cudaFree(own));
  CHECK(cudaFree(counter));
  unsigned long long* flag = reinterpret_cast<unsigned long long*>(remote + bytes - 64);
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64",
                                         reinterpret_cast<void**>(&write_value64), 12000,
                                         cudaEnableDefault, &found));
  for (bool write_value : {false, true}) {
    if (write_value && found != cudaDriverEntryPointSuccess) break;
    const double alone = pieces_us(local, remote, flag, side, sms, false, write_value, 50);
    const double loaded = pieces_us(local, remote, flag, side, sms, true, write_value, 50);
    if (me == 0)
      std::printf("copy-engine send pieces (0.95 MB + 8 KB + 256 B, then the flag by %s): "
                  "%.1f µs alone, %.1f µs while 20 µs blocks hold every SM\n",
                  write_value ? "cuStreamWriteValue64" : "a one-thread kernel", alone, loaded);
  }
  CHECK(cudaStreamDestroy(side));
  nvshmem_free(local);
  nvshmem_finalize();
  return 0;
}
