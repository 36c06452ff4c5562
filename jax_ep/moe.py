"""A complete expert-parallel MoE feed-forward block built on dispatch/combine.

Router -> top-k -> dispatch -> per-expert MLP (``jax.lax.ragged_dot``) -> combine. Runs per
device inside ``jax.shard_map``: tokens are sharded over the EP axis, and each rank holds the
weights of its ``num_experts // R`` local experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import api
from jax_ep._types import EXPERT_MAJOR, RANK_MAJOR, SOURCE_SLOTS


def route(x, router_weights, top_k):
    """Top-k softmax gating: (expert ids [T, K] int32, gate weights [T, K] float32)."""
    logits = jnp.dot(x.astype(jnp.float32), router_weights.astype(jnp.float32))
    top_logits, top_idx = jax.lax.top_k(logits, top_k)
    return top_idx.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def expert_mlp(rows, w_in, w_out, group_sizes):
    """rows grouped by local expert: gelu(rows @ w_in[e]) @ w_out[e], one ragged_dot per layer."""
    h = jax.lax.ragged_dot(rows, w_in, group_sizes, preferred_element_type=jnp.float32)
    h = jax.nn.gelu(h).astype(rows.dtype)
    return jax.lax.ragged_dot(h, w_out, group_sizes, preferred_element_type=jnp.float32)


def moe_block(x, router_weights, w_in, w_out, *, top_k, axis_name, capacity=None,
              layout=EXPERT_MAJOR, expert_alignment=1, backend="auto"):
    """One MoE feed-forward block on this rank's tokens.

    Args:
      x: [T, H] local tokens.
      router_weights: [H, E] (replicated).
      w_in: [L, H, F], w_out: [L, F, H]: this rank's experts (E = L * R).
    Returns:
      ([T, H] output in x's dtype, number of rows this rank dropped for lack of capacity).
    """
    num_ranks = jax.lax.axis_size(axis_name)
    num_experts = w_in.shape[0] * num_ranks
    topk_idx, gates = route(x, router_weights, top_k)
    out = api.dispatch(x, topk_idx, gates, num_experts=num_experts, axis_name=axis_name,
                       capacity=capacity, layout=layout, expert_alignment=expert_alignment,
                       backend=backend)
    if layout == EXPERT_MAJOR:
        y = expert_mlp(out.x, w_in, w_out, out.group_sizes).astype(x.dtype)
        return api.combine(y, out.handle, weights=out.topk_weights), out.num_dropped
    if layout not in (RANK_MAJOR, SOURCE_SLOTS):
        raise ValueError(f"unknown layout {layout!r}")
    # rank_major / source_slots rows carry all of a token's local experts: run each expert on
    # all rows and keep its gate (zero where the expert is not among the token's top-k, and on
    # unused rows).
    y = jnp.zeros(out.x.shape, jnp.float32)
    for e in range(w_in.shape[0]):
        gate = jnp.sum(jnp.where(out.topk_idx == e, out.topk_weights, 0.0), axis=-1)
        h = jax.nn.gelu(jnp.dot(out.x, w_in[e], preferred_element_type=jnp.float32))
        y = y + gate[:, None] * jnp.dot(h.astype(x.dtype), w_out[e],
                                        preferred_element_type=jnp.float32)
    return api.combine(y.astype(x.dtype), out.handle), out.num_dropped


def dense_moe_block(x, router_weights, w_in, w_out, *, top_k):
    """Single-device oracle: every expert's weights on one device, no communication."""
    topk_idx, gates = route(x, router_weights, top_k)
    h = jax.nn.gelu(jnp.einsum("th,ehf->tef", x, w_in, preferred_element_type=jnp.float32))
    y = jnp.einsum("tef,efh->teh", h.astype(x.dtype), w_out, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(y, topk_idx[:, :, None], axis=1)  # [T, K, H]
    return jnp.sum(gates[:, :, None] * picked, axis=1).astype(x.dtype)
