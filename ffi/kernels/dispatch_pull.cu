// The pull dispatch: the stage also stages this PE's rows (or, on the copy-engine path, the
// copy engines send every token to every peer's landing area; or, with the XLA windows, it
// only publishes where x is), then each PE's gather kernel reads the rows it receives from the
// sources into the output. docs/design.md,
// sections 4.2 and 4.3. Also the dispatch's entry point, which picks the data path.
#include "kernels/dispatch_common.cuh"

namespace jax_ep {
namespace {

// Lane r's pointer, in every lane.
template <typename T>
__device__ __forceinline__ T* shfl_pointer(T* p, int r) {
  return reinterpret_cast<T*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(p), r));
}

template <bool kExpertMajor>
__global__ void __launch_bounds__(kThreads) dispatch_gather(DispatchArgs a) {
  const PeerContext& ctx = a.ctx;
  const uint64_t call = enter_after_ready(ctx, kProfDispatchGather, "dispatch");
  const int R = ctx.num_ranks, me = ctx.rank, T = a.num_tokens, K = a.num_topk;
  const int E = a.num_experts, L = E / R, C = a.capacity;
  extern __shared__ int32_t tables[];
  GatherTables tb;
  build_tables<kExpertMajor>(a, region<int32_t>(ctx, me, a.plan.matrix), tables, tb);

  // Rows of the output in batches of 32 claimed in order from a counter (reset by the stage),
  // so that a warp whose rows are local does not sit idle while others pull theirs over
  // NVLink (24 CTAs: BF16 243 µs against 280 split statically, 2×H100). Lane r finds
  // the r-th row's source and token, so that the list entries of 32 rows (the sources', over
  // NVLink for a peer) take one round trip, not one in front of every copy. Each row's ids and
  // weights (the source's too) are loaded before its copy, so their round trip overlaps it.
  const int lane = threadIdx.x % 32;
  const size_t stride = row_stride(a.x_row_bytes), scale_stride = row_stride(a.scale_row_bytes);
  const int out_k = kExpertMajor ? 1 : K;
  // Copy-engine dispatch, rank_major: our own rows (in x already) first, while the peers'
  // chunks land; the rotation keeps every output row visited once (our rows may all lie past
  // the capacity).
  const int rotate = a.copy_engine && !kExpertMajor && C > 0 ? tb.src_offset[me] % C : 0;
  const Control* mine = control_of(ctx, me);
  uint32_t* cursor = &control_of(ctx, me)->work_cursor[kCursorDispatch];
  // The copy engines land rows in order, so there every warp keeps a row near the landing
  // front instead: warp w takes rows w, w + warps, ... (claimed batches of 32 consecutive rows
  // leave a late chunk's rows to a few warps: 349.5 µs against 240.7, 2×H100).
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32, warps = gridDim.x * kWarps;
  for (int round = 0;; ++round) {
    const int b = a.copy_engine ? round : claim_item(cursor, lane);
    const int j0 = a.copy_engine ? warp + b * 32 * warps : b * 32;
    if (j0 >= C) break;
    const int j = a.copy_engine ? j0 + lane * warps : j0 + lane;
    int my_i = -1, my_s = -1, my_t = -1, my_k = -1, my_local = -1;
    // The source's inputs where it left them in place (Control::xla_in), as mapped here; x
    // nullptr: its staged copy.
    const char* my_x = nullptr;
    const char* my_scales = nullptr;
    const int32_t* my_ids = nullptr;
    const float* my_weights = nullptr;
    if (j < C) {
      my_i = j + rotate < C ? j + rotate : j + rotate - C;
      int position = 0;
      my_s = source_of_row<kExpertMajor>(tb, my_i, R, L, &position, &my_local);
      if (my_s >= 0 && kExpertMajor) {
        const int pair = region<int32_t>(ctx, my_s, a.plan.lists)[size_t(me * L + my_local) *
                                                                   a.plan.list_len + position];
        my_t = pair / K;
        my_k = pair % K;
      } else if (my_s >= 0) {
        my_t = region<int32_t>(ctx, my_s, a.plan.lists)[size_t(me) * a.plan.list_len + position];
      }
      if (my_s >= 0 && !a.copy_engine) {
        const int pe = pe_of(ctx, my_s);
        const XlaInputs in{__ldcg(&mine->xla_in[pe].x), __ldcg(&mine->xla_in[pe].scales),
                           __ldcg(&mine->xla_in[pe].ids), __ldcg(&mine->xla_in[pe].weights)};
        if (in.x != 0) {
          if (!xla_mapped(ctx, pe)) {  // published, not mapped here
            report_timeout(ctx, "dispatch", "a peer's x outside the mapped XLA allocations",
                           my_s, 0, 0);
            trap_after_report();
          }
          my_x = xla_address(ctx, pe, in.x);
          my_scales = in.scales != 0 ? xla_address(ctx, pe, in.scales) : nullptr;
          my_ids = reinterpret_cast<const int32_t*>(xla_address(ctx, pe, in.ids));
          my_weights = reinterpret_cast<const float*>(xla_address(ctx, pe, in.weights));
        }
      }
    }
    for (int r = 0; r < 32; ++r) {
      const int i = __shfl_sync(0xffffffffu, my_i, r);
      if (i < 0) break;  // past the capacity, and so are the later lanes' rows
      const int s = __shfl_sync(0xffffffffu, my_s, r);
      if (s < 0) {
        write_unused_row(a, i, out_k, lane, a.scales != nullptr);
        continue;
      }
      const int t = __shfl_sync(0xffffffffu, my_t, r), k = __shfl_sync(0xffffffffu, my_k, r);
      const int local = __shfl_sync(0xffffffffu, my_local, r);
      const char* in_x = shfl_pointer(my_x, r);
      const int32_t* ids = in_x != nullptr ? shfl_pointer(my_ids, r) + size_t(t) * K
                                           : region<int32_t>(ctx, s, a.plan.meta_ids) + size_t(t) * K;
      const float* weights = in_x != nullptr
                                 ? shfl_pointer(my_weights, r) + size_t(t) * K
                                 : region<float>(ctx, s, a.plan.meta_weights) + size_t(t) * K;
      // lane j's id and weight (expert_major: lane 0's weight of pair k), used after the copy
      const int e = !kExpertMajor && lane < K ? ids[lane] : -1;
      const bool weighs = kExpertMajor ? lane == 0 : lane < K;
      const float w = weighs ? weights[kExpertMajor ? k : lane] : 0.f;
      char* out_row = static_cast<char*>(a.out_x) + size_t(i) * a.x_row_bytes;
      char* out_scales = reinterpret_cast<char*>(a.out_scales) + size_t(i) * a.scale_row_bytes;
      if (a.copy_engine) {
        const char* row = static_cast<const char*>(a.x) + size_t(t) * a.x_row_bytes;
        const char* row_scales = reinterpret_cast<const char*>(a.scales) +
                                 size_t(t) * a.scale_row_bytes;
        if (s != me) {  // in our landing area once its chunk is flagged
          wait_landed(ctx, s, t / a.copy_chunk_rows, lane, "dispatch");
          const size_t landed = size_t(s) * T + t;
          row = region<char>(ctx, me, a.plan.rows) + landed * a.x_row_bytes;
          row_scales = region<char>(ctx, me, a.plan.scales) + landed * a.scale_row_bytes;
        }
        // L1 may hold the area's previous call: the copy engine wrote around it
        copy_row<true>(out_row, row, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row<true>(out_scales, row_scales, a.scale_row_bytes, lane, 32);
      } else if (in_x != nullptr) {  // where the source's XLA keeps it
        copy_row(out_row, in_x + size_t(t) * a.x_row_bytes, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row(out_scales, shfl_pointer(my_scales, r) + size_t(t) * a.scale_row_bytes,
                   a.scale_row_bytes, lane, 32);
      } else {
        copy_row(out_row, region<char>(ctx, s, a.plan.rows) + t * stride, a.x_row_bytes, lane, 32);
        if (a.scales != nullptr)
          copy_row(out_scales, region<char>(ctx, s, a.plan.scales) + t * scale_stride,
                   a.scale_row_bytes, lane, 32);
      }
      if (kExpertMajor) {
        if (lane == 0) {
          a.out_topk_idx[i] = local;
          a.out_topk_weights[i] = w;
        }
      } else {
        for (int jk = lane; jk < K; jk += 32) {  // beyond 32 ids: loaded here
          const int id = jk == lane ? e : ids[jk];
          const bool here = valid_expert(id, E) && id / L == me;
          a.out_topk_idx[size_t(i) * K + jk] = here ? id % L : -1;
          a.out_topk_weights[size_t(i) * K + jk] = here ? (jk == lane ? w : weights[jk]) : 0.f;
          if (here) atomicAdd(&a.tokens_per_expert[id % L], 1);
        }
      }
      if (lane == 0) {
        a.src_rank[i] = s;
        a.src_token[i] = t;
        a.src_k[i] = k;
        if (kExpertMajor) a.pair_row[(size_t(s) * T + t) * K + k] = i;
      }
    }
  }

  // Where this PE's own tokens landed (the handle's send_slot), -1 when dropped.
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < T * (kExpertMajor ? K : R);
       i += gridDim.x * kThreads) {
    const int rank_in_list = a.send_slot[i];
    if (rank_in_list >= 0) a.send_slot[i] = destination_row<kExpertMajor>(a, tb, i, rank_in_list);
  }
  profile_end(ctx, kProfDispatchGather);
  finish_dispatch<kExpertMajor, true>(a, tb, call, 1, kProfDispatchGather);
}

template <bool kExpertMajor>
cudaError_t launch_pull(const DispatchArgs& a, size_t tables, cudaStream_t stream) {
  cudaError_t status = cudaSuccess;
  // The kernel's shared memory is allowed before the first launch: a refusal after the stage
  // (which signals the peers) would leave the call half done on every PE.
  if (tables > 48 * 1024 &&
      (status = cudaFuncSetAttribute(dispatch_gather<kExpertMajor>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(tables))) != cudaSuccess)
    return status;
  if (a.copy_engine && (status = enqueue_dispatch_copies(a, stream)) != cudaSuccess)
    return status;
  if ((status = launch_stage<kExpertMajor, true>(a, stream)) != cudaSuccess) return status;
  status = launch_after_previous(dispatch_gather<kExpertMajor>, a.num_blocks, kThreads, tables,
                                 stream, a);
  if (status == cudaSuccess && a.copy_engine) status = copy_engine_join(a.ctx, stream);
  return status;
}

}  // namespace

