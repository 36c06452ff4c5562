// Host time of recent host-side calls (the FFI handlers' executions, the copy-engine paths'
// driver calls): a diagnostic the benchmarks read to tell whether a path keeps the GPU busy.
// The last kCapacity durations are kept rather than a sum, so that a reader can take the
// median: the one call in many that blocks on a full GPU queue would swamp a mean.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <vector>

namespace jax_ep {

class HostTimeRing {
 public:
  static constexpr unsigned kCapacity = 4096;

  void record(std::chrono::steady_clock::duration elapsed) {
    const long long ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
    const unsigned long long n = count_.fetch_add(1, std::memory_order_relaxed);
    ns_[n % kCapacity].store(static_cast<uint32_t>(std::clamp<long long>(ns, 0, UINT32_MAX)),
                             std::memory_order_relaxed);
  }
  // Calls since the last reset.
  unsigned long long count() const { return count_.load(std::memory_order_relaxed); }
  // Durations (ns) of the last min(count, kCapacity) calls, in no particular order.
  std::vector<unsigned> recent() const {
    const unsigned long long n = std::min<unsigned long long>(count(), kCapacity);
    std::vector<unsigned> out;
    out.reserve(n);
    for (unsigned long long i = 0; i < n; ++i)
      out.push_back(ns_[i].load(std::memory_order_relaxed));
    return out;
  }
  void reset() { count_.store(0, std::memory_order_relaxed); }

 private:
  std::atomic<unsigned long long> count_{0};
  std::atomic<uint32_t> ns_[kCapacity] = {};
};

// Records the time from its construction to its end into a ring.
class ScopedHostTimer {
 public:
  explicit ScopedHostTimer(HostTimeRing& ring)
      : ring_(ring), start_(std::chrono::steady_clock::now()) {}
  ~ScopedHostTimer() { ring_.record(std::chrono::steady_clock::now() - start_); }
  ScopedHostTimer(const ScopedHostTimer&) = delete;
  ScopedHostTimer& operator=(const ScopedHostTimer&) = delete;

 private:
  HostTimeRing& ring_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace jax_ep
