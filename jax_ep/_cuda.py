"""CUDA backend: the contract of ``jax_ep.reference`` served by the extension's FFI targets.

Each function runs per device inside ``shard_map``; the kernels reach the peers through the
symmetric buffer set up by ``jax_ep.runtime.initialize()``. The EP axis index is passed as an
operand so that the kernels can check it equals the process's NVSHMEM PE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native, reference
from jax_ep import config as _config
from jax_ep._mesh import as_varying, axis_stride, varying_axes
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
    default_capacity,
    no_pair_rows,
)
from jax_ep.config import Config


def is_available() -> tuple[bool, str]:
    module, why = _native.load()
    if module is None:
        return False, why
    if not _native.gpu_present():
        return False, "JAX has no GPU backend here"
    if not module.is_initialized():
        return False, "jax_ep.runtime.initialize() has not been called in this process"
    return True, ""


_MAX_COPY_RANKS = _config.MAX_COPY_RANKS
# The kernels' size limits (ffi/kernels/buffer_layout.h), kept here so that tracing and every
# check made while tracing need no extension; a GPU test keeps them equal to module.limits().
LIMITS = {
    "max_ranks": 1024,             # kMaxRanks
    "max_sources": 16,             # kMaxSources: a token's destinations in the push dispatch
                                   # and the rows one token sums in every combine
    "max_copy_ranks": _MAX_COPY_RANKS,  # kMaxCopyRanks: ranks of the copy-engine paths
    "low_latency_max_topk": 32,    # kLLMaxTopk
}
expected_token_share = _config.expected_token_share


def _resolve(tuning: Config | None, num_ranks, num_topk, num_experts, layout,
             operation="dispatch") -> Config:
    """The call's tuning, every field set (``jax_ep.config.resolve``)."""
    return _config.resolve(tuning, num_ranks=num_ranks, num_topk=num_topk,
                           num_experts=num_experts, layout=layout, operation=operation)


def _limits() -> dict:
    """The kernels' size limits (``LIMITS``)."""
    return LIMITS


def _check_sources(op, path, count, expert_major):
    """The push dispatch and every combine keep one token's destinations (ranks, or top-k
    slots for expert_major) in registers: at most max_sources of them."""
    limit = _limits()["max_sources"]
    if count > limit:
        what = (f"top-k {count} (expert_major: one destination per slot)" if expert_major
                else f"{count} ranks (rank_major: one destination per rank)")
        raise ValueError(f"{op}: the CUDA {path} handles at most {limit} destinations per token, "
                         f"got {what}")


def _check_dispatch_limits(num_ranks, num_topk, layout, path):
    limit = _limits()["max_copy_ranks"]
    if layout == SOURCE_SLOTS and num_ranks > limit:  # a rank bit per destination, either path
        raise ValueError(f"dispatch: the source_slots layout supports at most {limit} ranks, "
                         f"the mesh axis has {num_ranks}")
    if path == "copy" and num_ranks > limit:
        raise ValueError(f"dispatch: the copy-engine path (dispatch_path 'copy') supports at "
                         f"most {limit} ranks, the mesh axis has {num_ranks}")
    if path == "fused" and layout != SOURCE_SLOTS:
        expert_major = layout == EXPERT_MAJOR
        _check_sources("dispatch", "fused dispatch (dispatch_path 'pull' has no such limit)",
                       num_topk if expert_major else num_ranks, expert_major)


def _copy_engine_selected(num_ranks, num_topk, num_experts, layout, tuning=None) -> bool:
    """Whether either copy-engine path is selected (their buffer areas count in the hint)."""
    resolved = _resolve(tuning, num_ranks, num_topk, num_experts, layout)
    return bool(layout == SOURCE_SLOTS or resolved.dispatch_path == "copy"
                or resolved.combine_path == "copy")


def _push_combine_selected(num_ranks, num_topk, num_experts, layout, tuning=None) -> bool:
    """Whether the push combine is selected (its [source][token] slots count in the hint)."""
    resolved = _resolve(tuning, num_ranks, num_topk, num_experts, layout)
    return resolved.combine_path == "push"


def _rank(axis_name):
    return jax.lax.axis_index(axis_name).astype(jnp.int32)


def _group(axis_name, num_ranks) -> dict:
    """The call's EP group as the custom calls' `group` attribute: the EP axis's size and its
    stride in the mesh's row-major order (the product of the sizes of the axes after it).
    With the processes listed in mesh order (process i at flat position i), a device's group
    is then the PEs base + r * stride: the extension finds them from its own PE, and every
    kernel checks that the axis index equals the rank it found."""
    return dict(num_ranks=int(num_ranks), stride=axis_stride(axis_name, num_ranks))