// Copy-engine dispatch, before the stage: this PE's x (and scales) to every peer's landing
// slot for us, chunk-major, so that every peer's first chunk is under way before anyone's
// second.
void add_dispatch_transfers(const DispatchArgs& a, CopySequence& sequence) {
  const PeerContext& ctx = a.ctx;
  const int R = ctx.num_ranks, T = a.num_tokens;
  for (int c = 0; c < a.copy_chunks; ++c) {
    const int first = c * a.copy_chunk_rows, rows = std::min(a.copy_chunk_rows, T - first);
    const size_t landing = size_t(ctx.rank) * T + first;
    const CopyPiece pieces[2] = {
        {a.plan.rows + landing * a.x_row_bytes,
         static_cast<const char*>(a.x) + size_t(first) * a.x_row_bytes, rows * a.x_row_bytes},
        {a.plan.scales + landing * a.scale_row_bytes,
         reinterpret_cast<const char*>(a.scales) + size_t(first) * a.scale_row_bytes,
         a.scales != nullptr ? rows * a.scale_row_bytes : 0},
    };
    for (int step = 1; step < R; ++step)
      sequence.add_transfer((ctx.rank + step) % R, c, /*after_kernel=*/-1, pieces, 2);
  }
}

// The guard, then the transfers above.
cudaError_t enqueue_dispatch_copies(const DispatchArgs& a, cudaStream_t stream) {
  cudaError_t status = copy_engine_guard(a.ctx, /*combine=*/false, stream);
  if (status != cudaSuccess) return status;
  CopySequence sequence;
  add_dispatch_transfers(a, sequence);
  return copy_engine_run(a.ctx, sequence, stream);
}

