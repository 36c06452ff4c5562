// The network stage of the hierarchical (across nodes) normal mode: an exchange within a group
// that has one rank on every node (the ranks of the same local index), by NVSHMEM puts.
//
// Send (dispatch direction): every PE puts each of its tokens once to every other node that
// holds one of its experts, into the inbox of the rank of its own local index there, with its
// ids and weights; the receiving side lays out N blocks of T "virtual tokens" (block s: node
// s's tokens, this PE's own in its own block) with ids relative to this node's experts, -1
// elsewhere. The node's ranks then dispatch those among themselves over NVLink.
//
// Return (combine direction): the node's partial sums of every virtual token go back to their
// source, one row per (token, node) that had any of its experts; the owner adds the partials of
// the nodes in node order (float32) and rounds once.
//
// Protocol: a PE puts into a peer only after the peer's `entered` flag for the call (the peer's
// node has finished every access to its buffer); after its puts it raises `ready` at every peer
// (nvshmem_quiet first); the receiving kernel waits for every peer's `ready`, then reads its
// inbox, and its last block ends the call (done to this node's PEs). Waits are bounded and
// name the peer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/buffer_layout.h"
#include "transport/peers.cuh"

namespace jax_ep {

enum class NodeElement { kBF16, kF16, kF32 };

struct NodeSendArgs {
  PeerContext ctx;  // the group with one rank per node; rank = this PE's node
  int num_tokens, num_topk;
  int experts_per_node;  // global expert e is on node e / experts_per_node
  size_t row_bytes, scale_bytes;  // scale_bytes 0: no FP8 scales
  const void* x;
  const float* scales;
  const int32_t* topk_idx;
  const float* topk_weights;
  void* out_x;           // [N*T] rows
  float* out_scales;     // [N*T] scale rows (scale_bytes > 0)
  int32_t* out_ids;      // [N*T, K] ids relative to this node's experts, -1 elsewhere
  float* out_weights;    // [N*T, K], 0 where the id is -1
  NodePlan plan;
};

struct NodeReturnArgs {
  PeerContext ctx;
  int num_tokens, num_topk, experts_per_node;
  size_t row_bytes;
  NodeElement element;
  const void* partial;      // [N*T] rows: this node's sums of every virtual token
  const int32_t* node_ids;  // [N*T, K] the send's out_ids: a virtual token is present where any >= 0
  const int32_t* topk_idx;  // [T, K] this PE's own tokens' global ids
  void* out;                // [T] rows
  NodePlan plan;
};

cudaError_t launch_node_send(const NodeSendArgs& a, int blocks, cudaStream_t stream);
cudaError_t launch_node_return(const NodeReturnArgs& a, int blocks, cudaStream_t stream);

}  // namespace jax_ep
