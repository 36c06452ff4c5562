"""Expert feed-forward computations on rows grouped by local expert.

Rows arrive from ``dispatch(..., layout="expert_major")`` grouped by local expert: group ``g``
is rows ``[sum(group_sizes[:g]), sum(group_sizes[:g + 1]))``; rows past ``sum(group_sizes)``
are padding and come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x, w, group_sizes):
    """``x [M, K]`` rows grouped by expert times ``w [L, K, N]`` -> ``[M, N]`` in x's dtype,
    accumulated in float32."""
    return jax.lax.ragged_dot(x, w, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def swiglu_mlp(rows, w_gate, w_up, w_down, group_sizes):
    """SwiGLU experts: ``(silu(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e]`` per group.

    rows [M, H]; w_gate, w_up [L, H, F]; w_down [L, F, H] -> [M, H] in rows' dtype.
    """
    gate = grouped_matmul(rows, w_gate, group_sizes)
    up = grouped_matmul(rows, w_up, group_sizes)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
    return grouped_matmul(h, w_down, group_sizes)


def dense_swiglu(x, w_gate, w_up, w_down):
    """Every expert on every row (the oracle): x [T, H] -> [T, L, H] float32."""
    gate = jnp.einsum("th,lhf->tlf", x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("th,lhf->tlf", x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.einsum("tlf,lfh->tlh", h, w_down, preferred_element_type=jnp.float32)
