"""Expert-parallel MoE feed-forward layers built on dispatch/combine.

Router -> top-k -> dispatch -> per-expert MLP (``jax.lax.ragged_dot``) -> combine. Runs per
device inside ``jax.shard_map``: tokens are sharded over the EP axis, and each rank holds the
weights of its ``num_experts // R`` local experts.

``moe_layer`` is the full layer (SwiGLU experts, optional shared expert, auxiliary losses);
``decode_layer`` the same layer for a decode step through the low-latency calls; ``moe_block``
is the minimal one (GELU experts, any layout).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep import api, experts
from jax_ep import config as _config
from jax_ep import fp8 as _fp8
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


# ----------------------------------------------------------------------------- moe_layer


class MoEParams(NamedTuple):
    """Weights of one ``moe_layer`` (a pytree; the shared expert's three are all set or None).

    Inside ``shard_map`` the expert weights are this rank's ``L = E // R`` experts; outside,
    the global ``[E, ...]`` arrays split on dim 0 over the EP axis (``partition_specs``).

    router:      [H, E] replicated; logits are computed in float32.
    w_gate, w_up: [E or L, H, F] routed experts' SwiGLU input projections.
    w_down:      [E or L, F, H].
    shared_gate, shared_up: [H, S]; shared_down: [S, H]: a dense SwiGLU every token goes
                 through (replicated), or None.
    """

    router: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    shared_gate: jax.Array | None = None
    shared_up: jax.Array | None = None
    shared_down: jax.Array | None = None

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_gate is not None

    def partition_specs(self, axis_name) -> MoEParams:
        """``shard_map`` in_specs for these weights: experts split over ``axis_name``."""
        rep = None if not self.has_shared_expert else P()
        return MoEParams(P(), P(axis_name), P(axis_name), P(axis_name), rep, rep, rep)


class MoEAux(NamedTuple):
    """Auxiliary outputs of ``moe_layer``; each is the same on every rank of the EP axis.

    load_balancing_loss: [] float32 ``E * sum_e f_e * P_e`` (Switch / DeepSeek): f_e the
        fraction of (token, k) choices that picked expert e, P_e the mean router probability
        of e, both over the tokens of all ranks. 1 when routing is uniform; its gradient
        reaches the router through P only.
    router_z_loss: [] float32 mean over all tokens of ``logsumexp(logits) ** 2`` (ST-MoE):
        keeps the logits small.
    tokens_per_expert: [E] int32 (token, k) choices per expert, all ranks, before capacity.
    num_dropped: [] int32 (token, k) rows dropped for lack of capacity, all ranks.
    """

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    tokens_per_expert: jax.Array
    num_dropped: jax.Array


def router(x, router_weights, top_k, *, renormalize=True):
    """Softmax top-k gating in float32.

    Returns (expert ids [T, K] int32, gates [T, K] float32, probs [T, E], logits [T, E]):
    gates are the chosen experts' softmax probabilities over all E experts, divided by their
    sum when ``renormalize`` (then equal to ``route``'s softmax over the top-k logits).
    """
    logits = jnp.dot(x.astype(jnp.float32), router_weights.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    _, topk_idx = jax.lax.top_k(logits, top_k)  # by logit: the order softmax keeps
    gates = jnp.take_along_axis(probs, topk_idx, axis=-1)
    if renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return topk_idx.astype(jnp.int32), gates, probs, logits


def _router_stats(topk_idx, probs, logits, num_experts, axis_name):
    """(choices per expert [E], load-balancing loss, z-loss) over the tokens of every rank."""
    counts = jnp.bincount(topk_idx.ravel(), length=num_experts).astype(jnp.int32)
    sums = (jnp.sum(probs, axis=0), jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2))
    num_tokens = probs.shape[0]
    if axis_name is not None:
        # two psums: jax 0.6 cannot differentiate one psum of integer and float operands
        counts, sums = jax.lax.psum(counts, axis_name), jax.lax.psum(sums, axis_name)
        num_tokens = num_tokens * jax.lax.axis_size(axis_name)
    prob_sums, z_sum = sums
    fraction = counts.astype(jnp.float32) / (num_tokens * topk_idx.shape[1])
    balance = num_experts * jnp.sum(fraction * prob_sums / num_tokens)
    return counts, balance, z_sum / num_tokens


def shared_expert(x, w_gate, w_up, w_down, *, gemm_sms=None):
    """Dense SwiGLU on local tokens (no communication): [T, H] -> [T, H] in x's dtype.

    gemm_sms: None: XLA's dots; an SM count: ``experts.batched_matmul`` sized for it.
    """
    def dot(a, w):
        if gemm_sms is None:
            return jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32)
        return experts.batched_matmul(a[None], w.astype(a.dtype)[None], sm_count=gemm_sms,
                                      preferred_element_type=jnp.float32)[0]

    h = (jax.nn.silu(dot(x, w_gate)) * dot(x, w_up)).astype(x.dtype)
    return dot(h, w_down).astype(x.dtype)


def expert_major_capacity(capacity_factor, *, num_tokens, num_ranks, top_k,
                          num_local_experts, expert_alignment=1) -> int:
    """expert_major rows per rank for a capacity factor: ``factor * T * K`` (the rows a rank
    receives under uniform routing) plus the groups' alignment padding, at most the worst
    case (then nothing is dropped)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    worst = api.default_capacity(num_tokens, num_ranks, top_k, num_local_experts,
                                 EXPERT_MAJOR, expert_alignment)
    rows = math.ceil(capacity_factor * num_tokens * top_k)
    return min(worst, rows + num_local_experts * (expert_alignment - 1))


def shared_expert_beside(x, w_gate, w_up, w_down, *, config=None):
    """``shared_expert`` as a call on another XLA stream (``jax_ep.on_stream``: the one after
    the calls' ``Config.stream``), its GEMMs sized for the SMs the dispatch of ``config``
    leaves (``Config.num_blocks``, 64 by default), so that the calls run beside it (XLA's own
    GEMMs hold every SM: on stream 1 they made the step slower). 2×H200, DeepSeek-V3 shapes:
    the step 1.4-3.7 % faster than with the shared expert inline (benchmarks/RESULTS.md).
    Inline, through XLA's dots, where stream calls are not supported (jax < 0.10) or the
    GPU's SM count is unknown."""
    sms = _config._multiprocessors()
    if not api.stream_calls_supported() or not sms:
        return shared_expert(x, w_gate, w_up, w_down)
    blocks = _config.num_blocks(config, layout=EXPERT_MAJOR)
    fn = functools.partial(shared_expert, gemm_sms=max(sms - blocks, 1))
    return api.on_stream(fn, _config.stream(config) + 1)(x, w_gate, w_up, w_down)


def _expert_counts(x, params: MoEParams, axis_name):
    """(ranks, local experts, experts) of a layer, its router checked against them."""
    num_ranks = jax.lax.axis_size(axis_name)
    num_local = params.w_gate.shape[0]
    num_experts = num_local * num_ranks
    if params.router.shape != (x.shape[-1], num_experts):
        raise ValueError(f"router must be [H={x.shape[-1]}, E={num_experts}] (E = local experts "
                         f"{num_local} x {num_ranks} ranks), got {params.router.shape}")
    return num_ranks, num_local, num_experts


def moe_layer(x, params: MoEParams, *, top_k, axis_name, capacity=None, capacity_factor=None,
              expert_alignment=1, renormalize=True, backend="auto", config=None,
              shared_beside=True):
    """SwiGLU mixture of experts on this rank's tokens (call inside ``jax.shard_map``).

    Router (float32 softmax, top-k) -> ``dispatch(layout="expert_major")`` ->
    ``experts.swiglu_mlp`` -> ``combine`` weighted by the gates, plus the shared expert when
    ``params`` has one. Expert matmuls run in x's dtype (weights are cast to it).

    Args:
      x: [T, H] local tokens.
      params: ``MoEParams`` holding this rank's ``L`` experts (E = L * R).
      top_k: experts per token.
      axis_name: the expert-parallel mesh axis.
      capacity: received rows per rank (static); None: the worst case, nothing dropped.
      capacity_factor: instead of ``capacity``: the dispatch keeps ``expert_major_capacity``
        rows and the experts run as per-expert blocks of ``expert_capacity`` rows (batched
        GEMMs, ~1.8x the grouped GEMMs' rate on an H100 at DeepSeek-V3 shapes); rows past
        either are dropped and counted in ``num_dropped``. None: the experts run grouped
        GEMMs over exactly the rows received (dropless with ``capacity=None``).
      expert_alignment: each expert's row group is padded to a multiple of this.
      renormalize: gates sum to 1 per token (else they are the raw top-k probabilities).
      backend: ``"auto"``, ``"reference"`` or ``"cuda"``.
      config: a ``jax_ep.Config`` for the dispatch and combine (CUDA backend).
      shared_beside: the shared expert runs beside the dispatch and the combine
        (``shared_expert_beside``: a call on XLA's stream 1 through GEMMs sized for the SMs
        the calls leave; inline where stream calls or the GPU's SM count are missing);
        False: inline, through XLA's dots.
    Returns:
      ([T, H] output in x's dtype, ``MoEAux``).
    """
    if capacity is not None and capacity_factor is not None:
        raise ValueError("give capacity or capacity_factor, not both")
    num_ranks, num_local, num_experts = _expert_counts(x, params, axis_name)
    if capacity_factor is not None:
        capacity = expert_major_capacity(
            capacity_factor, num_tokens=x.shape[0], num_ranks=num_ranks, top_k=top_k,
            num_local_experts=num_local, expert_alignment=expert_alignment)
    # The shared expert reads only x: no data dependency on the dispatch, so XLA may run it
    # while rows are in flight.
    shared = None
    if params.has_shared_expert:
        run = (functools.partial(shared_expert_beside, config=config) if shared_beside
               else shared_expert)
        shared = run(x, params.shared_gate, params.shared_up, params.shared_down)
    topk_idx, gates, probs, logits = router(x, params.router, top_k, renormalize=renormalize)
    out = api.dispatch(x, topk_idx, gates, num_experts=num_experts, axis_name=axis_name,
                       capacity=capacity, layout=EXPERT_MAJOR,
                       expert_alignment=expert_alignment, backend=backend, config=config)
    cast = lambda w: w.astype(x.dtype)  # noqa: E731
    weights = cast(params.w_gate), cast(params.w_up), cast(params.w_down)
    dropped = out.num_dropped
    if capacity_factor is None:  # dropless: grouped GEMMs over the exact groups
        rows = experts.swiglu_mlp(out.x, *weights, out.group_sizes)
    else:  # per-expert [L, C, H] blocks: batched GEMMs at full rate, overflow counted
        rows, overflow = experts.swiglu_mlp_padded(
            out.x, *weights, out.group_sizes, rows_per_expert=out.tokens_per_expert,
            capacity=expert_capacity(capacity_factor, num_tokens=x.shape[0],
                                     num_ranks=num_ranks, top_k=top_k,
                                     num_local_experts=num_local))
        dropped = dropped + overflow.astype(dropped.dtype)
    y = api.combine(rows, out.handle, weights=out.topk_weights)
    if shared is not None:
        y = y + shared
    counts, balance, z_loss = _router_stats(topk_idx, probs, logits, num_experts, axis_name)
    aux = MoEAux(load_balancing_loss=balance, router_z_loss=z_loss, tokens_per_expert=counts,
                 num_dropped=jax.lax.psum(dropped, axis_name))
    return y, aux


def decode_layer(x, params: MoEParams, *, top_k, axis_name, max_tokens_per_rank=None,
                 use_fp8=True, renormalize=True, backend="auto", config=None, gemm_impl=None,
                 gemm_sms=None):
    """``moe_layer`` for a decode step, through the low-latency calls (inside ``shard_map``).

    Router (float32 softmax, top-k) -> ``low_latency_dispatch(layout="records")`` (FP8 on the
    wire with ``use_fp8``: each token arrives once) -> ``experts.swiglu_mlp`` over the pairs'
    rows read by index (``handle.record_rows()``; on CUDA jax_ep's grouped kernel for few rows
    per expert, which reads each expert's weights once) -> ``low_latency_combine`` weighted by
    the gates, plus the shared expert when ``params`` has one (inline). Expert matmuls run in
    x's dtype.

    Args:
      x: [T, H] local tokens, T <= ``max_tokens_per_rank`` (default T).
      params, top_k, axis_name, renormalize: as in ``moe_layer``.
      use_fp8: quantize the rows for the wire (then no gradient reaches x through the
        experts); False: x's dtype both ways, differentiable.
      backend: ``"auto"``, ``"reference"`` or ``"cuda"``; config: a ``jax_ep.Config`` for the
        low-latency calls (its ``num_blocks``).
      gemm_impl: ``experts.grouped_matmul``'s impl; default ``"cuda"`` on the CUDA backend
        where the kernel is built, else ``"auto"``. gemm_sms: its ``sm_count`` (``"cuda"``).
    Returns:
      ([T, H] output in x's dtype, ``MoEAux``; ``num_dropped``: the pairs the sources dropped,
      only possible when a token lists an expert twice).
    """
    from jax_ep import low_latency as _ll

    _, _, num_experts = _expert_counts(x, params, axis_name)
    shared = None
    if params.has_shared_expert:
        shared = shared_expert(x, params.shared_gate, params.shared_up, params.shared_down)
    topk_idx, gates, probs, logits = router(x, params.router, top_k, renormalize=renormalize)
    out = _ll.low_latency_dispatch(
        x, topk_idx, num_experts=num_experts,
        max_tokens_per_rank=x.shape[0] if max_tokens_per_rank is None else max_tokens_per_rank,
        axis_name=axis_name, use_fp8=use_fp8, backend=backend, config=config,
        layout="records")
    rows = out.x if out.x_scales is None else _fp8.dequantize_fp8(out.x, out.x_scales, x.dtype)
    if gemm_impl is None:
        native = out.handle.config.backend == "cuda" and experts._native_gemm_available()
        gemm_impl = "cuda" if native else "auto"
    cast = lambda w: w.astype(x.dtype)  # noqa: E731
    y = experts.swiglu_mlp(rows.astype(x.dtype), cast(params.w_gate), cast(params.w_up),
                           cast(params.w_down), out.recv_count, impl=gemm_impl,
                           sm_count=gemm_sms, row_index=out.handle.record_rows())
    y = _ll.low_latency_combine(y, gates, out.handle)
    if shared is not None:
        y = y + shared
    counts, balance, z_loss = _router_stats(topk_idx, probs, logits, num_experts, axis_name)
    aux = MoEAux(load_balancing_loss=balance, router_z_loss=z_loss, tokens_per_expert=counts,
                 num_dropped=jax.lax.psum(out.num_dropped, axis_name))
    return y, aux


def expert_capacity(capacity_factor, *, num_tokens, num_ranks, top_k, num_local_experts,
                    multiple=8) -> int:
    """Rows per expert block of the padded expert GEMMs: ``factor`` times the rows an expert
    gets under uniform routing (``R * T * K / E``), rounded up to ``multiple``."""
    per_expert = capacity_factor * num_tokens * top_k / num_local_experts
    return max(multiple, math.ceil(per_expert / multiple) * multiple)


def dense_moe_layer(x, params: MoEParams, *, top_k, renormalize=True):
    """Single-device oracle of ``moe_layer``: every expert on every token, all weights global.

    Returns ([T, H], ``MoEAux`` over these tokens; ``num_dropped`` is 0).
    """
    topk_idx, gates, probs, logits = router(x, params.router, top_k, renormalize=renormalize)
    cast = lambda w: w.astype(x.dtype)  # noqa: E731
    every = experts.dense_swiglu(x, cast(params.w_gate), cast(params.w_up), cast(params.w_down))
    picked = jnp.take_along_axis(every.astype(x.dtype), topk_idx[:, :, None], axis=1)
    y = jnp.sum(gates[:, :, None] * picked.astype(jnp.float32), axis=1).astype(x.dtype)
    if params.has_shared_expert:
        y = y + shared_expert(x, params.shared_gate, params.shared_up, params.shared_down)
    counts, balance, z_loss = _router_stats(topk_idx, probs, logits, params.router.shape[1],
                                            None)
    return y, MoEAux(balance, z_loss, counts, jnp.zeros((), jnp.int32))
