// The copy-engine transport, host side: rows cross NVLink by cudaMemcpyAsync on the runtime's
// copy streams, chunk by chunk, each chunk followed by its landed flag at the peer (one CUDA
// graph per call, cached). What the module and the handlers ask of it; the data paths enqueue
// their transfers through transport/copy_sequence.cuh. No CUDA headers: host code includes it.
#pragma once

#include <vector>

struct CUstream_st;

namespace jax_ep {

// How the copy-engine paths raise their landed flags: "stream write" (the driver's, no SM)
// or "kernel"; and how they enqueue a call's transfers: "graph" (one
// cached CUDA graph per call) or "direct" (call by call, JAX_EP_COPY_GRAPHS=0).
const char* copy_flag_mode();
const char* copy_sequence_mode();
// Whether copy-engine local copies may wait for landed flags: the driver's stream wait (and,
// for graphs, a graph's wait node) worked at initialisation on a word of the symmetric
// buffer (probe_copy_engine_waits), and JAX_EP_COPY_FLAGS is not "kernel".
bool copy_engine_waits_available();
void probe_copy_engine_waits(CUstream_st* stream, void* symmetric_word);
// Destroys the cached copy-engine graphs: their nodes hold the peers' addresses and the
// flags of this initialisation (the module's finalize calls it after the runtime's; a later
// initialize() maps anew).
void release_copy_engine_graphs();
// JAX_EP_SLOTS_COPY=engine (read on every call, as the copy paths' other variables): the
// source_slots dispatch copies rows into the output by copy engines too, where waits are
// available; else (the default, "sm") its CTAs copy them.
bool slots_copy_by_engine();
// Host time the copy-engine calls spent, by kind (guard, fork, memcpy, flag, kernel, join,
// graph launch / update / build): calls since the last reset and the durations of the last
// few thousand of them, in ns.
struct CopyHostTime {
  const char* kind;
  unsigned long long calls;
  std::vector<unsigned> ns;
};
std::vector<CopyHostTime> copy_engine_host_times(bool reset);

}  // namespace jax_ep
