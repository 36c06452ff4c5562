// jax_ep_grouped_matmul: rows grouped by expert times each expert's weights
// (experts.grouped_matmul(impl="cuda"); kernels/grouped_gemm.h). No communication and no
// runtime state: it runs without runtime.initialize().
#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "kernels/grouped_gemm.h"

namespace jax_ep {
namespace {

std::string dims_text(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// group_ends: the inclusive sum of the group sizes (negative sizes counted as 0). row_index:
// empty, or the x row of each result row (the rows gathered by index).
ffi::Error grouped_matmul_impl(cudaStream_t stream, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> row_index, ffi::AnyBuffer w,
                               ffi::Buffer<ffi::S32> group_ends,
                               ffi::Result<ffi::AnyBuffer> out, bool transpose_w,
                               int64_t sm_count) {
  auto dx = x.dimensions(), dw = w.dimensions(), dy = out->dimensions();
  if (dx.size() != 2 || dw.size() != 3 || dy.size() != 2)
    return invalid("grouped_matmul: x must be [rows, K], w [groups, K, N] (or [groups, N, K] "
                   "transposed) and the result [rows, N]");
  const bool gathered = row_index.element_count() != 0;
  const int64_t x_rows = dx[0], k = dx[1], groups = dw[0];
  const int64_t rows = gathered ? static_cast<int64_t>(row_index.element_count()) : x_rows;
  const int64_t kw = transpose_w ? dw[2] : dw[1], n = transpose_w ? dw[1] : dw[2];
  if (kw != k || dy[0] != rows || dy[1] != n ||
      group_ends.element_count() != static_cast<size_t>(groups))
    return invalid("grouped_matmul: shapes do not match (x " + dims_text(dx) + ", " +
                   std::to_string(row_index.element_count()) + " row indices, w " +
                   dims_text(dw) + ", result " + dims_text(dy) + ", " +
                   std::to_string(group_ends.element_count()) + " group ends)");
  if (k % 8 != 0 || n % 8 != 0)
    return invalid("grouped_matmul: K and N must be multiples of 8 (16-byte rows)");
  if (rows > (int64_t(1) << 31) - 1 || x_rows > (int64_t(1) << 31) - 1 || groups > 65535)
    return invalid("grouped_matmul: at most 2^31 - 1 rows and 65535 groups");
  if (sm_count < 0 || sm_count > (1 << 16))
    return invalid("grouped_matmul: sm_count must be 0 (every SM) or a count of SMs");
  ElementType type;
  if (!float_element(x.element_type(), &type) || type == ElementType::kF32 ||
      w.element_type() != x.element_type() || out->element_type() != x.element_type())
    return invalid("grouped_matmul: x, w and the result must all be bfloat16 or all float16");
  return cuda_error(launch_grouped_gemm(x.untyped_data(),
                                        gathered ? row_index.typed_data() : nullptr, x_rows,
                                        w.untyped_data(), group_ends.typed_data(),
                                        out->untyped_data(), type, rows, k, n, groups,
                                        transpose_w,
                                        static_cast<int>(sm_count), stream),
                    "grouped_matmul kernel");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedMatmul, jax_ep::grouped_matmul_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // row_index
                                  .Arg<xla::ffi::AnyBuffer>()                // w
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // group_ends
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_w")
                                  .Attr<int64_t>("sm_count"));
