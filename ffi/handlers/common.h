// Small helpers shared by the typed-FFI handlers.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {

namespace ffi = xla::ffi;

inline ffi::Error cuda_error(cudaError_t status, const char* op) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep ") + op + ": " + cudaGetErrorString(status));
}

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_ep: " + message);
}

}  // namespace jax_ep