def _place(axis_name, num_ranks, within_node=False):
    """(rank operand, group attribute) of a call over the EP axis, or, within_node, over the
    num_ranks ranks of this device's node on it (the node-local stage across nodes)."""
    if not within_node:
        return _rank(axis_name), _group(axis_name, num_ranks)
    size = int(jax.lax.axis_size(axis_name))
    return (_rank(axis_name) % num_ranks,
            dict(num_ranks=int(num_ranks), stride=axis_stride(axis_name, size)))


def _call(name, result_types, *args, axis_name, vmap_method=None, input_output_aliases=None,
          **attrs):
    """One custom call, its operands and results fenced by optimization barriers.

    Why the barriers: XLA:GPU's dynamic-slice fusion (on by default) wraps a custom call whose
    operand is a slice, or whose result feeds a dynamic-update-slice, into a fusion holding a
    copy of the call, and kept the original while the calls declared side effects: the
    kernels then ran twice per call (seen on jax 0.11.2). A communication kernel run twice
    breaks the protocol (a low-latency send numbered twice) and costs its time twice. Behind
    a barrier no operand or result is a slice; a slice operand is copied, as XLA does anyway
    when it does not fuse it.

    Side effects: none declared. Every call is a function of its operands, as XLA's own
    collectives are, and every rank runs the same program, so XLA may merge, hoist or drop a
    call alike everywhere. A split send and its receive stay a pair: the receive reads every
    result and operand of its send, so XLA cannot drop or merge one half without the other
    (identical sends make identical receives; a send whose receive nothing reads goes with
    it). A program without effects keeps jax's fast (C++) dispatch path: 2-7 µs per call off
    chains of 100 calls (2×H100, benchmarks/RESULTS.md).

    vmap_method: how ``jax.vmap`` batches the call (jax.ffi.ffi_call's); None: it cannot.
    input_output_aliases: {operand: result} buffers the call returns as they are (ffi_call's).
    """
    _native.register()
    # the results vary over the EP axis and over every mesh axis an operand varies over (the
    # other axes of a multi-axis mesh: each EP group has its own data), as the reference's do
    axes = set(axis_name) if isinstance(axis_name, tuple) else {axis_name} - {None}
    for arg in args:
        axes.update(varying_axes(arg))
    args = jax.lax.optimization_barrier(args)
    out = jax.ffi.ffi_call(name, result_types, has_side_effect=False,
                           vmap_method=vmap_method,
                           input_output_aliases=input_output_aliases)(*args, **attrs)
    out = jax.lax.optimization_barrier(out)
    if not axes:
        return out
    return jax.tree.map(lambda v: as_varying(v, axes), out)


def layout(topk_idx, *, num_experts, num_ranks):
    T = topk_idx.shape[0]
    # computed from topk_idx alone: the results vary over the mesh axes that topk_idx does
    # (ffi_call would mark them the same everywhere), as the reference backend's do
    varying = varying_axes(topk_idx)
    per_rank, per_expert, in_rank = _call(
        "jax_ep_layout",
        (jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((T, num_ranks), jnp.bool_)),
        topk_idx, axis_name=varying or None, num_experts=np.int64(num_experts),
        num_ranks=np.int64(num_ranks))
    return DispatchLayout(per_rank, per_expert, in_rank)


def batched_matmul(a, b, *, trans_a, trans_b, sm_count, out_dtype, tf32=True):
    """out[l] = op(a[l]) @ op(b[l]) through cuBLASLt sized for ``sm_count`` SMs (0: every SM)
    (jax_ep_batched_matmul); a [L, M, K] ([L, K, M] if trans_a), b [L, K, N] ([L, N, K] if
    trans_b); float32 operands rounded to TF32 where ``tf32``."""
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    return _call("jax_ep_batched_matmul", jax.ShapeDtypeStruct((a.shape[0], m, n), out_dtype),
                 a, b, axis_name=None, trans_a=bool(trans_a), trans_b=bool(trans_b),
                 sm_count=np.int64(sm_count), tf32=bool(tf32))


def grouped_matmul(x, w, group_sizes, *, transpose_w, sm_count=0, row_index=None):
    """x [P, K] rows grouped by expert times w[l] ([L, K, N], or [L, N, K] read transposed)
    -> [P, N] in x's dtype, rows past sum(group_sizes) zero (jax_ep_grouped_matmul), on as
    many blocks as ``sm_count`` SMs hold (0: every SM). The kernel takes each group's end row
    (negative sizes count as 0). row_index [P] int32: row i is x[row_index[i]] (x any number
    of rows; an index outside them reads zeros)."""
    n = w.shape[1] if transpose_w else w.shape[2]
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0), dtype=jnp.int32)
    index = jnp.zeros((0,), jnp.int32) if row_index is None else row_index.astype(jnp.int32)
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    return _call("jax_ep_grouped_matmul", jax.ShapeDtypeStruct((rows, n), x.dtype), x, index,
                 w, ends, axis_name=None, transpose_w=bool(transpose_w),
                 sm_count=np.int64(sm_count))


