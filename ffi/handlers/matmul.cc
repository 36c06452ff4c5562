// jax_ep_batched_matmul: out[l] = op(a[l]) @ op(b[l]) through cuBLASLt, sized for a given
// number of SMs (runtime/blas_lt.h). No communication and no runtime state: it runs without
// runtime.initialize().
#include <cstdint>
#include <string>

#include "handlers/common.h"
#include "handlers/handlers.h"
#include "runtime/blas_lt.h"

namespace jax_ep {
namespace {

bool gemm_type(ffi::DataType type, GemmType* out) {
  switch (type) {
    case ffi::DataType::BF16: *out = GemmType::kBF16; return true;
    case ffi::DataType::F16: *out = GemmType::kF16; return true;
    case ffi::DataType::F32: *out = GemmType::kF32; return true;
    default: return false;
  }
}

ffi::Error batched_matmul_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                               ffi::Result<ffi::AnyBuffer> out, bool trans_a, bool trans_b,
                               int64_t sm_count, bool tf32) {
  auto da = a.dimensions(), db = b.dimensions(), dout = out->dimensions();
  if (da.size() != 3 || db.size() != 3 || dout.size() != 3)
    return invalid("batched_matmul: a, b and the result must be [batch, rows, columns]");
  const int64_t batch = da[0];
  const int64_t m = trans_a ? da[2] : da[1], k = trans_a ? da[1] : da[2];
  const int64_t kb = trans_b ? db[2] : db[1], n = trans_b ? db[1] : db[2];
  if (db[0] != batch || dout[0] != batch || kb != k || dout[1] != m || dout[2] != n)
    return invalid("batched_matmul: shapes do not match (a [" + std::to_string(da[0]) + ", " +
                   std::to_string(da[1]) + ", " + std::to_string(da[2]) + "], b [" +
                   std::to_string(db[0]) + ", " + std::to_string(db[1]) + ", " +
                   std::to_string(db[2]) + "])");
  BatchedGemm gemm{batch, m, n, k, trans_a, trans_b, {}, {}, {}, int(sm_count), tf32};
  if (!gemm_type(a.element_type(), &gemm.a_type) || !gemm_type(b.element_type(), &gemm.b_type) ||
      !gemm_type(out->element_type(), &gemm.out_type))
    return invalid("batched_matmul: operands and result must be bfloat16, float16 or float32");
  if (sm_count < 0 || sm_count > (1 << 16))
    return invalid("batched_matmul: sm_count must be 0 (every SM) or a count of SMs");
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0)
    return cuda_error(cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream),
                      "batched_matmul zero fill");
  const std::string error =
      run_batched_gemm(gemm, a.untyped_data(), b.untyped_data(), out->untyped_data(), stream);
  if (!error.empty())
    return ffi::Error(ffi::ErrorCode::kInternal, "jax_ep batched_matmul: " + error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpBatchedMatmul, jax_ep::batched_matmul_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Attr<int64_t>("sm_count")
                                  .Attr<bool>("tf32"));
