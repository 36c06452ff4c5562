// Diagnostics of the communication kernels: the fault record that turns a device-side timeout
// into a host-side message (and, if the process then hangs, an exit), and the per-kernel
// phase timestamps the benchmarks read.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/control.h"

namespace jax_ep {

// Written by the first device thread that gives up waiting for a peer, read by the watchdog
// thread. Lives in mapped (zero-copy) host memory, so it reaches the host even when the
// kernel then traps and the device's printf buffer is never flushed.
struct FaultRecord {
  int claimed;            // atomically set by the thread that writes the record
  volatile int written;   // 1 once every field below is visible
  int rank, peer;
  unsigned long long want, saw;
  double timeout_s;
  char op[32], what[48];
};

// Device pointer of this process's fault record (nullptr before initialize()).
FaultRecord* device_fault_record();

// Called by the runtime: allocate the record and start the watchdog / stop and free them.
void start_fault_watchdog();
void stop_fault_watchdog();
// Seconds between the watchdog's report of a timed-out kernel and its ending the process with
// status 70 (0: never); runtime.initialize(fault_exit_s=...), 10 unless set.
void set_fault_exit_s(double seconds);

// Phase timestamps of the communication kernels (Control::profile, every row of the ring),
// after a device sync; the reset also restarts the row count. Handler calls get a row only
// between a reset and the next read (next_profile_row).
std::vector<unsigned long long> read_profile();
void reset_profile();
// The profile row of the next handler call (device pointer into this PE's Control), nullptr
// (the kernels stamp nothing) outside reset_profile() ... read_profile(). Counted on the host:
// calls replayed from a CUDA graph keep the row they were recorded with.
unsigned long long (*next_profile_row())[kProfilePhases];
// The profile row of kernels kept in cached copy-engine graphs: one row for every call, so
// that their arguments (and the cache) do not change with the row.
unsigned long long (*graph_profile_row())[kProfilePhases];
// Calls started so far by this PE's low-latency dispatch and combine sends (LLControl::calls).
std::vector<unsigned long long> read_low_latency_calls();

}  // namespace jax_ep
