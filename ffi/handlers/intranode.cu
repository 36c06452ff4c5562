// Typed-FFI handlers of the intranode normal mode: jax_ep_dispatch, jax_ep_cached_dispatch,
// jax_ep_combine. They validate shapes, check the symmetric buffer is large enough, fill the
// kernels' argument structs and launch; nothing here waits for the device.
#include <algorithm>
#include <optional>
#include <string>
#include <string_view>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/buffer_layout.h"
#include "kernels/intranode.h"
#include "kernels/quantize.h"
#include "runtime/diagnostics.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

constexpr int kDefaultBlocks = 64;

// This PE's place in the call's EP group (a group of the job's size where the runtime is not
// initialised: peer_context reports that).
ffi::Error group_place(const char* op, const EpGroup& group, GroupPlace* place) {
  *place = GroupPlace{0, int(std::max<int64_t>(group.num_ranks, 1)), 0, 1, false};
  const Transport* t = transport();
  return t == nullptr ? ffi::Error::Success()
                      : place_in_group(op, group, *t, /*across_nodes=*/false, place);
}

ffi::Error peer_context(const char* op, ffi::Buffer<ffi::S32> rank, size_t needed,
                        const Tuning& tuning, const GroupPlace& place, PeerContext* ctx) {
  const Transport* t = transport();
  if (t == nullptr)
    return invalid(std::string(op) + ": the runtime is not initialised: call "
                   "jax_ep.runtime.initialize() after jax.distributed.initialize()");
  if (needed > t->bytes)
    return invalid(std::string(op) + ": this call needs a symmetric buffer of " +
                   std::to_string(needed) + " bytes but the runtime has " +
                   std::to_string(t->bytes) + "; pass buffer_bytes >= " +
                   std::to_string(needed) + " to jax_ep.runtime.initialize()");
  if (rank.element_count() != 1) return invalid(std::string(op) + ": rank must be a scalar");
  *ctx = PeerContext{t->peers,           place.rank,        place.num_ranks,
                    tuning.timeout_ns(), rank.typed_data(), device_fault_record(),
                    next_profile_row(),  place.base,        place.stride,
                    t->num_ranks,        false,
                    t->xla_windows};
  return ffi::Error::Success();
}

// Whether [p, p + bytes) lies in this PE's XLA allocation as the peers map it (the runtime's
// open_xla_windows): where they may read or write it directly.
bool in_xla_window(const void* p, size_t bytes) {
  const Transport* t = transport();
  const uint64_t at = reinterpret_cast<uint64_t>(p);
  return t != nullptr && t->xla_windows != nullptr && t->xla_size > 0 && at >= t->xla_base &&
         at + bytes <= t->xla_base + t->xla_size;
}

size_t element_bytes(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 1;
    default: return 0;
  }
}

int blocks_or_default(int64_t num_blocks) {
  return num_blocks > 0 ? static_cast<int>(num_blocks) : kDefaultBlocks;
}

// CTAs of the copy-engine paths (their default: jax_ep.config.copy_engine_blocks), at most
// all SMs but kFreeSms: the chunks' landed flags are raised by one-thread kernels on the copy
// streams, which need room on some SM while the waiting CTAs (up to a whole register file
// each) are resident.
int copy_engine_blocks(int64_t num_blocks) {
  constexpr int kFreeSms = 2;
  return std::min(blocks_or_default(num_blocks), std::max(multiprocessors() - kFreeSms, 1));
}

