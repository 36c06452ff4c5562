"""CUDA backend: the contract of ``jax_ep.reference`` served by the extension's FFI targets.

Each function runs per device inside ``shard_map``; the kernels reach the peers through the
symmetric buffer set up by ``jax_ep.runtime.initialize()``. The EP axis index is passed as an
operand so that the kernels can check it equals the process's NVSHMEM PE.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep._types import (
    EXPERT_MAJOR,
    DispatchConfig,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyConfig,
    LowLatencyHandle,
    LowLatencyOutput,
)


def is_available() -> tuple[bool, str]:
    module, why = _native.load()
    if module is None:
        return False, why
    if not _native.gpu_present():
        return False, "JAX has no GPU backend here"
    if not module.is_initialized():
        return False, "jax_ep.runtime.initialize() has not been called in this process"
    return True, ""


def _num_blocks() -> np.int64:
    """CTAs per communication kernel (the SM budget); 0 lets the extension choose."""
    return np.int64(int(os.environ.get("JAX_EP_NUM_BLOCKS", "0")))


_DISPATCH_MODES = {"pull": 0, "push": 1, "fused": 2}


def _push_dispatch() -> np.int64:
    """JAX_EP_DISPATCH selects the data path: push (default: senders store rows into the
    receivers' buffers over NVLink, then the receivers copy them out), pull (receivers load
    rows from the senders' buffers), or fused (push, with the copy-out in the same kernel,
    chunk by chunk as rows arrive). Measurements: benchmarks/RESULTS.md."""
    mode = os.environ.get("JAX_EP_DISPATCH", "push")
    if mode not in _DISPATCH_MODES:
        raise ValueError(f"JAX_EP_DISPATCH must be one of {sorted(_DISPATCH_MODES)}, got {mode!r}")
    return np.int64(_DISPATCH_MODES[mode])


def _rank(axis_name):
    return jax.lax.axis_index(axis_name).astype(jnp.int32)


def _as_varying(value, axis_name):
    """Mark a per-device result as varying over the EP axis, as shard_map's replication
    checks expect of data that differs between devices (ffi_call cannot infer it). pcast
    refuses values that already are (or are treated as, when checks are off): keep those."""
    try:
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(value, axis_name, to="varying")
        return jax.lax.pvary(value, axis_name)
    except ValueError:
        return value


def _call(name, result_types, *args, axis_name, **attrs):
    _native.register()
    out = jax.ffi.ffi_call(name, result_types, has_side_effect=True)(*args, **attrs)
    if axis_name is None:
        return out
    return jax.tree.map(lambda v: _as_varying(v, axis_name), out)


def layout(topk_idx, *, num_experts, num_ranks):
    T = topk_idx.shape[0]
    per_rank, per_expert, in_rank = _call(
        "jax_ep_layout",
        (jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((T, num_ranks), jnp.bool_)),
        topk_idx, axis_name=None, num_experts=np.int64(num_experts),
        num_ranks=np.int64(num_ranks))
    return DispatchLayout(per_rank, per_expert, in_rank)


def _dispatch_call(x, x_scales, topk_idx, topk_weights, *, num_experts, num_ranks, capacity,
                   expert_major, alignment, axis_name, block=0):
    """The jax_ep_dispatch custom call; returns its 12 results (see DispatchOutput/Handle)."""
    T, H = x.shape
    K, C, L = topk_idx.shape[1], capacity, num_experts // num_ranks
    has_scales = x_scales is not None
    row_meta = (C,) if expert_major else (C, K)
    i32, f32 = jnp.int32, jnp.float32
    types = (
        jax.ShapeDtypeStruct((C, H), x.dtype),
        jax.ShapeDtypeStruct((C, H // 128) if has_scales else (0,), f32),
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
    )
    return _call(
        "jax_ep_dispatch", types, x, x_scales if has_scales else jnp.zeros((0,), f32), topk_idx,
        topk_weights, _rank(axis_name), axis_name=axis_name,
        num_experts=np.int64(num_experts), capacity=np.int64(C),
        expert_major=np.int64(expert_major), alignment=np.int64(alignment),
        has_scales=np.int64(has_scales), num_blocks=_num_blocks(), push=_push_dispatch(),
        block=np.int64(block))


def dispatch(x, x_scales, topk_idx, topk_weights, config: DispatchConfig) -> DispatchOutput:
    (out_x, out_scales, out_idx, out_weights, per_expert, group_sizes, num_received,
     num_dropped, send_slot, src_rank, src_token, src_k) = _dispatch_call(
        x, x_scales, topk_idx, topk_weights, num_experts=config.num_experts,
        num_ranks=config.num_ranks, capacity=config.capacity,
        expert_major=config.layout == EXPERT_MAJOR, alignment=config.alignment,
        axis_name=config.axis_name)
    handle = DispatchHandle(topk_idx=topk_idx, send_slot=send_slot, src_rank=src_rank,
                            src_token=src_token, src_k=src_k, num_received=num_received,
                            config=config)
    return DispatchOutput(x=out_x, x_scales=out_scales if x_scales is not None else None,
                          topk_idx=out_idx, topk_weights=out_weights,
                          tokens_per_expert=per_expert, group_sizes=group_sizes,
                          num_received=num_received, num_dropped=num_dropped, handle=handle)


def cached_dispatch(x, handle: DispatchHandle):
    C = handle.config.capacity
    return _call("jax_ep_cached_dispatch", jax.ShapeDtypeStruct((C, x.shape[1]), x.dtype), x,
                 handle.src_rank, handle.src_token, _rank(handle.config.axis_name),
                 axis_name=handle.config.axis_name, num_blocks=_num_blocks())


def combine(y, weights, handle: DispatchHandle):
    config = handle.config
    if weights is None:
        weights = jnp.ones((config.capacity,), jnp.float32)
    return _call("jax_ep_combine", jax.ShapeDtypeStruct((config.num_tokens, y.shape[1]), y.dtype),
                 y, weights.astype(jnp.float32), handle.topk_idx, handle.send_slot,
                 handle.num_received, handle.src_rank, _rank(config.axis_name),
                 axis_name=config.axis_name,
                 num_experts=np.int64(config.num_experts),
                 expert_major=np.int64(config.layout == EXPERT_MAJOR), num_blocks=_num_blocks())


# ----------------------------------------------------------------------------- low latency
#
# First CUDA version of the low-latency mode: the normal-mode expert_major kernels with fixed
# blocks of R*M rows per local expert (the low-latency layout). Correct and graph-safe; not
# yet the dedicated decode kernels, and the send half does all the work (no overlap yet).


def _ll_block(config: LowLatencyConfig) -> int:
    return config.num_ranks * config.max_tokens_per_rank


def _ll_flat_handle(handle: LowLatencyHandle) -> DispatchHandle:
    """The expert_major view of a low-latency handle (global rows instead of rows per block)."""
    c = handle.config
    L, block = c.num_local_experts, _ll_block(c)
    local = jnp.where(handle.topk_idx >= 0, handle.topk_idx % L, 0)
    flat_config = DispatchConfig(
        num_experts=c.num_experts, num_ranks=c.num_ranks, num_tokens=c.num_tokens,
        hidden=c.hidden, num_topk=c.num_topk, capacity=L * block, layout=EXPERT_MAJOR,
        axis_name=c.axis_name, backend="cuda")
    return DispatchHandle(
        topk_idx=handle.topk_idx,
        send_slot=jnp.where(handle.send_slot >= 0, local * block + handle.send_slot, -1),
        src_rank=handle.src_rank.reshape(-1), src_token=handle.src_token.reshape(-1),
        src_k=handle.src_k.reshape(-1), num_received=jnp.int32(L * block), config=flat_config)


def low_latency_send(x, topk_idx, config: LowLatencyConfig):
    from jax_ep.fp8 import quantize_fp8

    L, block, K = config.num_local_experts, _ll_block(config), config.num_topk
    data, scales = quantize_fp8(x, ue8m0=config.ue8m0) if config.use_fp8 else (x, None)
    (out_x, out_scales, _, _, per_expert, _, _, num_dropped, send_slot, src_rank, src_token,
     src_k) = _dispatch_call(
        data, scales, topk_idx, jnp.zeros((config.num_tokens, K), jnp.float32),
        num_experts=config.num_experts, num_ranks=config.num_ranks, capacity=L * block,
        expert_major=True, alignment=1, axis_name=config.axis_name, block=block)
    local = jnp.where(topk_idx >= 0, topk_idx % L, 0)
    return dict(
        x=out_x.reshape(L, block, -1),
        x_scales=None if scales is None else out_scales.reshape(L, block, -1),
        recv_count=per_expert, num_dropped=num_dropped,
        send_slot=jnp.where(send_slot >= 0, send_slot - local * block, -1),
        src_rank=src_rank.reshape(L, block), src_token=src_token.reshape(L, block),
        src_k=src_k.reshape(L, block), topk_idx=topk_idx)


def low_latency_receive(sent, config: LowLatencyConfig) -> LowLatencyOutput:
    handle = LowLatencyHandle(topk_idx=sent["topk_idx"], send_slot=sent["send_slot"],
                              src_rank=sent["src_rank"], src_token=sent["src_token"],
                              src_k=sent["src_k"], config=config)
    return LowLatencyOutput(x=sent["x"], x_scales=sent["x_scales"],
                            recv_count=sent["recv_count"], num_dropped=sent["num_dropped"],
                            handle=handle)


def low_latency_dispatch(x, topk_idx, config: LowLatencyConfig) -> LowLatencyOutput:
    return low_latency_receive(low_latency_send(x, topk_idx, config), config)


def low_latency_cached_dispatch(x, handle: LowLatencyHandle):
    c = handle.config
    rows = cached_dispatch(x, _ll_flat_handle(handle))
    return rows.reshape(c.num_local_experts, _ll_block(c), -1)


def low_latency_combine_send(y, handle: LowLatencyHandle):
    return dict(y=y)  # the weights arrive with the receive half: all work happens there


def low_latency_combine_receive(sent, topk_weights, handle: LowLatencyHandle):
    """out[t] = sum over k ascending of topk_weights[t, k] * row(t, k), float32."""
    flat = _ll_flat_handle(handle)
    y = sent["y"].reshape(flat.config.capacity, -1)
    # every row's gate, fetched from its source token
    gates = cached_dispatch(topk_weights.astype(jnp.float32), flat)  # [C, K]
    k = jnp.maximum(flat.src_k, 0)
    row_weights = jnp.take_along_axis(gates, k[:, None], axis=1)[:, 0]
    return combine(y, row_weights, flat)


def low_latency_combine(y, topk_weights, handle: LowLatencyHandle):
    return low_latency_combine_receive(low_latency_combine_send(y, handle), topk_weights, handle)


def buffer_size_hint(num_tokens, hidden, num_topk, num_experts, num_ranks, capacity=None,
                     dtype=jnp.bfloat16, layout="rank_major", fp8=False, alignment=1) -> int:
    """Symmetric-buffer bytes that every call of a dispatch / combine of these per-GPU shapes
    needs (forward and backward, pull or push dispatch); the kernels' own formula."""
    module, why = _native.load()
    if module is None:
        raise RuntimeError(why)
    if capacity is None:
        from jax_ep.api import default_capacity

        capacity = default_capacity(num_tokens, num_ranks, num_topk, num_experts // num_ranks,
                                    layout, alignment)
    return int(module.required_buffer_bytes(
        num_ranks, num_tokens, hidden, jnp.dtype(dtype).itemsize, num_topk, num_experts,
        capacity, layout == EXPERT_MAJOR, fp8))
