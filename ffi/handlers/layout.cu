// jax_ep_layout: tokens per rank, (token, k) pairs per expert, token-in-rank mask.
#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/layout.h"

namespace jax_ep {
namespace {

ffi::Error layout_impl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                       ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                       ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                       ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                       int64_t num_ranks) {
  auto dims = topk_idx.dimensions();
  if (dims.size() != 2) return invalid("layout: topk_idx must be [tokens, top_k]");
  if (num_ranks < 1 || num_experts < num_ranks || num_experts % num_ranks != 0)
    return invalid("layout: num_experts (" + std::to_string(num_experts) +
                   ") must be a positive multiple of num_ranks (" + std::to_string(num_ranks) +
                   ")");
  if (dims[0] > INT32_MAX || dims[1] > INT32_MAX || num_experts > INT32_MAX)
    return invalid("layout: shapes must fit in 32 bits");
  if (tokens_per_rank->element_count() != num_ranks ||
      tokens_per_expert->element_count() != num_experts ||
      is_token_in_rank->element_count() != dims[0] * num_ranks)
    return invalid("layout: result shapes do not match num_ranks / num_experts");
  return cuda_error(
      launch_layout(topk_idx.typed_data(), static_cast<int>(dims[0]), static_cast<int>(dims[1]),
                    static_cast<int>(num_experts), static_cast<int>(num_ranks),
                    tokens_per_rank->typed_data(), tokens_per_expert->typed_data(),
                    is_token_in_rank->typed_data(), stream),
      "layout kernel");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayout, jax_ep::layout_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"));
