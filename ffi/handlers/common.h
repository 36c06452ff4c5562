// Small helpers shared by the typed-FFI handlers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

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

// A call's tuning, resolved from its jax_ep.Config on the Python side (config.py,
// tuning_attributes) and passed as the `tuning` dictionary attribute of every custom call.
struct Tuning {
  int64_t num_blocks;        // CTAs per kernel; 0: the kernel's own count
  int64_t copy_chunk_bytes;  // rows per copy-engine transfer
  double timeout_s;          // a device-side wait longer than this traps, naming the peer

  uint64_t timeout_ns() const {
    return static_cast<uint64_t>((timeout_s > 0 ? timeout_s : 100.0) * 1e9);
  }
};

// The row layouts of the normal mode (jax_ep._types: RANK_MAJOR, EXPERT_MAJOR, SOURCE_SLOTS).
enum class Layout { kRankMajor, kExpertMajor, kSourceSlots };

inline bool parse_layout(std::string_view name, Layout* out) {
  if (name == "rank_major") *out = Layout::kRankMajor;
  else if (name == "expert_major") *out = Layout::kExpertMajor;
  else if (name == "source_slots") *out = Layout::kSourceSlots;
  else return false;
  return true;
}

}  // namespace jax_ep

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::Tuning,
                                      ::xla::ffi::StructMember<int64_t>("num_blocks"),
                                      ::xla::ffi::StructMember<int64_t>("copy_chunk_bytes"),
                                      ::xla::ffi::StructMember<double>("timeout_s"));
