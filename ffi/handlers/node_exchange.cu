// Typed-FFI handlers of the node exchange (the network stage of the hierarchical normal mode,
// kernels/node_exchange.h): jax_ep_node_send and jax_ep_node_return. Their group has one rank
// on every node (the ranks of one local index); they validate shapes, check the symmetric
// buffer, fill the kernels' arguments and launch.
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/buffer_layout.h"
#include "kernels/node_exchange.h"
#include "runtime/diagnostics.h"
#include "runtime/runtime.h"

namespace jax_ep {
namespace {

constexpr int kDefaultBlocks = 32;
constexpr int kMaxNodeTopk = 32;  // a warp holds a token's ids, one per lane
constexpr int kMaxNodes = 64;     // the return's per-token node mask

ffi::Error node_context(const char* op, ffi::Buffer<ffi::S32> rank, const EpGroup& group,
                        int64_t num_experts, int64_t num_topk, const Tuning& tuning,
                        PeerContext* ctx) {
  const Transport* t = transport();
  if (t == nullptr)
    return invalid(std::string(op) + ": the runtime is not initialised: call "
                   "jax_ep.runtime.initialize() after jax.distributed.initialize()");
  if (rank.element_count() != 1) return invalid(std::string(op) + ": rank must be a scalar");
  GroupPlace place;
  if (auto err = place_in_group(op, group, *t, /*across_nodes=*/true, &place); err.failure())
    return err;
  if (place.num_ranks > kMaxNodes)
    return invalid(std::string(op) + ": at most " + std::to_string(kMaxNodes) + " nodes");
  if (num_experts < place.num_ranks || num_experts % place.num_ranks != 0)
    return invalid(std::string(op) + ": num_experts must be a positive multiple of the " +
                   std::to_string(place.num_ranks) + " nodes");
  if (num_topk < 1 || num_topk > kMaxNodeTopk)
    return invalid(std::string(op) + ": top-k must be in [1, " + std::to_string(kMaxNodeTopk) +
                   "] across nodes");
  *ctx = PeerContext{t->peers,           place.rank,        place.num_ranks,
                    tuning.timeout_ns(), rank.typed_data(), device_fault_record(),
                    next_profile_row(),  place.base,        place.stride,
                    t->num_ranks,        t->spans_nodes};
  return ffi::Error::Success();
}

ffi::Error check_bytes(const char* op, const NodePlan& plan) {
  const size_t have = transport()->bytes;
  if (plan.end > have)
    return invalid(std::string(op) + ": this call needs a symmetric buffer of " +
                   std::to_string(plan.end) + " bytes but the runtime has " +
                   std::to_string(have) + "; pass buffer_bytes >= " + std::to_string(plan.end) +
                   " to jax_ep.runtime.initialize()");
  return ffi::Error::Success();
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

ffi::Error node_send_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                          ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> out_x,
                          ffi::ResultBuffer<ffi::F32> out_scales,
                          ffi::ResultBuffer<ffi::S32> out_ids,
                          ffi::ResultBuffer<ffi::F32> out_weights, int64_t num_experts,
                          EpGroup group, Tuning tuning) {
  const char* op = "dispatch across nodes";
  auto x_dims = x.dimensions();
  auto idx_dims = topk_idx.dimensions();
  if (x_dims.size() != 2 || idx_dims.size() != 2 || idx_dims[0] != x_dims[0])
    return invalid(std::string(op) + ": x must be [T, H] and topk_idx [T, K]");
  const int64_t T = x_dims[0], H = x_dims[1], K = idx_dims[1];
  NodeSendArgs a{};
  if (auto err = node_context(op, rank, group, num_experts, K, tuning, &a.ctx); err.failure())
    return err;
  const int64_t N = a.ctx.num_ranks;
  const size_t elem = element_bytes(x.element_type());
  if (elem == 0) return invalid(std::string(op) + ": x must be bf16, f16, f32 or float8_e4m3fn");
  if (topk_weights.element_count() != size_t(T * K))
    return invalid(std::string(op) + ": topk_weights must be [T, K]");
  const bool has_scales = scales.element_count() > 0;
  const int64_t S = has_scales ? int64_t(scales.element_count()) / T : 0;
  if (has_scales && size_t(S * T) != scales.element_count())
    return invalid(std::string(op) + ": scales must be [T, H / 128]");
  if (out_x->element_count() != size_t(N * T * H) || out_ids->element_count() != size_t(N * T * K) ||
      out_weights->element_count() != size_t(N * T * K) ||
      out_scales->element_count() != size_t(has_scales ? N * T * S : 0))
    return invalid(std::string(op) + ": results must be [nodes * T, ...]");
  a.num_tokens = static_cast<int>(T);
  a.num_topk = static_cast<int>(K);
  a.experts_per_node = static_cast<int>(num_experts / N);
  a.row_bytes = size_t(H) * elem;
  a.scale_bytes = sizeof(float) * size_t(S);
  a.x = x.untyped_data();
  a.scales = has_scales ? scales.typed_data() : nullptr;
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.out_x = out_x->untyped_data();
  a.out_scales = has_scales ? out_scales->typed_data() : nullptr;
  a.out_ids = out_ids->typed_data();
  a.out_weights = out_weights->typed_data();
  a.plan = plan_node_exchange(int(N), int(T), int(K), a.row_bytes, a.scale_bytes, false);
  if (auto err = check_bytes(op, a.plan); err.failure()) return err;
  return cuda_error(launch_node_send(a, blocks_or_default(tuning.num_blocks), stream), op);
}

ffi::Error node_return_impl(cudaStream_t stream, ffi::AnyBuffer partial,
                            ffi::Buffer<ffi::S32> node_ids, ffi::Buffer<ffi::S32> topk_idx,
                            ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> out,
                            int64_t num_experts, EpGroup group, Tuning tuning) {
  const char* op = "combine across nodes";
  auto idx_dims = topk_idx.dimensions();
  auto p_dims = partial.dimensions();
  if (idx_dims.size() != 2 || p_dims.size() != 2)
    return invalid(std::string(op) + ": partial must be [nodes * T, H] and topk_idx [T, K]");
  const int64_t T = idx_dims[0], K = idx_dims[1], H = p_dims[1];
  NodeReturnArgs a{};
  if (auto err = node_context(op, rank, group, num_experts, K, tuning, &a.ctx); err.failure())
    return err;
  const int64_t N = a.ctx.num_ranks;
  if (p_dims[0] != N * T || node_ids.element_count() != size_t(N * T * K))
    return invalid(std::string(op) + ": partial must be [nodes * T, H], node_ids [nodes * T, K]");
  if (out->element_count() != size_t(T * H) || out->element_type() != partial.element_type())
    return invalid(std::string(op) + ": the result must be [T, H] in the partials' dtype");
  switch (partial.element_type()) {
    case ffi::DataType::BF16: a.element = NodeElement::kBF16; break;
    case ffi::DataType::F16: a.element = NodeElement::kF16; break;
    case ffi::DataType::F32: a.element = NodeElement::kF32; break;
    default: return invalid(std::string(op) + ": partials must be bf16, f16 or f32");
  }
  a.num_tokens = static_cast<int>(T);
  a.num_topk = static_cast<int>(K);
  a.experts_per_node = static_cast<int>(num_experts / N);
  a.row_bytes = size_t(H) * element_bytes(partial.element_type());
  a.partial = partial.untyped_data();
  a.node_ids = node_ids.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.out = out->untyped_data();
  a.plan = plan_node_exchange(int(N), int(T), int(K), a.row_bytes, 0, true);
  if (auto err = check_bytes(op, a.plan); err.failure()) return err;
  return cuda_error(launch_node_return(a, blocks_or_default(tuning.num_blocks), stream), op);
}

}  // namespace
}  // namespace jax_ep

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpNodeSend, jax_ep::node_send_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<jax_ep::EpGroup>("group")
                                  .Attr<jax_ep::Tuning>("tuning"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpNodeReturn, jax_ep::node_return_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<jax_ep::EpGroup>("group")
                                  .Attr<jax_ep::Tuning>("tuning"));
