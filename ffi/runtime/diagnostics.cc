// Fault watchdog and kernel phase timestamps (diagnostics.h).
#include "runtime/diagnostics.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "runtime/control.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

FaultRecord* g_host_record = nullptr;
FaultRecord* g_device_record = nullptr;
std::atomic<bool> g_stop{false};
std::thread g_watchdog;

// Seconds between reporting a fault and ending the process (0: never). A kernel that timed
// out has trapped, which leaves the CUDA context unusable; XLA reports the error at the next
// synchronisation, but tearing such a context down can block forever. The grace period lets
// the error reach Python first.
std::atomic<double> g_exit_after_s{10.0};
double exit_after_s() { return g_exit_after_s.load(); }

void watch() {
  using namespace std::chrono_literals;
  while (!g_stop.load()) {
    if (g_host_record->written) {
      const FaultRecord& f = *g_host_record;
      std::fprintf(stderr,
                   "jax_ep %.32s: PE %d timed out after %.1f s waiting for PE %d (%.48s, call %llu, "
                   "saw %llu)\n",
                   f.op, f.rank, f.timeout_s, f.peer, f.what, f.want, f.saw);
      std::fflush(stderr);
      const double grace = exit_after_s();
      if (grace <= 0) return;
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration<double>(grace);
      while (!g_stop.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(20ms);
      if (g_stop.load()) return;
      std::fprintf(stderr,
                   "jax_ep: PE %d is still running %.1f s after a communication timeout; its "
                   "CUDA context is unusable, exiting with status 70 (initialize(fault_exit_s=0) "
                   "keeps it alive)\n",
                   f.rank, grace);
      std::fflush(stderr);
      _exit(70);
    }
    std::this_thread::sleep_for(20ms);
  }
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep runtime: ") + what + ": " +
                             cudaGetErrorString(status));
}

Control* local_control() {
  const Transport* t = transport();
  if (t == nullptr) throw std::runtime_error("jax_ep runtime: not initialised");
  return static_cast<Control*>(t->local);
}

}  // namespace

FaultRecord* device_fault_record() { return g_device_record; }

void set_fault_exit_s(double seconds) { g_exit_after_s.store(seconds > 0 ? seconds : 0.0); }

void start_fault_watchdog() {
  if (g_host_record != nullptr) return;
  void* host = nullptr;
  check(cudaHostAlloc(&host, sizeof(FaultRecord), cudaHostAllocMapped), "allocating the fault record");
  std::memset(host, 0, sizeof(FaultRecord));
  void* device = nullptr;
  if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
    cudaFreeHost(host);
    throw std::runtime_error("jax_ep runtime: the fault record cannot be mapped into the GPU");
  }
  g_host_record = static_cast<FaultRecord*>(host);
  g_device_record = static_cast<FaultRecord*>(device);
  g_stop = false;
  g_watchdog = std::thread(watch);
}

void stop_fault_watchdog() {
  if (g_host_record == nullptr) return;
  g_stop = true;
  if (g_watchdog.joinable()) g_watchdog.join();
  cudaFreeHost(g_host_record);
  g_host_record = nullptr;
  g_device_record = nullptr;
}

namespace {
std::atomic<unsigned long long> g_profile_calls{0};
// Stamps cost a low-latency call a few tenths of a microsecond (about eight global atomics a
// block), so kernels stamp only between reset_profile() and read_profile().
std::atomic<bool> g_profiling{false};
}  // namespace

unsigned long long (*next_profile_row())[kProfilePhases] {
  if (!g_profiling.load(std::memory_order_relaxed)) return nullptr;
  Control* control = static_cast<Control*>(transport()->local);
  return control->profile[g_profile_calls.fetch_add(1) % (kProfileCalls - 1)];
}

unsigned long long (*graph_profile_row())[kProfilePhases] {
  return static_cast<Control*>(transport()->local)->profile[kProfileCalls - 1];
}

std::vector<unsigned long long> read_profile() {
  Control* control = local_control();
  check(cudaDeviceSynchronize(), "waiting for the kernels");
  std::vector<unsigned long long> values(sizeof(control->profile) / sizeof(unsigned long long));
  check(cudaMemcpy(values.data(), control->profile, sizeof(control->profile),
                   cudaMemcpyDeviceToHost),
        "reading the kernel profile");
  g_profiling = false;
  return values;
}

std::vector<unsigned long long> read_low_latency_calls() {
  const Transport* t = transport();
  if (t == nullptr || t->ll_local == nullptr) return {};
  check(cudaDeviceSynchronize(), "waiting for the kernels");
  std::vector<unsigned long long> values(2);
  check(cudaMemcpy(values.data(), t->ll_local, sizeof(unsigned long long) * 2,
                   cudaMemcpyDeviceToHost),
        "reading the low-latency call counters");
  return values;
}

void reset_profile() {
  Control* control = local_control();
  check(cudaDeviceSynchronize(), "waiting for the kernels");
  std::vector<unsigned long long> values(sizeof(control->profile) / sizeof(unsigned long long));
  for (size_t i = 0; i < values.size(); i += kProfilePhases) {
    values[i + 0] = values[i + 2] = ~0ull;           // minima
    values[i + 1] = values[i + 3] = values[i + 4] = 0;  // maxima
  }
  check(cudaMemcpy(control->profile, values.data(), sizeof(control->profile),
                   cudaMemcpyHostToDevice),
        "resetting the kernel profile");
  g_profile_calls = 0;
  g_profiling = true;
}

}  // namespace jax_ep
