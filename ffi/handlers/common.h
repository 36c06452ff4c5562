// Small helpers shared by the typed-FFI handlers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/element_type.h"
#include "runtime/runtime.h"
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

// The kernels' element type of a bf16, f16 or f32 buffer; false for any other.
inline bool float_element(ffi::DataType type, ElementType* out) {
  switch (type) {
    case ffi::DataType::BF16: *out = ElementType::kBF16; return true;
    case ffi::DataType::F16: *out = ElementType::kF16; return true;
    case ffi::DataType::F32: *out = ElementType::kF32; return true;
    default: return false;
  }
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

// The call's EP group (its mesh axis): num_ranks devices, `stride` apart in the mesh's
// row-major order (the product of the sizes of the axes after it; 1 for a one-axis mesh).
// Passed as the `group` dictionary attribute of every custom call (jax_ep/_cuda.py).
struct EpGroup {
  int64_t num_ranks;
  int64_t stride;
};

// This PE's place in its group: with the processes listed in mesh order, the group is the PEs
// base + r * stride, r < num_ranks, that share this PE's position on the other axes.
struct GroupPlace {
  int rank, num_ranks, base, stride;
  bool off_node;  // some PE of the group is on another node
};

// across_nodes: the call reaches PEs of other nodes by NVSHMEM puts (the low-latency kernels);
// otherwise a group that leaves this PE's node is an error naming the peer.
inline ffi::Error place_in_group(const char* op, const EpGroup& g, const Transport& t,
                                 bool across_nodes, GroupPlace* out) {
  const int64_t R = g.num_ranks, S = g.stride, pe = t.rank, num_pes = t.num_ranks;
  if (R < 1 || S < 1 || R * S > num_pes)
    return invalid(std::string(op) + ": the expert-parallel axis of " + std::to_string(R) +
                   " devices (stride " + std::to_string(S) + " in the mesh) does not fit the " +
                   std::to_string(num_pes) + " NVSHMEM PEs; the mesh must list the processes "
                   "in order, one GPU each");
  const int64_t rank = pe / S % R, base = pe - rank * S;
  if (base + (R - 1) * S >= num_pes)
    return invalid(std::string(op) + ": PE " + std::to_string(pe) + "'s group on the "
                   "expert-parallel axis (" + std::to_string(R) + " devices, stride " +
                   std::to_string(S) + ") runs past the " + std::to_string(num_pes) + " PEs");
  bool off_node = false;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t peer = base + r * S;
    if (t.host_peers[peer] != nullptr) continue;
    off_node = true;
    if (!across_nodes)
      return invalid(std::string(op) + ": PE " + std::to_string(peer) + " of this call's "
                     "expert-parallel group is on node " + std::to_string(t.node_of[peer]) +
                     ", PE " + std::to_string(pe) + " on node " + std::to_string(t.node_of[pe]) +
                     "; the normal-mode kernels reach the peers of a node only (NVLink/PCIe): "
                     "put the expert axis inside a node, e.g. a mesh (data=nodes, expert=GPUs "
                     "per node), or use the low-latency calls, which cross nodes");
  }
  *out = GroupPlace{int(rank), int(R), int(base), int(S), off_node};
  return ffi::Error::Success();
}

// The row layouts of the normal mode (jax_ep._types: RANK_MAJOR, EXPERT_MAJOR, SOURCE_SLOTS).
enum class Layout { kRankMajor, kExpertMajor, kSourceSlots };

inline ffi::Error parse_layout(const char* op, std::string_view name, Layout* out) {
  if (name == "rank_major") *out = Layout::kRankMajor;
  else if (name == "expert_major") *out = Layout::kExpertMajor;
  else if (name == "source_slots") *out = Layout::kSourceSlots;
  else
    return invalid(std::string(op) + ": layout must be rank_major, expert_major or "
                   "source_slots, got " + std::string(name));
  return ffi::Error::Success();
}

}  // namespace jax_ep

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::EpGroup,
                                      ::xla::ffi::StructMember<int64_t>("num_ranks"),
                                      ::xla::ffi::StructMember<int64_t>("stride"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::Tuning,
                                      ::xla::ffi::StructMember<int64_t>("num_blocks"),
                                      ::xla::ffi::StructMember<int64_t>("copy_chunk_bytes"),
                                      ::xla::ffi::StructMember<double>("timeout_s"));