ffi::Error dispatch_impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::F32> x_scales,
                         ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                         ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> out_x,
                         ffi::ResultBuffer<ffi::F32> out_scales,
                         ffi::ResultBuffer<ffi::S32> out_topk_idx,
                         ffi::ResultBuffer<ffi::F32> out_topk_weights,
                         ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                         ffi::ResultBuffer<ffi::S32> group_sizes,
                         ffi::ResultBuffer<ffi::S32> num_received,
                         ffi::ResultBuffer<ffi::S32> num_dropped,
                         ffi::ResultBuffer<ffi::S32> send_slot, ffi::ResultBuffer<ffi::S32> src_rank,
                         ffi::ResultBuffer<ffi::S32> src_token, ffi::ResultBuffer<ffi::S32> src_k,
                         ffi::ResultBuffer<ffi::S32> pair_row, int64_t num_experts,
                         int64_t capacity, int64_t alignment, std::string_view layout_name,
                         std::string_view path, bool has_scales, bool quantize, bool ue8m0,
                         EpGroup group, Tuning tuning) {
  GroupPlace place;
  if (auto err = group_place("dispatch", group, &place); err.failure()) return err;
  Layout layout;
  if (auto err = parse_layout("dispatch", layout_name, &layout); err.failure()) return err;
  const bool expert_major = layout == Layout::kExpertMajor;
  const bool source_slots = layout == Layout::kSourceSlots;
  auto x_dims = x.dimensions();
  auto idx_dims = topk_idx.dimensions();
  if (x_dims.size() != 2 || idx_dims.size() != 2 || idx_dims[0] != x_dims[0])
    return invalid("dispatch: x must be [T, H] and topk_idx [T, K]");
  // quantize: x unquantised, the rows come out e4m3 with their scales (dispatch's use_fp8);
  // sizes below are the output's
  ElementType x_type = ElementType::kF32;
  if (quantize) {
    if (!float_element(x.element_type(), &x_type))
      return invalid("dispatch: quantising takes bf16, f16 or f32 rows");
    if (has_scales || x_dims[1] % 128 != 0)
      return invalid("dispatch: quantising takes unquantised rows of a multiple of 128 "
                     "channels");
  }
  const size_t elem = quantize ? 1 : element_bytes(x.element_type());
  if (elem == 0) return invalid("dispatch: x must be bf16, f16, f32 or f8e4m3fn");
  const int T = static_cast<int>(x_dims[0]), H = static_cast<int>(x_dims[1]);
  const int K = static_cast<int>(idx_dims[1]);
  const bool out_scales_used = has_scales || quantize;
  const size_t scale_row = out_scales_used ? sizeof(float) * (H / 128) : 0;
  if (has_scales && x_scales.element_count() != size_t(T) * (H / 128))
    return invalid("dispatch: x_scales must be [T, H / 128]");
  const Transport* t = transport();
  const int R = place.num_ranks;
  if (num_experts < R || num_experts % R != 0)
    return invalid("dispatch: num_experts must be a positive multiple of the " +
                   std::to_string(R) + " ranks of the expert-parallel axis");
  if (capacity < 1 || alignment < 1)
    return invalid("dispatch: capacity and alignment must be >= 1");
  const size_t local_experts = size_t(num_experts / R);
  if (tokens_per_expert->element_count() != local_experts)
    return invalid("dispatch: tokens_per_expert must be [num_experts / " + std::to_string(R) +
                   " ranks]");
  if (topk_weights.element_count() != size_t(T) * K)
    return invalid("dispatch: topk_weights must be [T, K] like topk_idx");
  if (out_topk_idx->element_count() != size_t(capacity) * (expert_major ? 1 : K) ||
      out_topk_weights->element_count() != out_topk_idx->element_count() ||
      group_sizes->element_count() != local_experts)
    return invalid("dispatch: result shapes do not match the layout");
  if (send_slot->element_count() != size_t(T) * (expert_major ? K : R) ||
      src_rank->element_count() != size_t(capacity) ||
      out_x->element_count() != size_t(capacity) * H ||
      pair_row->element_count() != (expert_major ? size_t(R) * T * K : 0))
    return invalid("dispatch: result shapes do not match the capacity and EP size");
  // the kernels write capacity rows of x's element type, e4m3 when quantising (and scales)
  const auto out_type = quantize ? ffi::DataType::F8E4M3FN : x.element_type();
  if (out_x->element_type() != out_type ||
      (out_scales_used && out_scales->element_count() != size_t(capacity) * (H / 128)))
    return invalid("dispatch: the rows' result must have x's dtype (e4m3 when quantising) "
                   "and the scales' [capacity, H / 128]");
  // pull, the fused push, or pull with the rows moved by the copy engines
  if (path != "pull" && path != "fused" && path != "copy")
    return invalid("dispatch: path must be pull, fused or copy, got " + std::string(path));
  // source_slots moves its rows by the copy engines or, with path fused, by the SMs
  if (source_slots && path != "copy" && path != "fused")
    return invalid("dispatch: the source_slots layout takes the copy or the fused path, got " +
                   std::string(path));
  if (source_slots && t != nullptr && capacity != int64_t(R) * T)
    return invalid("dispatch: source_slots needs capacity = " +
                   std::to_string(int64_t(R) * T) + " (ranks x tokens)");
  const bool copy_engine = path == "copy";
  const bool push = path == "fused";
  if (push && (expert_major ? K : R) > kMaxSources)
    return invalid("dispatch: push mode supports at most " + std::to_string(kMaxSources) +
                   (expert_major ? " top-k slots" : " ranks"));
  if (push && expert_major && R > kMaxStageRanks)  // a chunk range per source rank
    return invalid("dispatch: the push dispatch of expert_major supports at most " +
                   std::to_string(kMaxStageRanks) + " ranks");
  if (copy_engine && R > kMaxCopyRanks)
    return invalid("dispatch: the copy-engine path (path copy and the source_slots layout) "
                   "supports at most " + std::to_string(kMaxCopyRanks) + " ranks");
  const size_t tables = dispatch_table_bytes(R, static_cast<int>(num_experts), expert_major);
  if (!source_slots && tables > size_t(max_block_shared_memory()))
    return invalid("dispatch: the routing tables of " + std::to_string(num_experts) +
                   " experts on " + std::to_string(R) + " ranks need " + std::to_string(tables) +
                   " bytes of shared memory per block, above the " +
                   std::to_string(max_block_shared_memory()) + " this GPU allows" +
                   (expert_major ? " (the rank_major layout needs far less)" : ""));
  // source_slots by the SMs uses the copy engines' landing areas where it cannot store in place
  const bool landing = copy_engine || source_slots;
  // rank_major's push is the lean push wherever the XLA windows are open (a job-wide state, so
  // every PE runs the same protocol)
  const bool lean = push && !expert_major && !source_slots && R <= kMaxStageRanks &&
                    t != nullptr && t->xla_windows != nullptr;
  RegionPlan plan = landing ? plan_dispatch_copy(R, T, K, static_cast<int>(num_experts),
                                                     expert_major, size_t(H) * elem,
                                                     scale_row)
                    : lean  ? plan_dispatch_lean(R, T, K, static_cast<int>(num_experts),
                                                 static_cast<int>(capacity), size_t(H) * elem,
                                                 scale_row)
                            : plan_dispatch(R, T, K, static_cast<int>(num_experts),
                                            expert_major, size_t(H) * elem, scale_row);
  PushPlan push_plan =
      plan_dispatch_push(R, T, K, static_cast<int>(num_experts), expert_major,
                         static_cast<int>(capacity), size_t(H) * elem, scale_row);
  DispatchArgs a{};
  const size_t needed = landing || lean ? plan.end
                                    : dispatch_bytes(R, T, K, static_cast<int>(num_experts),
                                                     expert_major, static_cast<int>(capacity),
                                                     size_t(H) * elem, scale_row, push);
  if (auto err = peer_context("dispatch", rank, needed, tuning, place, &a.ctx); err.failure())
    return err;
  a.plan = plan;
  a.push = push_plan;
  a.fused = push;
  a.lean = lean;
  a.copy_engine = copy_engine;
  a.source_slots = source_slots;
  a.copy_chunk_bytes = size_t(std::max<int64_t>(tuning.copy_chunk_bytes, 1));
  a.num_tokens = T;
  a.num_topk = K;
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = static_cast<int>(capacity);
  a.alignment = static_cast<int>(alignment);
  a.expert_major = expert_major;
  a.num_blocks = copy_engine ? copy_engine_blocks(tuning.num_blocks)
                             : blocks_or_default(tuning.num_blocks);
  a.x = x.untyped_data();
  a.x_row_bytes = size_t(H) * elem;
  a.scales = has_scales ? x_scales.typed_data() : nullptr;
  // the lean push quantises as it stores; every other path moves rows quantised here first
  a.quantize = quantize && lean;
  a.ue8m0 = ue8m0;
  a.x_type = x_type;
  if (quantize && !lean) {
    const size_t data_bytes = (size_t(T) * H + 15) / 16 * 16;
    const std::optional<void*> rows = scratch.Allocate(data_bytes + size_t(T) * scale_row, 16);
    if (!rows.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_ep dispatch: no scratch memory for the quantised rows");
    char* base = static_cast<char*>(*rows);
    if (auto err = cuda_error(launch_quantize_fp8(x.untyped_data(), x_type, T, H, ue8m0, base,
                                                  reinterpret_cast<float*>(base + data_bytes),
                                                  stream),
                              "dispatch (quantising)");
        err.failure())
      return err;
    a.x = base;
    a.scales = reinterpret_cast<float*>(base + data_bytes);
  }
  a.scale_row_bytes = scale_row;
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.out_x = out_x->untyped_data();
  a.out_scales = out_scales->typed_data();
  a.out_topk_idx = out_topk_idx->typed_data();
  a.out_topk_weights = out_topk_weights->typed_data();
  a.tokens_per_expert = tokens_per_expert->typed_data();
  a.group_sizes = group_sizes->typed_data();
  a.num_received = num_received->typed_data();
  a.num_dropped = num_dropped->typed_data();
  a.send_slot = send_slot->typed_data();
  a.src_rank = src_rank->typed_data();
  a.src_token = src_token->typed_data();
  a.src_k = src_k->typed_data();
  a.pair_row = expert_major ? pair_row->typed_data() : nullptr;
  // The fused rank_major path lets the peers store rows straight into this PE's outputs when
  // XLA's allocation holding them is mapped at the peers.
  const size_t rows = size_t(a.capacity);
  a.direct_out = push && !expert_major && in_xla_window(a.out_x, rows * a.x_row_bytes) &&
                 (!out_scales_used || in_xla_window(a.out_scales, rows * a.scale_row_bytes));
  // The pull path lets the peers read this PE's inputs where XLA keeps them.
  const size_t pairs_bytes = size_t(T) * size_t(K) * sizeof(int32_t);
  a.in_place = !push && !copy_engine && !quantize &&
               in_xla_window(a.x, size_t(T) * a.x_row_bytes) &&
               (!has_scales || in_xla_window(a.scales, size_t(T) * a.scale_row_bytes)) &&
               in_xla_window(a.topk_idx, pairs_bytes) && in_xla_window(a.topk_weights, pairs_bytes);
  return cuda_error(launch_dispatch(a, stream), "dispatch");
}

ffi::Error cached_dispatch_impl(cudaStream_t stream, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_token,
                                ffi::Buffer<ffi::S32> pair_row, ffi::AnyBuffer y,
                                ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> rank,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::F32> d_weights, EpGroup group,
                                Tuning tuning) {
  GroupPlace place;
  if (auto err = group_place("cached_dispatch", group, &place); err.failure()) return err;
  auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("cached_dispatch: x must be [T, D]");
  const size_t row_bytes = size_t(dims[1]) * element_bytes(x.element_type());
  if (row_bytes == 0 && dims[1] != 0) return invalid("cached_dispatch: unsupported dtype");
  const int T = static_cast<int>(dims[0]), C = static_cast<int>(src_rank.element_count());
  if (out->element_count() != size_t(C) * dims[1] || src_token.element_count() != size_t(C) ||
      out->element_type() != x.element_type())
    return invalid("cached_dispatch: result must be [capacity, D] of x's dtype");
  CachedDispatchArgs a{};
  if (auto err =
          peer_context("cached_dispatch", rank, cached_dispatch_bytes(T, row_bytes), tuning,
                       place, &a.ctx);
      err.failure())
    return err;
  // expert_major handles carry pair_row [R, T, K]; the others an empty one
  const size_t pairs = pair_row.element_count(), per_token = size_t(a.ctx.num_ranks) * T;
  if (pairs != 0 && (T == 0 || pairs % per_token != 0 || pairs / per_token > kMaxSources))
    return invalid("cached_dispatch: pair_row must be [ranks, T, K] with K <= " +
                   std::to_string(kMaxSources) + ", or empty");
  a.num_topk = pairs ? static_cast<int>(pairs / per_token) : 0;
  a.pair_row = pairs ? pair_row.typed_data() : nullptr;
  // the combine's backward (weights given): out = weights * rows, d_weights = <rows, y>
  if (weights.element_count() != 0) {
    if (pairs == 0)
      return invalid("cached_dispatch: row weights need an expert_major handle (pair_row)");
    if (weights.element_count() != size_t(C) || d_weights->element_count() != size_t(C) ||
        y.element_type() != x.element_type() || y.element_count() != size_t(C) * dims[1])
      return invalid("cached_dispatch: weights and d_weights must be [capacity] and y "
                     "[capacity, D] of x's dtype");
    if (!float_element(x.element_type(), &a.dtype))
      return invalid("cached_dispatch: weighted rows must be bf16, f16 or f32");
    a.weights = weights.typed_data();
    a.y = y.untyped_data();
    a.d_weights = d_weights->typed_data();
  }
  a.num_tokens = T;
  a.capacity = C;
  a.num_blocks = blocks_or_default(tuning.num_blocks);
  a.x = x.untyped_data();
  a.row_bytes = row_bytes;
  a.src_rank = src_rank.typed_data();
  a.src_token = src_token.typed_data();
  a.out = out->untyped_data();
  return cuda_error(launch_cached_dispatch(a, stream), "cached_dispatch");
}

ffi::Error combine_impl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> send_slot,
                        ffi::Buffer<ffi::S32> num_received, ffi::Buffer<ffi::S32> src_rank,
                        ffi::Buffer<ffi::S32> src_token, ffi::Buffer<ffi::S32> pair_row,
                        ffi::Buffer<ffi::S32> rank,
                        ffi::Result<ffi::AnyBuffer> out, int64_t num_experts,
                        std::string_view layout_name, std::string_view path, EpGroup group,
                        Tuning tuning) {
  GroupPlace place;
  if (auto err = group_place("combine", group, &place); err.failure()) return err;
  Layout layout;
  if (auto err = parse_layout("combine", layout_name, &layout); err.failure()) return err;
  if (path != "pull" && path != "copy" && path != "push")
    return invalid("combine: path must be pull, copy or push, got " + std::string(path));
  const bool expert_major = layout == Layout::kExpertMajor;
  const bool source_slots = layout == Layout::kSourceSlots;
  const bool copy_engine = path == "copy";
  const bool push = path == "push";
  if (push && (expert_major || source_slots))
    return invalid("combine: the push path needs the rank_major layout");
  auto y_dims = y.dimensions();
  auto idx_dims = topk_idx.dimensions();
  if (y_dims.size() != 2 || idx_dims.size() != 2)
    return invalid("combine: y must be [C, H] and topk_idx [T, K]");
  ElementType dtype;
  if (!float_element(y.element_type(), &dtype))
    return invalid("combine: y must be bf16, f16 or f32");
  const int C = static_cast<int>(y_dims[0]), H = static_cast<int>(y_dims[1]);
  const int T = static_cast<int>(idx_dims[0]), K = static_cast<int>(idx_dims[1]);
  if (weights.element_count() != size_t(C) || src_rank.element_count() != size_t(C) ||
      src_token.element_count() != size_t(C))
    return invalid("combine: weights, src_rank and src_token must be [C]");
  if (out->element_count() != size_t(T) * H || out->element_type() != y.element_type())
    return invalid("combine: result must be [T, H] of y's dtype");
  const size_t row_bytes = size_t(H) * element_bytes(y.element_type());
  const int R = place.num_ranks;
  if (copy_engine && (expert_major || R > kMaxCopyRanks))
    return invalid("combine: the copy-engine path needs rank_major and at most " +
                   std::to_string(kMaxCopyRanks) + " ranks");
  if (source_slots && (expert_major || C != int64_t(R) * T))
    return invalid("combine: source_slots needs rank_major rows and [ranks x tokens, H] y");
  CombineArgs a{};
  const size_t needed = push          ? plan_combine_push(R, T, row_bytes).end
                        : !copy_engine  ? combine_bytes(C, row_bytes)
                        : source_slots ? plan_combine_slots(R, T, row_bytes).end
                                       : plan_combine_copy(R, T, row_bytes).end;
  if (auto err = peer_context("combine", rank, needed, tuning, place, &a.ctx); err.failure())
    return err;
  a.copy_engine = copy_engine;
  a.source_slots = source_slots;
  a.copy_chunk_bytes = size_t(std::max<int64_t>(tuning.copy_chunk_bytes, 1));
  if (num_experts < a.ctx.num_ranks || num_experts % a.ctx.num_ranks != 0)
    return invalid("combine: num_experts must be a positive multiple of the " +
                   std::to_string(a.ctx.num_ranks) + " ranks of the expert-parallel axis");
  if (send_slot.element_count() != size_t(T) * (expert_major ? K : a.ctx.num_ranks))
    return invalid("combine: send_slot does not match the layout");
  if (a.ctx.num_ranks > kMaxSources || (expert_major && K > kMaxSources))
    return invalid("combine: at most " + std::to_string(kMaxSources) +
                   " ranks and (expert_major) top-k slots are supported");
  if (pair_row.element_count() != (expert_major ? size_t(a.ctx.num_ranks) * T * K : 0))
    return invalid("combine: pair_row must be the dispatch's ([ranks, T, K] for expert_major, "
                   "else empty)");
  a.num_tokens = T;
  a.num_topk = K;
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = C;
  a.hidden = H;
  a.expert_major = expert_major;
  a.num_blocks = a.copy_engine ? copy_engine_blocks(tuning.num_blocks)
                               : blocks_or_default(tuning.num_blocks);
  a.dtype = dtype;
  a.y = y.untyped_data();
  a.weights = weights.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.send_slot = send_slot.typed_data();
  a.num_received = num_received.typed_data();
  a.src_rank = src_rank.typed_data();
  a.src_token = src_token.typed_data();
  a.push = push;
  a.pair_row = expert_major ? pair_row.typed_data() : nullptr;
  a.out = out->untyped_data();
  // The pull path leaves y and the weights where XLA keeps them when that allocation is
  // mapped at the peers (jax_ep.runtime maps it at initialisation where it can).
  a.unstaged = !copy_engine && !push && !expert_major &&
               in_xla_window(a.y, size_t(C) * row_bytes) &&
               in_xla_window(a.weights, sizeof(float) * C);
  return cuda_error(launch_combine(a, stream), "combine");
}

}  // namespace
}  // namespace jax_ep

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatch, jax_ep::dispatch_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("alignment")
                                  .Attr<std::string_view>("layout")
                                  .Attr<std::string_view>("path")
                                  .Attr<bool>("has_scales")
                                  .Attr<bool>("quantize")
                                  .Attr<bool>("ue8m0")
                                  .Attr<jax_ep::EpGroup>("group")
                                  .Attr<jax_ep::Tuning>("tuning"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCachedDispatch, jax_ep::cached_dispatch_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<jax_ep::EpGroup>("group")
                                  .Attr<jax_ep::Tuning>("tuning"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombine, jax_ep::combine_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<std::string_view>("layout")
                                  .Attr<std::string_view>("path")
                                  .Attr<jax_ep::EpGroup>("group")
                                  .Attr<jax_ep::Tuning>("tuning"));
