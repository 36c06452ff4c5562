// Dispatch layout: which ranks and experts each token goes to (DeepEP's semantics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

// topk_idx [T, K]; ids outside [0, E) count as "no expert".
// Writes tokens_per_rank [R], tokens_per_expert [E], is_token_in_rank [T, R].
cudaError_t launch_layout(const int32_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                          int num_ranks, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream);

}  // namespace jax_ep