int max_block_shared_memory() {
  static const int bytes = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return n;
  }();
  return bytes;
}

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  DispatchArgs a = args;
  const int R = a.ctx.num_ranks, E = a.num_experts;
  // Rows per arrival counter (fused mode): output rows (rank_major, at least 4) or a source's
  // tokens (expert_major, as few as one: a token expands to ~K/R rows, and the last tokens to
  // arrive are expanded by as many warps as there are tokens); small chunks, so that the
  // copy-out of the last rows to arrive (one warp per chunk) is short, at most kMaxChunks
  // counters (expert_major: R per-source ranges, rounded up each).
  const int64_t rows = a.expert_major ? int64_t(R) * a.num_tokens : a.capacity;
  const int64_t counters = a.expert_major ? kMaxChunks - R : kMaxChunks;
  const int64_t least = a.expert_major ? 1 : 4;
  a.chunk_rows = static_cast<int>(std::max<int64_t>(least, (rows + counters - 1) / counters));
  if (a.copy_engine)
    copy_chunking(a.num_tokens, a.x_row_bytes, a.copy_chunk_bytes, &a.copy_chunk_rows,
                  &a.copy_chunks);
  if (a.source_slots) return launch_dispatch_slots(a, stream);
  if (a.lean) return launch_dispatch_lean(a, stream);
  const size_t tables = dispatch_table_bytes(R, E, a.expert_major);
  if (a.fused) return launch_dispatch_fused(a, tables, stream);
  return a.expert_major ? launch_pull<true>(a, tables, stream) : launch_pull<false>(a, tables, stream);
}


}  // namespace jax_ep
