// The push paths' loop (the fused dispatch, the push combine), one per warp: pushing this PE's
// items (tokens, rows of y) to the peers and consuming the chunks that have arrived here
// interleave at warp granularity. Each warp holds at most one chunk, taken in order from one of
// `ranges` chunk ranges with a fetch-and-add (no contended compare-and-swap: an in-order claim
// serialised 2048 claims to ~0.4 µs each); between its pushes it checks whether that chunk is
// complete (arrival counters) and consumes it, so the consumption (the dispatch's copy-out, the
// combine's sums) runs while every PE is still pushing instead of after the last push. A warp
// holding a chunk keeps pushing, and it waits only once every item is claimed, for rows that
// running warps (here or on the peers) are pushing: nothing needs the whole grid resident.
// Items are claimed from a work counter by whichever warp is free: roughly in ascending order
// (destinations' chunks fill up progressively), and warps whose stores drain faster take more
// (with a static split the last CTA finished ~80 µs after the first, 2×H200).
//   Path::range(q) -> {begin, end} chunk indices of range q;
//   Path::needed(c, lane) -> arrivals that complete chunk c (0: complete already);
//   Path::consume(c, lane), Path::push(item, lane), Path::peer(c) (for a timeout report).
#pragma once

#include "kernels/intranode.h"

namespace jax_ep {
namespace {

// The loop's work counters in this PE's Control block: items to push, and one chunk counter
// per range (zeroed by the kernel launched before the loop's).
struct PushCursors {
  uint32_t* items;
  uint32_t* chunks;
};

template <typename Path>
__device__ __forceinline__ void push_loop(const PeerContext& ctx, Path& path, int items,
                                          const PushCursors& cursors, int ranges, const char* op,
                                          const char* what) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32;
  uint32_t* arrivals = control_of(ctx, ctx.rank)->arrivals;
  int item = claim_item(cursors.items, lane);
  int chunk = -1, needed = 0;  // the chunk this warp holds, and the arrivals that complete it
  int next_range = (warp + ctx.rank + 1) % ranges;  // ranges tried round-robin from here
  bool ranges_left = true;
  uint64_t idle_since = 0;
  while (true) {
    // 1. Hold a chunk: the next one of the first range that has any left.
    for (int k = 0; k < ranges && chunk < 0 && ranges_left; ++k) {
      const int q = next_range;
      next_range = (next_range + 1) % ranges;
      const int2 range = path.range(q);
      if (range.x >= range.y) continue;
      uint32_t taken = 0;
      if (lane == 0) {
        // Peek first, so that exhausted ranges are not incremented by every warp forever.
        taken = *reinterpret_cast<volatile uint32_t*>(&cursors.chunks[q]);
        if (range.x + int(taken) < range.y) taken = atomicAdd(&cursors.chunks[q], 1u);
      }
      const int c = range.x + int(__shfl_sync(0xffffffffu, taken, 0));
      if (c >= range.y) continue;
      chunk = c;
      needed = path.needed(c, lane);
    }
    if (chunk < 0) ranges_left = false;  // every range is exhausted: nothing more to hold
    // 2. Consume it once complete.
    if (chunk >= 0) {
      uint32_t complete = needed == 0;
      if (lane == 0 && !complete) complete = load_acquire_u32(&arrivals[chunk]) >= uint32_t(needed);
      if (__shfl_sync(0xffffffffu, complete, 0)) {
        __syncwarp();  // lane 0's acquire orders every lane's reads of the rows
        // Every row of this chunk has arrived for this call: its counter is free for the next.
        if (lane == 0 && needed > 0) arrivals[chunk] = 0;
        path.consume(chunk, lane);
        chunk = -1;
        idle_since = 0;
        continue;
      }
    }
    // 3. Otherwise push the next item of ours.
    if (item < items) {
      path.push(item, lane);
      item = claim_item(cursors.items, lane);
      idle_since = 0;
      continue;
    }
    if (chunk < 0) break;  // nothing held, nothing to push, no chunk left
    // 4. Every item is claimed and the held chunk's rows are still arriving: wait, bounded.
    if (lane == 0) {
      const uint64_t now = global_timer_ns();
      if (idle_since == 0) idle_since = now;
      if (now - idle_since > ctx.timeout_ns) {
        report_timeout(ctx, op, what, path.peer(chunk), uint64_t(needed),
                       uint64_t(load_acquire_u32(&arrivals[chunk])));
        trap_after_report();
      }
    }
    __nanosleep(200);
  }
}

}  // namespace
}  // namespace jax_ep
