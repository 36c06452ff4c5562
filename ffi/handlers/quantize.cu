// jax_ep_quantize_fp8: FP8 block quantisation of a [rows, hidden] array (no communication).
#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/quantize.h"

namespace jax_ep {
namespace {

ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> data,
                         ffi::Result<ffi::Buffer<ffi::F32>> scales, bool ue8m0) {
  // [..., hidden]: every leading dimension counts rows (jax.vmap adds one)
  auto dims = x.dimensions();
  if (dims.size() < 2 || dims.back() % 128 != 0)
    return invalid("quantize_fp8: x must be [..., rows, hidden] with hidden a multiple of 128");
  const int64_t hidden = dims.back(), rows = int64_t(x.element_count()) / hidden;
  ElementType type;
  if (!float_element(x.element_type(), &type))
    return invalid("quantize_fp8: x must be bfloat16, float16 or float32");
  if (data->element_type() != ffi::DataType::F8E4M3FN)
    return invalid("quantize_fp8: the data result must be float8_e4m3fn");
  if (data->element_count() != size_t(rows * hidden) ||
      scales->element_count() != size_t(rows * (hidden / 128)))
    return invalid("quantize_fp8: result shapes do not match x");
  return cuda_error(launch_quantize_fp8(x.untyped_data(), type, rows, hidden, ue8m0,
                                        data->untyped_data(), scales->typed_data(), stream),
                    "quantize_fp8 kernel");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpQuantizeFp8, jax_ep::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<bool>("ue8m0"));
