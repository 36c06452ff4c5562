// cuBLASLt, loaded at run time: the handful of entry points a batched GEMM needs, declared
// here by their C ABI (cublasLt.h's values; the ABI is stable within a major version).
#include "runtime/blas_lt.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>

#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace jax_ep {
namespace {

using Status = int;  // cublasStatus_t: 0 is success
using Handle = void*;
using Desc = void*;
using Layout = void*;
using Preference = void*;

struct Algo {  // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct HeuristicResult {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

// cublasComputeType_t, cublasOperation_t and the attributes' enumerators.
constexpr int kCompute32F = 68, kCompute32FFastTF32 = 77;
constexpr int32_t kOpN = 0, kOpT = 1;
constexpr int kDescScaleType = 1, kDescTransA = 3, kDescTransB = 4, kDescSmCountTarget = 15;
constexpr int kLayoutBatchCount = 5, kLayoutStridedBatchOffset = 6;
constexpr int kPrefMaxWorkspaceBytes = 1;

// cuBLAS's advice for Hopper: 32 MiB of workspace.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct Library {
  Status (*create)(Handle*);
  Status (*desc_create)(Desc*, int, cudaDataType_t);
  Status (*desc_set)(Desc, int, const void*, size_t);
  Status (*layout_create)(Layout*, cudaDataType_t, uint64_t, uint64_t, int64_t);
  Status (*layout_set)(Layout, int, const void*, size_t);
  Status (*pref_create)(Preference*);
  Status (*pref_set)(Preference, int, const void*, size_t);
  Status (*pref_destroy)(Preference);
  Status (*heuristic)(Handle, Desc, Layout, Layout, Layout, Layout, Preference, int,
                      HeuristicResult*, int*);
  Status (*matmul)(Handle, Desc, const void*, const void*, Layout, const void*, Layout,
                   const void*, const void*, Layout, void*, Layout, const Algo*, void*, size_t,
                   cudaStream_t);
  std::string error;  // non-empty: the library or an entry point was not found
};

const Library& library() {
  static const Library lib = [] {
    Library l{};
    void* so = nullptr;
    // The library XLA's GPU backend loaded is found by its soname; else load one.
    for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
      for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
        if ((so = dlopen(name, flags)) != nullptr) break;
      }
      if (so != nullptr) break;
    }
    if (so == nullptr) {
      l.error = "cuBLASLt (libcublasLt.so.13 or .12) could not be loaded";
      return l;
    }
    auto bind = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(so, symbol));
      if (fn == nullptr && l.error.empty()) l.error = std::string("cuBLASLt has no ") + symbol;
    };
    bind(l.create, "cublasLtCreate");
    bind(l.desc_create, "cublasLtMatmulDescCreate");
    bind(l.desc_set, "cublasLtMatmulDescSetAttribute");
    bind(l.layout_create, "cublasLtMatrixLayoutCreate");
    bind(l.layout_set, "cublasLtMatrixLayoutSetAttribute");
    bind(l.pref_create, "cublasLtMatmulPreferenceCreate");
    bind(l.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    bind(l.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    bind(l.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(l.matmul, "cublasLtMatmul");
    return l;
  }();
  return lib;
}

cudaDataType_t data_type(GemmType t) {
  switch (t) {
    case GemmType::kBF16: return CUDA_R_16BF;
    case GemmType::kF16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

constexpr int kCandidates = 8, kTuneRuns = 3;  // algorithms timed, runs of each timed

// One GEMM shape's descriptors and chosen algorithm, made once and kept: the heuristic query
// costs far more host time than the launch.
struct Plan {
  Desc desc = nullptr;
  Layout a = nullptr, b = nullptr, c = nullptr;
  HeuristicResult candidates[kCandidates] = {};
  int num_candidates = 0;
  bool tuned = false;
  Algo algo{};
  size_t workspace = 0;
};

using PlanKey =
    std::tuple<int, int64_t, int64_t, int64_t, int64_t, bool, bool, int, int, int, int, bool>;

struct State {
  std::mutex mu;
  std::map<int, Handle> handles;                        // device -> handle
  std::map<PlanKey, Plan> plans;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;  // (device, stream) -> 32 MiB
};

State& state() {
  static State* s = new State();  // never destroyed: CUDA may be gone at exit
  return *s;
}

std::string status_error(const char* what, Status s) {
  return std::string("cuBLASLt ") + what + " failed with status " + std::to_string(s);
}

// cuBLASLt is column-major: the row-major out [m, n] is the column-major out^T [n, m] =
// op(b)^T op(a)^T, so cuBLASLt's A is b and its B is a.
std::string make_plan(const Library& lib, Handle handle, const BatchedGemm& g, Plan* plan) {
  const cudaDataType_t ta = data_type(g.a_type), tb = data_type(g.b_type),
                       tc = data_type(g.out_type);
  const bool f32 = g.a_type == GemmType::kF32 && g.b_type == GemmType::kF32;
  Status s = lib.desc_create(&plan->desc, f32 && g.tf32 ? kCompute32FFastTF32 : kCompute32F,
                             CUDA_R_32F);
  if (s) return status_error("MatmulDescCreate", s);
  const cudaDataType_t scale = CUDA_R_32F;
  const int32_t op_a = g.trans_b ? kOpT : kOpN, op_b = g.trans_a ? kOpT : kOpN;
  const int32_t sms = g.sm_count;
  if ((s = lib.desc_set(plan->desc, kDescScaleType, &scale, sizeof(scale))) ||
      (s = lib.desc_set(plan->desc, kDescTransA, &op_a, sizeof(op_a))) ||
      (s = lib.desc_set(plan->desc, kDescTransB, &op_b, sizeof(op_b))) ||
      (sms > 0 && (s = lib.desc_set(plan->desc, kDescSmCountTarget, &sms, sizeof(sms)))))
    return status_error("MatmulDescSetAttribute", s);
  // cuBLASLt's A (our b): stored [n, k] column-major ([k, n] row-major), or its transpose.
  const uint64_t a_rows = g.trans_b ? g.k : g.n, a_cols = g.trans_b ? g.n : g.k;
  const uint64_t b_rows = g.trans_a ? g.m : g.k, b_cols = g.trans_a ? g.k : g.m;
  const int32_t batch = int32_t(g.batch);
  const int64_t stride_a = g.n * g.k, stride_b = g.m * g.k, stride_c = g.m * g.n;
  struct Spec {
    Layout* layout;
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t stride;
  };
  for (const Spec& spec : {Spec{&plan->a, tb, a_rows, a_cols, stride_a},
                           Spec{&plan->b, ta, b_rows, b_cols, stride_b},
                           Spec{&plan->c, tc, uint64_t(g.n), uint64_t(g.m), stride_c}}) {
    if ((s = lib.layout_create(spec.layout, spec.type, spec.rows, spec.cols,
                               int64_t(spec.rows))))
      return status_error("MatrixLayoutCreate", s);
    if ((s = lib.layout_set(*spec.layout, kLayoutBatchCount, &batch, sizeof(batch))) ||
        (s = lib.layout_set(*spec.layout, kLayoutStridedBatchOffset, &spec.stride,
                            sizeof(spec.stride))))
      return status_error("MatrixLayoutSetAttribute", s);
  }
  Preference pref = nullptr;
  if ((s = lib.pref_create(&pref))) return status_error("MatmulPreferenceCreate", s);
  const uint64_t max_workspace = kWorkspaceBytes;
  int found = 0;
  s = lib.pref_set(pref, kPrefMaxWorkspaceBytes, &max_workspace, sizeof(max_workspace));
  if (!s)
    s = lib.heuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref,
                      kCandidates, plan->candidates, &found);
  lib.pref_destroy(pref);
  if (s) return status_error("MatmulAlgoGetHeuristic", s);
  if (found < 1)
    return "cuBLASLt has no algorithm for this GEMM (batch " + std::to_string(g.batch) +
           ", m " + std::to_string(g.m) + ", n " + std::to_string(g.n) + ", k " +
           std::to_string(g.k) + ")";
  plan->num_candidates = found;
  plan->algo = plan->candidates[0].algo;  // the heuristic's first, until one is timed
  plan->workspace = plan->candidates[0].workspace_size;
  return "";
}

// Times the heuristic's candidates on the call's own buffers, once per plan, and keeps the
// fastest (as XLA autotunes its GEMMs): the heuristic's first is not always the best, e.g.
// for the transposed operands of the backward pass. Not while the stream is being captured
// into a graph (nothing may synchronize there), and not for a GEMM sized for fewer SMs: alone
// the fastest may be a kernel that fills every SM, which is what the sizing is to avoid.
void tune(const Library& lib, Handle handle, Plan* plan, const void* a, const void* b,
          void* out, void* workspace, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (plan->num_candidates < 2 || cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone)
    return;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) return;
  const float alpha = 1.0f, beta = 0.0f;
  float best = 0.0f;
  int chosen = 0;
  for (int i = 0; i < plan->num_candidates; ++i) {
    const HeuristicResult& c = plan->candidates[i];
    if (c.state != 0 || (c.workspace_size > 0 && workspace == nullptr)) continue;
    auto run = [&] {
      return lib.matmul(handle, plan->desc, &alpha, b, plan->a, a, plan->b, &beta, out,
                        plan->c, out, plan->c, &c.algo, workspace, c.workspace_size, stream);
    };
    if (run() != 0) continue;  // also the warm-up
    cudaEventRecord(start, stream);
    bool ok = true;
    for (int r = 0; r < kTuneRuns && ok; ++r) ok = run() == 0;
    cudaEventRecord(stop, stream);
    float ms = 0.0f;
    if (!ok || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)
      continue;
    if (best == 0.0f || ms < best) best = ms, chosen = i;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch leaves nothing behind
  plan->algo = plan->candidates[chosen].algo;
  plan->workspace = plan->candidates[chosen].workspace_size;
}

}  // namespace

std::string run_batched_gemm(const BatchedGemm& g, const void* a, const void* b, void* out,
                             CUstream_st* stream) {
  const Library& lib = library();
  if (!lib.error.empty()) return lib.error;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "cudaGetDevice failed";
  State& st = state();
  Handle handle = nullptr;
  Plan* plan = nullptr;
  void* workspace = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    Handle& h = st.handles[device];
    if (h == nullptr) {
      if (Status s = lib.create(&h)) {
        h = nullptr;
        return status_error("Create", s);
      }
    }
    handle = h;
    const PlanKey key{device, g.batch, g.m, g.n, g.k, g.trans_a, g.trans_b, int(g.a_type),
                      int(g.b_type), int(g.out_type), g.sm_count, g.tf32};
    auto it = st.plans.find(key);
    if (it == st.plans.end()) {
      Plan made;
      std::string error = make_plan(lib, handle, g, &made);
      if (!error.empty()) return error;
      it = st.plans.emplace(key, made).first;
    }
    plan = &it->second;
    // One workspace per stream: GEMMs on two streams may run at once.
    void*& w = st.workspaces[{device, stream}];
    if (w == nullptr && cudaMalloc(&w, kWorkspaceBytes) != cudaSuccess) {
      w = nullptr;
      return "cudaMalloc of the GEMM workspace failed";
    }
    workspace = w;
    if (!plan->tuned && g.sm_count == 0) {
      tune(lib, handle, plan, a, b, out, workspace, stream);
      plan->tuned = true;
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  if (Status s = lib.matmul(handle, plan->desc, &alpha, b, plan->a, a, plan->b, &beta, out,
                            plan->c, out, plan->c, &plan->algo, workspace, plan->workspace,
                            stream))
    return status_error("Matmul", s);
  return "";
}

}  // namespace jax_ep
