// The copy-engine transport, host side: rows cross NVLink by the copy engines, chunk by chunk,
// each chunk followed by its landed flag at the peer (one CUDA graph per call, cached). What
// the module and the handlers ask of it; the data paths enqueue their transfers through
// transport/copy_sequence.cuh. No CUDA headers: host code includes it.
#pragma once

#include <vector>

namespace jax_ep {

// Destroys the cached copy-engine graphs: their nodes hold the peers' addresses and the
// flags of this initialisation (the module's finalize calls it after the runtime's; a later
// initialize() maps anew).
void release_copy_engine_graphs();
// Host time the copy-engine calls spent, by kind (guard, fork, join, graph launch / update /
// build): calls since the last reset and the durations of the last few thousand of them, in ns.
struct CopyHostTime {
  const char* kind;
  unsigned long long calls;
  std::vector<unsigned> ns;
};
std::vector<CopyHostTime> copy_engine_host_times(bool reset);

}  // namespace jax_ep