def quantize_fp8(x, *, ue8m0):
    """jax_ep.quantize_fp8 as one kernel (jax_ep_quantize_fp8); rows are rows whatever the
    leading dimensions, so ``jax.vmap`` batches it by adding one."""
    T, H = x.shape
    return _call("jax_ep_quantize_fp8",
                 (jax.ShapeDtypeStruct((T, H), jnp.float8_e4m3fn),
                  jax.ShapeDtypeStruct((T, H // 128), jnp.float32)),
                 x, axis_name=None, vmap_method="expand_dims", ue8m0=bool(ue8m0))


def _dispatch_call(x, x_scales, topk_idx, topk_weights, *, num_experts, num_ranks, capacity,
                   layout, alignment, axis_name, tuning=None, within_node=False,
                   quantize=False, ue8m0=False):
    """The jax_ep_dispatch custom call; returns its 13 results (see DispatchOutput/Handle)."""
    T, H = x.shape
    K, C, L = topk_idx.shape[1], capacity, num_experts // num_ranks
    expert_major = layout == EXPERT_MAJOR
    resolved = _resolve(tuning, num_ranks, K, num_experts, layout)
    # source_slots moves its rows by the copy engines, or by the SMs where fused is asked for
    path = resolved.dispatch_path
    if layout == SOURCE_SLOTS and path != "fused":
        path = "copy"
    _check_dispatch_limits(num_ranks, K, layout, path)
    has_scales = x_scales is not None
    row_meta = (C,) if expert_major else (C, K)
    i32, f32 = jnp.int32, jnp.float32
    types = (
        jax.ShapeDtypeStruct((C, H), jnp.float8_e4m3fn if quantize else x.dtype),
        jax.ShapeDtypeStruct((C, H // 128) if has_scales or quantize else (0,), f32),
        jax.ShapeDtypeStruct(row_meta, i32),
        jax.ShapeDtypeStruct(row_meta, f32),
        jax.ShapeDtypeStruct((L,), i32),
        jax.ShapeDtypeStruct((L,), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((T, K if expert_major else num_ranks), i32),
        jax.ShapeDtypeStruct((C,), i32),
        jax.ShapeDtypeStruct((C,), i32),
        jax.ShapeDtypeStruct((C,), i32),
        jax.ShapeDtypeStruct((num_ranks, T, K) if expert_major else (0,), i32),
    )
    rank, group = _place(axis_name, num_ranks, within_node)
    return _call(
        "jax_ep_dispatch", types, x, x_scales if has_scales else jnp.zeros((0,), f32), topk_idx,
        topk_weights, rank, axis_name=axis_name,
        num_experts=np.int64(num_experts), capacity=np.int64(C), alignment=np.int64(alignment),
        layout=layout, path=path, has_scales=has_scales, quantize=bool(quantize),
        ue8m0=bool(ue8m0), group=group, tuning=_config.tuning_attributes(resolved))


def dispatch(x, x_scales, topk_idx, topk_weights, config: DispatchConfig) -> DispatchOutput:
    quantize = config.use_fp8 and x_scales is None
    if config.node_size is not None:
        if quantize:  # the node exchange moves the quantised rows
            x, x_scales = quantize_fp8(x, ue8m0=config.ue8m0)
        return _nodes_dispatch(x, x_scales, topk_idx, topk_weights, config)
    (out_x, out_scales, out_idx, out_weights, per_expert, group_sizes, num_received,
     num_dropped, send_slot, src_rank, src_token, src_k, pair_row) = _dispatch_call(
        x, x_scales, topk_idx, topk_weights, num_experts=config.num_experts,
        num_ranks=config.num_ranks, capacity=config.capacity, layout=config.layout,
        alignment=config.alignment, axis_name=config.axis_name, tuning=config.tuning,
        within_node=config.within_node, quantize=quantize, ue8m0=config.ue8m0)
    handle = DispatchHandle(topk_idx=topk_idx, send_slot=send_slot, src_rank=src_rank,
                            src_token=src_token, src_k=src_k, num_received=num_received,
                            pair_row=pair_row if config.layout == EXPERT_MAJOR else no_pair_rows(),
                            config=config)
    return DispatchOutput(x=out_x,
                          x_scales=out_scales if x_scales is not None or quantize else None,
                          topk_idx=out_idx, topk_weights=out_weights,
                          tokens_per_expert=per_expert, group_sizes=group_sizes,
                          num_received=num_received, num_dropped=num_dropped, handle=handle)


def _pair_row(handle: DispatchHandle):
    """The handle's pair_row for the kernels, which take an empty one for other layouts (made
    here, not carried in handles: XLA's compiler crashed on an empty operand that was a
    parameter of the program, a handle carried into another jitted program)."""
    if handle.config.layout == EXPERT_MAJOR:
        return handle.pair_row
    return jnp.zeros((0,), jnp.int32)


def _cached_call(x, handle: DispatchHandle, y=None, weights=None):
    """jax_ep_cached_dispatch: x's rows at the handle's rows; with row weights (expert_major)
    also the combine's backward in the same pass: (weights * rows, <rows, y> per row)."""
    C, H = handle.config.capacity, x.shape[1]
    weighted = weights is not None
    types = (jax.ShapeDtypeStruct((C, H), x.dtype),
             jax.ShapeDtypeStruct((C,) if weighted else (0,), jnp.float32))
    rank, group = _place(handle.config.axis_name, handle.config.num_ranks,
                         handle.config.within_node)
    return _call("jax_ep_cached_dispatch", types, x, handle.src_rank, handle.src_token,
                 _pair_row(handle), y if weighted else jnp.zeros((0,), x.dtype),
                 weights if weighted else jnp.zeros((0,), jnp.float32),
                 rank, axis_name=handle.config.axis_name, group=group,
                 tuning=_config.tuning_attributes(_handle_tuning(handle.config, "combine")))


def _handle_tuning(config: DispatchConfig, operation) -> Config:
    return _resolve(config.tuning, config.num_ranks, config.num_topk, config.num_experts,
                    config.layout, operation)


def cached_dispatch(x, handle: DispatchHandle):
    if handle.node_stage is not None:
        return _nodes_cached_dispatch(x, handle)
    return _cached_call(x, handle)[0]


def combine_backward(g, y, weights, handle: DispatchHandle):
    """(d y, d weights) of ``combine``; expert_major with weights in one kernel pass, which
    loads each token's gradient row once per rank and each row of y once."""
    if (weights is not None and handle.config.layout == EXPERT_MAJOR
            and handle.node_stage is None):
        return _cached_call(g, handle, y, weights.astype(jnp.float32))
    return reference.weighted_rows_backward(cached_dispatch(g, handle), y, weights)


def combine(y, weights, handle: DispatchHandle):
    if handle.node_stage is not None:
        return _nodes_combine(y, weights, handle)
    config = handle.config
    expert_major = config.layout == EXPERT_MAJOR
    _check_sources("combine", "combine", config.num_ranks, False)
    if expert_major:  # its stage sums a token's top-k rows
        _check_sources("combine", "combine", config.num_topk, True)
    if weights is None:
        weights = jnp.ones((config.capacity,), jnp.float32)
    resolved = _handle_tuning(config, "combine")
    rank, group = _place(config.axis_name, config.num_ranks, config.within_node)
    return _call("jax_ep_combine", jax.ShapeDtypeStruct((config.num_tokens, y.shape[1]), y.dtype),
                 y, weights.astype(jnp.float32), handle.topk_idx, handle.send_slot,
                 handle.num_received, handle.src_rank, handle.src_token, _pair_row(handle),
                 rank,
                 axis_name=config.axis_name, num_experts=np.int64(config.num_experts),
                 layout=config.layout, path=resolved.combine_path, group=group,
                 tuning=_config.tuning_attributes(resolved))


# ----------------------------------------------------------------------------- across nodes
#
# Where the EP axis spans nodes (config.node_size = G ranks per node, N = R / G nodes) a
# dispatch has two stages. The node exchange (jax_ep_node_send: NVSHMEM puts within the group
# of the ranks with this device's local index, one per node) brings each token once to every
# node holding one of its experts, as N blocks of T "virtual tokens" whose ids are relative to
# the node's experts; the node's G ranks then dispatch those among themselves over NVLink (the
# intranode kernels on the node's group: config.within_node). That stage's rows are ordered by
# (node rank, source node, token), the contract's by source rank = (source node, node rank),
# then token: one gather reorders them and applies the capacity (the stage keeps every row, so
# the contract's drops are the ones made). The combine goes back the same way: the node-local
# combine sums each virtual token's rows on the node (the node's partial, in y's dtype), and
# jax_ep_node_return puts each partial to its owner, which adds them in node order.

def _node_exchange_place(config: DispatchConfig):
    """(rank operand, group attribute) of the node exchange: one rank per node."""
    R, G = config.num_ranks, config.node_size
    stride = axis_stride(config.axis_name, R)
    return _rank(config.axis_name) // G, dict(num_ranks=R // G, stride=G * stride)


def _node_send(x, x_scales, topk_idx, topk_weights, config: DispatchConfig):
    """[N*T] rows, scales, node-relative ids and weights: block s holds node s's tokens (those
    with an expert on this node; other rows zero, ids -1)."""
    rank, group = _node_exchange_place(config)
    N = config.num_ranks // config.node_size
    (T, H), K = x.shape, topk_idx.shape[1]
    f32, i32 = jnp.float32, jnp.int32
    has_scales = x_scales is not None
    types = (jax.ShapeDtypeStruct((N * T, H), x.dtype),
             jax.ShapeDtypeStruct((N * T, x_scales.shape[1]) if has_scales else (0,), f32),
             jax.ShapeDtypeStruct((N * T, K), i32), jax.ShapeDtypeStruct((N * T, K), f32))
    return _call("jax_ep_node_send", types, x, x_scales if has_scales else jnp.zeros((0,), f32),
                 topk_idx, topk_weights.astype(f32), rank, axis_name=config.axis_name,
                 num_experts=np.int64(config.num_experts), group=group,
                 tuning=_config.tuning_attributes(_handle_tuning(config, "dispatch")))


def _node_return(partial, node_ids, topk_idx, config: DispatchConfig):
    """[T, H]: each token's node partials (partial: this node's, [N*T, H]) added in node order."""
    rank, group = _node_exchange_place(config)
    return _call("jax_ep_node_return",
                 jax.ShapeDtypeStruct((config.num_tokens, partial.shape[1]), partial.dtype),
                 partial, node_ids, topk_idx, rank, axis_name=config.axis_name,
                 num_experts=np.int64(config.num_experts), group=group,
                 tuning=_config.tuning_attributes(_handle_tuning(config, "combine")))


def _node_stage_config(config: DispatchConfig) -> DispatchConfig:
    """The node-local stage: the node's G ranks, its E / N experts, N*T virtual tokens, every
    row kept (the contract's capacity applies after the reordering)."""
    G, N = config.node_size, config.num_ranks // config.node_size
    T = config.num_tokens * N
    return dataclasses.replace(
        config, num_experts=config.num_experts // N, num_ranks=G, num_tokens=T,
        capacity=default_capacity(T, G, config.num_topk, config.num_local_experts,
                                  config.layout, 1),
        alignment=1, node_size=None, within_node=True)


def _rows_at(a, index, fill=0):
    """a[index] where index >= 0, `fill` elsewhere."""
    rows = a[jnp.maximum(index, 0)]
    mask = (index >= 0).reshape(index.shape + (1,) * (rows.ndim - index.ndim))
    return jnp.where(mask, rows, jnp.asarray(fill, rows.dtype))


_MAX_NODES, _MAX_NODE_TOPK = 64, 32  # the node exchange's limits (handlers/node_exchange.cu)


def _nodes_dispatch(x, x_scales, topk_idx, topk_weights, config: DispatchConfig):
    nodes = config.num_ranks // config.node_size
    if nodes > _MAX_NODES or config.num_topk > _MAX_NODE_TOPK:
        raise ValueError(
            f"dispatch across nodes: the CUDA kernels take at most {_MAX_NODES} nodes and top-k "
            f"<= {_MAX_NODE_TOPK}, got {nodes} nodes and top-k {config.num_topk}")
    stage_config = _node_stage_config(config)
    sent = _node_send(x, x_scales, topk_idx, topk_weights, config)
    stage = dispatch(sent[0], sent[1] if x_scales is not None else None, sent[2], sent[3],
                     stage_config)
    G, R = config.node_size, config.num_ranks
    N, T, C, L, K = R // G, config.num_tokens, config.capacity, config.num_local_experts, \
        config.num_topk
    h = stage.handle
    used = h.src_rank >= 0
    node_rank = jnp.maximum(h.src_rank, 0)
    source_node, token = jnp.maximum(h.src_token, 0) // T, jnp.maximum(h.src_token, 0) % T
    source = source_node * G + node_rank  # the contract's source rank
    row = jnp.arange(stage_config.capacity, dtype=jnp.int32)
    expert_major = config.layout == EXPERT_MAJOR
    if expert_major:  # blocks (expert, node rank, source node) here, (expert, source) there
        expert = jnp.maximum(stage.topk_idx, 0)
        B = L * N * G
        key_out = expert * R + source
        key_in = (expert * G + node_rank) * N + source_node
        count = jnp.zeros((B + 1,), jnp.int32).at[jnp.where(used, key_out, B)].add(1)[:B]
        count_in = count.reshape(L, N, G).transpose(0, 2, 1).reshape(B)
        per_expert = count.reshape(L, R).sum(1)
        aligned = (per_expert + config.alignment - 1) // config.alignment * config.alignment
        group_start = jnp.cumsum(aligned) - aligned
        dense_start = jnp.cumsum(per_expert) - per_expert
        start_out = (jnp.cumsum(count) - count
                     + jnp.repeat(group_start - dense_start, R, total_repeat_length=B))
    else:  # blocks (node rank, source node) here, source ranks there
        B = R
        key_out = source
        key_in = node_rank * N + source_node
        count = jnp.zeros((B + 1,), jnp.int32).at[jnp.where(used, key_out, B)].add(1)[:B]
        count_in = count.reshape(N, G).T.reshape(B)
        start_out = jnp.cumsum(count) - count
    start_in = jnp.cumsum(count_in) - count_in
    position = start_out[key_out] + row - start_in[key_in]
    kept = used & (position < C)
    row_map = jnp.full((C,), -1, jnp.int32).at[jnp.where(kept, position, C)].set(
        row, mode="drop")
    out_idx = _rows_at(stage.topk_idx, row_map, -1)
    if expert_major:
        tokens_per_expert = jnp.zeros((L + 1,), jnp.int32).at[
            jnp.where(kept, expert, L)].add(1)[:L]
        group_end = jnp.minimum(group_start + aligned, C)
        group_sizes = jnp.maximum(group_end - jnp.minimum(group_start, C), 0).astype(jnp.int32)
        num_received = jnp.sum(group_sizes, dtype=jnp.int32)
    else:
        ids = jnp.where(out_idx >= 0, out_idx, L).reshape(-1)
        tokens_per_expert = jnp.zeros((L + 1,), jnp.int32).at[ids].add(1)[:L]
        group_sizes = tokens_per_expert
        num_received = jnp.sum(kept, dtype=jnp.int32)
    src_rank = _rows_at(source, row_map, -1)
    src_token = _rows_at(token, row_map, -1)
    src_k = _rows_at(h.src_k, row_map, -1)
    pair_row = no_pair_rows()
    if expert_major:
        pair_row = jnp.full((R, T, K), -1, jnp.int32).at[
            jnp.where(row_map >= 0, src_rank, R), src_token, src_k].set(
            jnp.arange(C, dtype=jnp.int32), mode="drop")
    handle = DispatchHandle(
        topk_idx=topk_idx,
        # where a row lands is decided on its destination node: not known at the source
        send_slot=jnp.full((T, K if expert_major else R), -1, jnp.int32),
        src_rank=src_rank, src_token=src_token, src_k=src_k, num_received=num_received,
        pair_row=pair_row,
        config=config, node_stage=h, row_map=row_map)
    return DispatchOutput(
        x=_rows_at(stage.x, row_map),
        x_scales=None if x_scales is None else _rows_at(stage.x_scales, row_map),
        topk_idx=out_idx, topk_weights=_rows_at(stage.topk_weights, row_map),
        tokens_per_expert=tokens_per_expert, group_sizes=group_sizes, num_received=num_received,
        num_dropped=jnp.sum(used & ~kept, dtype=jnp.int32) + stage.num_dropped, handle=handle)


def _stage_rows(a, handle: DispatchHandle):
    """Rows in the contract's order -> the node-local stage's rows (zero where none)."""
    C_in, C = handle.node_stage.config.capacity, handle.config.capacity
    inverse = jnp.full((C_in,), -1, jnp.int32).at[
        jnp.where(handle.row_map >= 0, handle.row_map, C_in)].set(
        jnp.arange(C, dtype=jnp.int32), mode="drop")
    return _rows_at(a, inverse)


def _nodes_combine(y, weights, handle: DispatchHandle):
    stage = handle.node_stage
    partial = combine(_stage_rows(y, handle),
                      None if weights is None else _stage_rows(weights, handle), stage)
    return _node_return(partial, stage.topk_idx, handle.topk_idx, handle.config)


def _nodes_cached_dispatch(x, handle: DispatchHandle):
    ones = jnp.ones(handle.topk_idx.shape, jnp.float32)
    sent = _node_send(x, None, handle.topk_idx, ones, handle.config)
    return _rows_at(cached_dispatch(sent[0], handle.node_stage), handle.row_map)


# ----------------------------------------------------------------------------- low latency
#
# Dedicated decode kernels on the runtime's low-latency buffer (runtime.initialize(...,
# low_latency_bytes=...)): one custom call per half. The send returns its call number ([2]
# int32), which its receive takes: that data dependency orders them, and the number selects
# the buffer half (parity) and the flag values, so two calls of an op may be in flight. The
# fused ops (and the cached dispatches of the backward pass) launch both halves from one
# custom call, so XLA cannot put other calls between them.


def _gpu_kind() -> str:
    """This process's GPU model as JAX names it ("NVIDIA H200"), "" where JAX has no GPU."""
    try:
        return jax.local_devices(backend="gpu")[0].device_kind
    except RuntimeError:
        return ""


def _ll_attrs(config: LowLatencyConfig, *, split=None):
    limit = _limits()["low_latency_max_topk"]
    if config.num_topk > limit:
        raise ValueError(f"low-latency calls: the CUDA kernels take top-k <= {limit}, got "
                         f"{config.num_topk}")
    return dict(num_experts=np.int64(config.num_experts),
                max_tokens=np.int64(config.max_tokens_per_rank),
                group=_group(config.axis_name, config.num_ranks),
                tuning=_config.tuning_attributes(_config.resolve_low_latency(
                    config.tuning, split=split, device_kind=_gpu_kind())))


def _ll_receive_types(config: LowLatencyConfig, dtype, width, *, fp8, with_src, records):
    # the handlers read the layout from x's rank, and records from the attribute
    rows = config.x_rows_shape if records else config.rows_shape
    i32 = jnp.int32
    src = config.rows_shape if with_src else (0,)
    pairs = (config.num_ranks, config.num_tokens, config.num_topk) if with_src else (0,)
    return (
        jax.ShapeDtypeStruct(rows + (width,), dtype),
        jax.ShapeDtypeStruct(rows + (width // 128,) if fp8 else (0,), jnp.float32),
        jax.ShapeDtypeStruct((config.num_local_experts,), i32),
        jax.ShapeDtypeStruct(src, i32),
        jax.ShapeDtypeStruct(src, i32),
        jax.ShapeDtypeStruct(src, i32),
        jax.ShapeDtypeStruct(pairs, i32),
    )


def _ll_send_types(T, K):
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((T, K), i32), jax.ShapeDtypeStruct((2,), i32),
            jax.ShapeDtypeStruct((), i32))


def _ll_fused_dispatch(x, topk_idx, slots, config: LowLatencyConfig, *, cached):
    """Send and receive in one custom call (nothing can be scheduled between them)."""
    use_fp8 = config.use_fp8 and not cached
    dtype = jnp.float8_e4m3fn if use_fp8 else x.dtype
    records = config.layout == LL_RECORDS and not cached  # a cached dispatch packs rows
    types = _ll_send_types(*topk_idx.shape) + _ll_receive_types(
        config, dtype, x.shape[1], fp8=use_fp8, with_src=not cached, records=records)
    return _call("jax_ep_ll_dispatch", types, x, topk_idx, slots, _rank(config.axis_name),
                 axis_name=config.axis_name, use_fp8=bool(use_fp8), ue8m0=bool(config.ue8m0),
                 cached=bool(cached), records=records, **_ll_attrs(config))


def low_latency_send(x, topk_idx, config: LowLatencyConfig):
    """The whole dispatch, on a stream of the extension's own (the program's stream goes on);
    its results are the dispatch's outputs, for the receive only (they are written while the
    program goes on), and the send's operands travel with them so that XLA keeps them alive
    until the receive."""
    dtype = jnp.float8_e4m3fn if config.use_fp8 else x.dtype
    rank = _rank(config.axis_name)
    records = config.layout == LL_RECORDS
    types = _ll_send_types(*topk_idx.shape) + _ll_receive_types(
        config, dtype, x.shape[1], fp8=config.use_fp8, with_src=True, records=records)
    results = _call("jax_ep_ll_dispatch_send", types, x, topk_idx, jnp.zeros((0,), jnp.int32),
                    rank, axis_name=config.axis_name, use_fp8=bool(config.use_fp8),
                    ue8m0=bool(config.ue8m0), cached=False, records=records,
                    **_ll_attrs(config, split="dispatch"))
    return dict(results=tuple(results), operands=(x, topk_idx, rank), topk_idx=topk_idx)


def _ll_output(config, topk_idx, send_slot, num_dropped, x, scales, recv_count, src_rank,
               src_token, src_k, pair_row) -> LowLatencyOutput:
    handle = LowLatencyHandle(topk_idx=topk_idx, send_slot=send_slot, src_rank=src_rank,
                              src_token=src_token, src_k=src_k, recv_count=recv_count,
                              pair_row=pair_row, config=config)
    return LowLatencyOutput(x=x, x_scales=scales if config.use_fp8 else None,
                            recv_count=recv_count, num_dropped=num_dropped, handle=handle)


def low_latency_receive(sent, config: LowLatencyConfig) -> LowLatencyOutput:
    """The send's results, once its kernel is done (the program's stream waits for it)."""
    results = sent["results"]
    types = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
    send_slot, _, num_dropped, *received = _call(
        "jax_ep_ll_dispatch_receive", types, *results, *sent["operands"],
        axis_name=config.axis_name, input_output_aliases={i: i for i in range(len(results))})
    return _ll_output(config, sent["topk_idx"], send_slot, num_dropped, *received)


def low_latency_dispatch(x, topk_idx, config: LowLatencyConfig) -> LowLatencyOutput:
    send_slot, _, num_dropped, *received = _ll_fused_dispatch(
        x, topk_idx, jnp.zeros((0,), jnp.int32), config, cached=False)
    return _ll_output(config, topk_idx, send_slot, num_dropped, *received)


def low_latency_cached_dispatch(x, handle: LowLatencyHandle):
    """[T, D] -> [L, R*M, D] (or the packed rows) at the handle's positions, no quantisation;
    rows past recv_count are unspecified (the reference zeroes them)."""
    return _ll_fused_dispatch(x, handle.topk_idx, handle.send_slot, handle.config,
                              cached=True)[3]


def _ll_combine_args(y, topk_weights, handle: LowLatencyHandle):
    return (y, handle.recv_count, handle.pair_row, handle.topk_idx, handle.send_slot,
            topk_weights.astype(jnp.float32), _rank(handle.config.axis_name))


def _ll_combine_types(config: LowLatencyConfig, y):
    return (jax.ShapeDtypeStruct((2,), jnp.int32),
            jax.ShapeDtypeStruct((config.num_tokens, y.shape[-1]), y.dtype))


def low_latency_combine_send(y, topk_weights, handle: LowLatencyHandle):
    """The whole combine on a stream of the extension's own, as low_latency_send: its results
    (call, out) for the receive only, its operands kept alive until then."""
    config = handle.config
    args = _ll_combine_args(y, topk_weights, handle)
    results = _call("jax_ep_ll_combine_send", _ll_combine_types(config, y), *args,
                    axis_name=config.axis_name, **_ll_attrs(config, split="combine"))
    return dict(results=tuple(results), operands=tuple(args))


def low_latency_combine_receive(sent, handle: LowLatencyHandle):
    """out[t] = the partial rows of the ranks holding t's kept pairs, added in rank order
    (computed by the send's kernel; the program's stream waits for it here)."""
    results = sent["results"]
    types = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
    return _call("jax_ep_ll_combine_receive", types, *results, *sent["operands"],
                 axis_name=handle.config.axis_name,
                 input_output_aliases={i: i for i in range(len(results))})[1]


def low_latency_combine(y, topk_weights, handle: LowLatencyHandle):
    config = handle.config
    return _call("jax_ep_ll_combine", _ll_combine_types(config, y),
                 *_ll_combine_args(y, topk_weights, handle), axis_name=config.axis_name,
                 **_ll_attrs(config))[1]


def low_latency_buffer_size_hint(max_tokens_per_rank, hidden, num_experts, num_topk, num_ranks,
                                 dtype=jnp.bfloat16, across_nodes=False) -> int:
    """Low-latency buffer bytes that every call of a low-latency dispatch / combine of these
    per-GPU shapes needs (FP8 or not, forward and backward); the kernels' own formula.
    ``dtype``: the widest of x's and y's dtypes; ``across_nodes``: the EP group spans nodes."""
    module, why = _native.load()
    if module is None:
        raise RuntimeError(why)
    return int(module.required_low_latency_bytes(
        int(max_tokens_per_rank), int(hidden), int(num_experts), int(num_topk), int(num_ranks),
        jnp.dtype(dtype).itemsize, bool(across_nodes)))


def buffer_size_hint(num_tokens, hidden, num_topk, num_experts, num_ranks, capacity=None,
                     dtype=jnp.bfloat16, layout="rank_major", fp8=False, alignment=1,
                     config=None, node_size=None) -> int:
    """Symmetric-buffer bytes that every call of a dispatch / combine of these per-GPU shapes
    needs (forward and backward, in every path; the copy-engine paths' larger areas only when
    ``config`` or the environment selects them, or the layout is source_slots); the kernels'
    own formula. ``node_size``: the EP axis spans nodes of that many of its ranks (the node
    exchange's inboxes, and the node-local stage over nodes * num_tokens tokens)."""
    module, why = _native.load()
    if module is None:
        raise RuntimeError(why)
    if node_size is not None and node_size < num_ranks:
        nodes, itemsize = num_ranks // node_size, jnp.dtype(dtype).itemsize
        x_row = hidden if fp8 else hidden * itemsize
        exchange = max(
            module.node_exchange_bytes(nodes, num_tokens, num_topk, x_row,
                                       4 * (hidden // 128) if fp8 else 0, False),
            module.node_exchange_bytes(nodes, num_tokens, num_topk, hidden * itemsize, 0, True))
        stage = buffer_size_hint(nodes * num_tokens, hidden, num_topk, num_experts // nodes,
                                 node_size, None, dtype, layout, fp8, 1, config)
        return int(max(exchange, stage))
    if capacity is None:
        capacity = default_capacity(num_tokens, num_ranks, num_topk, num_experts // num_ranks,
                                    layout, alignment)
    return int(module.required_buffer_bytes(
        num_ranks, num_tokens, hidden, jnp.dtype(dtype).itemsize, num_topk, num_experts,
        capacity, layout == EXPERT_MAJOR, fp8,
        _copy_engine_selected(num_ranks, num_topk, num_experts, layout, config),
        _push_combine_selected(num_ranks, num_topk, num_experts, layout, config)))
