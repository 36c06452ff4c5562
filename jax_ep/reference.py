"""Pure-JAX reference backend: the executable specification of the dispatch/combine contract.

Every function runs per device inside ``jax.shard_map`` over the expert-parallel axis named in
the config. It moves data with ``jax.lax.all_to_all`` on padded ``[R, T, ...]`` buffers
(``ragged_all_to_all`` is not implemented on XLA:CPU), then builds exactly the layout the CUDA
kernels produce (see ``jax_ep._types``). It favours clarity over speed: every token is sent
to every rank, masked. Sums that the contract orders are written as explicit loops so that
the float32 accumulation order is the documented one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ep._types import (
    EXPERT_MAJOR,
    LL_RECORDS,
    SOURCE_SLOTS,
    DispatchConfig,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyConfig,
    LowLatencyHandle,
    LowLatencyOutput,
    no_pair_rows,
)


def _routing(topk_idx, num_experts, num_ranks):
    """Destination rank and local expert id of every (token, k); -1 where masked or invalid."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    local_experts = num_experts // num_ranks
    dest = jnp.where(valid, topk_idx // local_experts, -1)
    local = jnp.where(valid, topk_idx % local_experts, -1)
    return dest, local


def layout(topk_idx, *, num_experts, num_ranks):
    dest, _ = _routing(topk_idx, num_experts, num_ranks)
    is_token_in_rank = jnp.any(dest[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1)
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    experts = jnp.where(valid, topk_idx, num_experts)
    per_expert = jnp.zeros((num_experts,), jnp.int32).at[experts].add(1, mode="drop")
    return DispatchLayout(
        num_tokens_per_rank=jnp.sum(is_token_in_rank, axis=0, dtype=jnp.int32),
        num_tokens_per_expert=per_expert,
        is_token_in_rank=is_token_in_rank,
    )


def _exchange(a, axis_name):
    """[R, ...] -> [R, ...]: slice r goes to rank r; slice s of the result came from rank s."""
    return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)


def _to_all_ranks(a, num_ranks):
    return jnp.broadcast_to(a[None], (num_ranks,) + a.shape)


def _scatter_rows(values, positions, capacity, fill):
    """out[positions[i]] = values[i]; positions == capacity (or beyond) are dropped."""
    out = jnp.full((capacity,) + values.shape[1:], fill, values.dtype)
    return out.at[positions].set(values, mode="drop", unique_indices=True)


def dispatch(x, x_scales, topk_idx, topk_weights, config: DispatchConfig) -> DispatchOutput:
    if config.use_fp8 and x_scales is None:
        from jax_ep.fp8 import quantize_fp8

        x, x_scales = quantize_fp8(x, ue8m0=config.ue8m0, backend="reference")
    R, E, axis = config.num_ranks, config.num_experts, config.axis_name
    dest, local = _routing(topk_idx, E, R)
    ranks = jnp.arange(R, dtype=jnp.int32)

    # What every destination rank r receives from us: all tokens, with ids/weights masked to r.
    to_r = dest[None, :, :] == ranks[:, None, None]  # [R, T, K]
    send_local = jnp.where(to_r, local[None], -1)
    send_weights = jnp.where(to_r, topk_weights[None].astype(jnp.float32), 0.0)
    recv_x = _exchange(_to_all_ranks(x, R), axis)  # [R(src), T, H]
    recv_scales = None if x_scales is None else _exchange(_to_all_ranks(x_scales, R), axis)
    recv_local = _exchange(send_local, axis)  # [R(src), T, K]
    recv_weights = _exchange(send_weights, axis)

    pair_row = no_pair_rows()
    if config.layout == EXPERT_MAJOR:
        out, slot_for_src = _expert_major(recv_x, recv_scales, recv_local, recv_weights, config)
        pair_row = slot_for_src  # [R(src), T, K]: where each received pair landed here
        # Tell each source where its (t, k) pairs landed; keep the entry of the expert's rank.
        slots = _exchange(slot_for_src, axis)  # [R(dst), T, K]
        send_slot = jnp.take_along_axis(slots, jnp.maximum(dest, 0)[None], axis=0)[0]
        send_slot = jnp.where(dest >= 0, send_slot, -1)
    elif config.layout == SOURCE_SLOTS:
        out = _source_slots(recv_x, recv_scales, recv_local, recv_weights, config)
        # Slots are fixed (row me*T + t at every rank it reaches): known here, no exchange.
        me = jax.lax.axis_index(axis)
        reaches = jnp.any(to_r, axis=-1).T  # [T, R(dst)]
        rows = me * config.num_tokens + jnp.arange(config.num_tokens, dtype=jnp.int32)
        send_slot = jnp.where(reaches, rows[:, None], -1)
    else:
        out, slot_for_src = _rank_major(recv_x, recv_scales, recv_local, recv_weights, config)
        send_slot = _exchange(slot_for_src, axis).T  # [T, R(dst)]

    handle = DispatchHandle(
        topk_idx=topk_idx,
        send_slot=send_slot.astype(jnp.int32),
        src_rank=out.pop("src_rank"),
        src_token=out.pop("src_token"),
        src_k=out.pop("src_k"),
        num_received=out["num_received"],
        pair_row=pair_row,
        config=config,
    )
    return DispatchOutput(handle=handle, **out)


def _token_rows(recv_x, recv_scales, recv_local, recv_weights, target, config):
    """The [C] rows of a per-token layout (rank_major, source_slots): received token
    ``i = s*T + t`` goes to row target[i] (C: nowhere) with its local ids and weights."""
    R, T, C, L = config.num_ranks, config.num_tokens, config.capacity, config.num_local_experts
    src_rank = jnp.repeat(jnp.arange(R, dtype=jnp.int32), T)
    src_token = jnp.tile(jnp.arange(T, dtype=jnp.int32), R)
    topk_idx = _scatter_rows(recv_local.reshape(R * T, -1), target, C, -1)
    per_expert = jnp.sum(topk_idx[:, :, None] == jnp.arange(L)[None, None, :], axis=(0, 1),
                         dtype=jnp.int32)
    return dict(
        x=_scatter_rows(recv_x.reshape((R * T,) + recv_x.shape[2:]), target, C, 0),
        x_scales=None if recv_scales is None else _scatter_rows(
            recv_scales.reshape(R * T, -1), target, C, 0),
        topk_idx=topk_idx,
        topk_weights=_scatter_rows(recv_weights.reshape(R * T, -1), target, C, 0),
        tokens_per_expert=per_expert,
        group_sizes=per_expert,
        src_rank=_scatter_rows(src_rank, target, C, -1),
        src_token=_scatter_rows(src_token, target, C, -1),
        src_k=jnp.full((C,), -1, jnp.int32),
    )


def _has_expert_here(recv_local):
    """[R(src), T, K] local ids -> [R*T] whether each received token has an expert here."""
    return jnp.any(recv_local >= 0, axis=-1).reshape(-1)


def _rank_major(recv_x, recv_scales, recv_local, recv_weights, config):
    R, T, C = config.num_ranks, config.num_tokens, config.capacity
    has_expert_here = _has_expert_here(recv_local)  # rows in (src, token) order
    position = jnp.cumsum(has_expert_here, dtype=jnp.int32) - 1
    kept = has_expert_here & (position < C)
    target = jnp.where(kept, position, C)
    out = _token_rows(recv_x, recv_scales, recv_local, recv_weights, target, config)
    out["num_received"] = jnp.sum(kept, dtype=jnp.int32)
    out["num_dropped"] = jnp.sum(has_expert_here & ~kept, dtype=jnp.int32)
    return out, jnp.where(kept, position, -1).reshape(R, T)


def _source_slots(recv_x, recv_scales, recv_local, recv_weights, config):
    """rank_major's rows, each at its fixed slot s*T + t (C = R*T: nothing is dropped)."""
    C = config.capacity
    has_expert_here = _has_expert_here(recv_local)
    slot = jnp.arange(C, dtype=jnp.int32)
    out = _token_rows(recv_x, recv_scales, recv_local, recv_weights,
                      jnp.where(has_expert_here, slot, C), config)
    out["num_received"] = jnp.max(jnp.where(has_expert_here, slot + 1, 0))
    out["num_dropped"] = jnp.zeros((), jnp.int32)
    return out


def _expert_major(recv_x, recv_scales, recv_local, recv_weights, config):
    R, T, K, C, L = (config.num_ranks, config.num_tokens, config.num_topk, config.capacity,
                     config.num_local_experts)
    align = config.alignment
    n = R * T * K
    expert = recv_local.reshape(n)  # pairs in (src, token, k) order
    valid = expert >= 0
    key = jnp.where(valid, expert, L)
    pairs_per_expert = jnp.zeros((L + 1,), jnp.int32).at[key].add(1)[:L]
    aligned = (pairs_per_expert + align - 1) // align * align
    group_start = jnp.cumsum(aligned) - aligned
    dense_start = jnp.cumsum(pairs_per_expert) - pairs_per_expert
    # A stable sort by expert keeps (src, token, k) order inside each group.
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sorted_expert = jnp.minimum(sorted_key, L - 1)
    rank_in_group = jnp.arange(n, dtype=jnp.int32) - dense_start[sorted_expert]
    sorted_position = jnp.where(sorted_key < L, group_start[sorted_expert] + rank_in_group, C)
    position = jnp.zeros((n,), jnp.int32).at[order].set(sorted_position)
    kept = valid & (position < C)
    target = jnp.where(kept, position, C)

    pair = jnp.arange(n, dtype=jnp.int32)
    src_rank, src_token, src_k = pair // (T * K), (pair // K) % T, pair % K
    row_x = recv_x.reshape((R * T,) + recv_x.shape[2:])[pair // K]
    group_end = jnp.minimum(group_start + aligned, C)
    group_sizes = jnp.maximum(group_end - jnp.minimum(group_start, C), 0).astype(jnp.int32)
    kept_expert = jnp.where(kept, expert, L)
    out = dict(
        x=_scatter_rows(row_x, target, C, 0),
        x_scales=None if recv_scales is None else _scatter_rows(
            recv_scales.reshape(R * T, -1)[pair // K], target, C, 0),
        topk_idx=_scatter_rows(expert, target, C, -1),
        topk_weights=_scatter_rows(recv_weights.reshape(n), target, C, 0),
        tokens_per_expert=jnp.zeros((L + 1,), jnp.int32).at[kept_expert].add(1)[:L],
        group_sizes=group_sizes,
        num_received=jnp.sum(group_sizes, dtype=jnp.int32),
        num_dropped=jnp.sum(valid & ~kept, dtype=jnp.int32),
        src_rank=_scatter_rows(src_rank, target, C, -1),
        src_token=_scatter_rows(src_token, target, C, -1),
        src_k=_scatter_rows(src_k, target, C, -1),
    )
    return out, jnp.where(kept, position, -1).reshape(R, T, K)


def cached_dispatch(x, handle: DispatchHandle):
    """Rows of ``x`` at the positions the handle recorded (combine's backward); zeros elsewhere."""
    config = handle.config
    recv = _exchange(_to_all_ranks(x, config.num_ranks), config.axis_name)  # [R(src), T, H]
    used = handle.src_rank >= 0
    rows = recv[jnp.maximum(handle.src_rank, 0), jnp.maximum(handle.src_token, 0)]
    return jnp.where(used[:, None], rows, jnp.zeros_like(rows))


def weighted_rows_backward(g_rows, y, weights):
    """(d y, d weights) of ``combine`` from the output gradient's rows: w * g and <g, y>."""
    if weights is None:
        return g_rows, None
    dy = (g_rows.astype(jnp.float32) * weights[:, None]).astype(y.dtype)
    return dy, jnp.sum(g_rows.astype(jnp.float32) * y.astype(jnp.float32), axis=-1)


def combine_backward(g, y, weights, handle: DispatchHandle):
    """(d y, d weights) of ``combine`` for the output gradient g [T, H] in y's dtype."""
    return weighted_rows_backward(cached_dispatch(g, handle), y, weights)


def combine(y, weights, handle: DispatchHandle):
    """Sum each token's rows back on its source rank, in float32, in the contract's order."""
    config = handle.config
    R, T, K = config.num_ranks, config.num_tokens, config.num_topk
    used = handle.src_rank >= 0
    scaled = y.astype(jnp.float32)
    if weights is not None:
        scaled = scaled * weights.astype(jnp.float32)[:, None]
    row_src = jnp.where(used, handle.src_rank, R)  # unused rows are dropped by the scatter
    if config.layout == EXPERT_MAJOR:
        # Here, each source token's rows summed in k order and cast to y's dtype: one partial
        # per (token, rank) goes back; the owner adds them in rank order.
        send = jnp.zeros((R, T, K) + y.shape[1:], jnp.float32)
        send = send.at[row_src, handle.src_token, handle.src_k].set(scaled, mode="drop")
        partial = jnp.zeros((R, T) + y.shape[1:], jnp.float32)
        for k in range(K):  # absent pairs add +0.0, which leaves every sum as it is
            partial = partial + send[:, :, k]
        # The barrier keeps the rounding: XLA:GPU (default xla_allow_excess_precision) folds
        # a convert pair away.
        partial = jax.lax.optimization_barrier(partial.astype(y.dtype)).astype(jnp.float32)
        back = _exchange(partial, config.axis_name)  # [R(expert rank), T, H]
        dest, _ = _routing(handle.topk_idx, config.num_experts, R)
        kept = handle.send_slot >= 0  # [T, K]
        present = jnp.any(kept[:, None, :] & (dest[:, None, :] == jnp.arange(R)[None, :, None]),
                          axis=-1)  # [T, R]
        terms = [jnp.where(present[:, r, None], back[r], 0.0) for r in range(R)]
    else:
        send = jnp.zeros((R, T) + y.shape[1:], jnp.float32)
        send = send.at[row_src, handle.src_token].set(scaled, mode="drop")
        back = _exchange(send, config.axis_name)  # [R(expert rank), T, H]
        present = handle.send_slot >= 0  # [T, R]
        terms = [jnp.where(present[:, r, None], back[r], 0.0) for r in range(R)]
    # fixed left-to-right order: bit-identical to the CUDA kernels; across nodes each node's
    # ranks first, that partial rounded to y's dtype, then the nodes in order
    G = config.node_size or R
    total = jnp.zeros((T,) + y.shape[1:], jnp.float32)
    for node in range(R // G):
        node_sum = jnp.zeros_like(total)
        for term in terms[node * G:(node + 1) * G]:
            node_sum = node_sum + term
        if G < R:
            node_sum = jax.lax.optimization_barrier(node_sum.astype(y.dtype)).astype(jnp.float32)
        total = total + node_sum
    return total.astype(y.dtype)


# ----------------------------------------------------------------------------- low latency

def _group_positions(key, num_groups):
    """Rank of every element among those with the same key, in index order (key == num_groups:
    not in any group). Returns (rank, count per group)."""
    n = key.shape[0]
    counts = jnp.zeros((num_groups + 1,), jnp.int32).at[key].add(1)[:num_groups]
    starts = jnp.cumsum(counts) - counts
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[jnp.minimum(sorted_key, num_groups - 1)]
    return jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted), counts


def low_latency_slots(topk_idx, config: LowLatencyConfig):
    """Per-(source, expert) slot of every (token, k) pair, local to the source: the rank of the
    pair among this source's pairs for the same expert, in (token, k) order. Pairs with an
    invalid expert, or whose slot is >= M (a token listing an expert twice), are not sent:
    slot -1. Returns (send_slot [T, K], pairs dropped for a full slot range [])."""
    E, M = config.num_experts, config.max_tokens_per_rank
    valid = (topk_idx >= 0) & (topk_idx < E)
    rank, _ = _group_positions(jnp.where(valid, topk_idx, E).reshape(-1), E)
    slot = rank.reshape(topk_idx.shape)
    kept = valid & (slot < M)
    return jnp.where(kept, slot, -1).astype(jnp.int32), jnp.sum(valid & ~kept, dtype=jnp.int32)


def low_latency_send(x, topk_idx, config: LowLatencyConfig):
    """Everything that crosses the wire; ``low_latency_receive`` lays it out locally."""
    from jax_ep.fp8 import quantize_fp8

    R, E, axis = config.num_ranks, config.num_experts, config.axis_name
    send_slot, num_dropped = low_latency_slots(topk_idx, config)
    dest, local = _routing(jnp.where(send_slot >= 0, topk_idx, -1), E, R)
    data, scales = (quantize_fp8(x, ue8m0=config.ue8m0, backend="reference") if config.use_fp8
                    else (x, None))
    to_r = dest[None, :, :] == jnp.arange(R, dtype=jnp.int32)[:, None, None]
    return dict(
        x=_exchange(_to_all_ranks(data, R), axis),
        x_scales=None if scales is None else _exchange(_to_all_ranks(scales, R), axis),
        local=_exchange(jnp.where(to_r, local[None], -1), axis),  # [R(src), T, K] kept pairs
        topk_idx=topk_idx,
        send_slot=send_slot,
        num_dropped=num_dropped,
    )


def low_latency_receive(sent, config: LowLatencyConfig) -> LowLatencyOutput:
    """Block l holds the kept pairs for local expert l by source, in the order me, me + 1, ...,
    me - 1 (this rank's own pairs first), then by (source token, k): row = the counts for l of
    the sources before the pair's + the pair's slot at its source; expert_major packs the
    blocks' used rows, group l after the groups before it; records keeps each token once (the
    handle is expert_major's)."""
    R, T, K, L = config.num_ranks, config.num_tokens, config.num_topk, config.num_local_experts
    rows = config.rows_per_expert
    n = R * T * K
    me = jax.lax.axis_index(config.axis_name)
    order = (jnp.arange(R, dtype=jnp.int32) + me) % R  # position q -> source
    expert = sent["local"][order].reshape(n)  # pairs in (source position, token, k) order
    valid = expert >= 0
    rank, counts = _group_positions(jnp.where(valid, expert, L), L)
    shape = config.rows_shape
    total = math.prod(shape)
    start = (jnp.cumsum(counts) - counts) if config.packed else jnp.arange(L) * rows
    # rank < R*M, and the packed rows hold every pair a rank can receive: nothing to drop
    target = jnp.where(valid, start[jnp.minimum(expert, L - 1)] + rank, total).astype(jnp.int32)
    pair = jnp.arange(n, dtype=jnp.int32)
    token_row = pair // K
    source = order[pair // (T * K)]

    def place(values, fill):
        flat = _scatter_rows(values, target, total, fill)
        return flat.reshape(shape + values.shape[1:])

    x = sent["x"][order].reshape((R * T,) + sent["x"].shape[2:])[token_row]
    scales = sent["x_scales"]
    # the row each source pair became here (the combine's lookup), by source
    pair_row = jnp.zeros((R, T, K), jnp.int32).at[order].set(
        jnp.where(valid, target, -1).astype(jnp.int32).reshape(R, T, K))
    handle = LowLatencyHandle(
        topk_idx=sent["topk_idx"],
        send_slot=sent["send_slot"],
        src_rank=place(source, -1),
        src_token=place((pair // K) % T, -1),
        src_k=place(pair % K, -1),
        recv_count=counts,
        pair_row=pair_row,
        config=config,
    )
    if config.layout == LL_RECORDS:  # each token once, at row s*M + t, if a pair was kept
        kept = jnp.any(sent["local"] >= 0, axis=2)  # [R(src), T]: a pair kept here

        def records(values):  # [R(src), T, ...] -> [R*M, ...], rows of no kept pair zero
            values = jnp.where(kept.reshape(kept.shape + (1,) * (values.ndim - 2)), values,
                               jnp.zeros((), values.dtype))
            # padded (XLA:CPU's compiler crashed on an update of every row instead)
            pad = [(0, 0), (0, config.max_tokens_per_rank - T)] + [(0, 0)] * (values.ndim - 2)
            return jnp.pad(values, pad).reshape((rows,) + values.shape[2:])

        out_x = records(sent["x"])
        out_scales = None if scales is None else records(scales)
    else:
        out_x = place(x, 0)
        out_scales = (None if scales is None
                      else place(scales[order].reshape(R * T, -1)[token_row], 0))
    return LowLatencyOutput(
        x=out_x,
        x_scales=out_scales,
        recv_count=counts,
        num_dropped=sent["num_dropped"],
        handle=handle,
    )


def low_latency_dispatch(x, topk_idx, config: LowLatencyConfig) -> LowLatencyOutput:
    return low_latency_receive(low_latency_send(x, topk_idx, config), config)


def low_latency_cached_dispatch(x, handle: LowLatencyHandle):
    """[T, D] -> [L, R*M, D] (or the packed rows): each used row gets its source token's x
    (no quantisation)."""
    config = handle.config
    recv = _exchange(_to_all_ranks(x, config.num_ranks), config.axis_name)  # [R(src), T, D]
    used = handle.src_rank >= 0
    rows = recv[jnp.maximum(handle.src_rank, 0), jnp.maximum(handle.src_token, 0)]
    return jnp.where(used[..., None], rows, jnp.zeros_like(rows))


def low_latency_combine_send(y, topk_weights, handle: LowLatencyHandle):
    """The weighted rows w[t, k] * row(t, k) in float32, as [R(owner), T, K, H] (zero where a
    pair is not here), exchanged: the owner gets [R(expert rank), T, K, H]. The reference
    ships products rather than the CUDA kernels' partial sums so that the collective
    materialises them: fused into the sums, a multiply and an add may be contracted into one
    FMA, which rounds once where the kernels round twice. The arithmetic is the same."""
    config = handle.config
    R, T, K, axis = config.num_ranks, config.num_tokens, config.num_topk, config.axis_name
    weights = _exchange(_to_all_ranks(topk_weights.astype(jnp.float32), R), axis)  # [R, T, K]
    used = handle.src_rank >= 0
    owner = jnp.where(used, handle.src_rank, R)
    rows = jnp.zeros((R, T, K) + y.shape[handle.src_rank.ndim:], jnp.float32)
    rows = rows.at[owner, handle.src_token, handle.src_k].set(y.astype(jnp.float32), mode="drop")
    return dict(terms=_exchange(weights[..., None] * rows, axis), dtype=jnp.zeros((0,), y.dtype))


def low_latency_combine_receive(sent, handle: LowLatencyHandle):
    """Rank r's partial of token t: its pairs' terms summed in k order (float32), rounded to
    y's dtype; out[t] = the partials of the ranks holding a kept pair of t, added in rank
    order (float32), rounded to y's dtype."""
    config = handle.config
    dtype = sent["dtype"].dtype
    dest, _ = _routing(handle.topk_idx, config.num_experts, config.num_ranks)
    kept_dest = jnp.where(handle.send_slot >= 0, dest, -1)  # [T, K]
    terms = sent["terms"]  # [R, T, K, H]
    total = jnp.zeros((config.num_tokens,) + terms.shape[3:], jnp.float32)
    for r in range(config.num_ranks):
        partial = jnp.zeros_like(total)
        for k in range(config.num_topk):  # fixed order: bit-identical to the CUDA kernels
            partial = partial + jnp.where((kept_dest[:, k] == r)[:, None], terms[r, :, k], 0.0)
        has = jnp.any(kept_dest == r, axis=1)
        # The barrier keeps the rounding: XLA:GPU (default xla_allow_excess_precision) folds
        # convert(convert(x, bf16), f32) into x, which would skip it.
        rounded = jax.lax.optimization_barrier(partial.astype(dtype)).astype(jnp.float32)
        total = total + jnp.where(has[:, None], rounded, 0.0)
    return total.astype(dtype)


def low_latency_combine(y, topk_weights, handle: LowLatencyHandle):
    return low_latency_combine_receive(low_latency_combine_send(y, topk_weights, handle), handle)
