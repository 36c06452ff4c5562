"""Low-latency (decode) dispatch and combine: fixed-size per-expert blocks, send/receive split.

Every rank sends at most ``max_tokens_per_rank`` (M) tokens per step. Each (token, k) pair
becomes one row in the block of its expert: ``x`` is ``[L, R*M, H]`` with the first
``recv_count[l]`` rows of block l in use, ordered by source — this rank first, then the next
ranks in order, wrapping around (me, me + 1, ..., me - 1) — then by (source token, k). With
``layout="expert_major"`` the used rows of the blocks are packed one after another instead:
``x`` is ``[R*M*min(K, L), H]`` (every pair a rank can receive), group l the rows
``[sum(recv_count[:l]), sum(recv_count[:l + 1]))``, the rows and group sizes that
``experts.grouped_matmul`` / ``swiglu_mlp`` take: a grouped GEMM then computes the used rows
only, where a batched GEMM over the blocks computes all L*R*M (at DeepSeek-V3's 256 experts on
two ranks, 32768 rows for ~1000 used). ``layout="records"`` leaves the rows unexpanded: ``x``
is ``[R*M, H]``, row ``s*M + t`` the token t of source s (if any of its pairs was kept here),
and the handle is expert_major's, whose packed rows ``handle.record_rows()`` name:
``experts.grouped_matmul(x, w, recv_count, row_index=handle.record_rows())`` reads them by
index, so the receive stores each token once instead of once per pair (at DeepSeek-V3's
decode shapes ~4x fewer bytes). Combine takes ``y`` in the dispatch's layout (records:
expert_major's packed rows), weights each returned row with the source's gate and sums the K
rows of a token in k order.

``*_send`` / ``*_receive`` split each operation in two calls linked by a data dependency, so
that XLA can schedule independent work (another micro-batch's attention) between them; the
fused ``low_latency_dispatch`` / ``low_latency_combine`` are differentiable. On CUDA a send
runs on a stream of the extension's own, beside the work that follows it on the program's
stream (the dispatch 16 CTAs on an H200 and 8 elsewhere, the combine 16, unless
``Config(num_blocks=)`` says otherwise: the SMs it holds meanwhile; a send followed at once by
its receive is faster fused): the dispatch's whole operation, the combine's send, whose
receive then sums the partial rows on every SM; a receive waits for its send: pass a pending
call to one receive, unchanged.

On CUDA each operation (dispatch, combine) has two buffer halves used by alternate calls, so
at most two calls of an op may be in flight: between a ``*_send`` and its ``*_receive`` at most
one other call of the same op (split or fused; a cached dispatch counts as a dispatch) may
start. XLA orders calls only by data dependencies: tie independent calls together (as the
fused ops of ``jax.grad`` already are) when a program has more, e.g. the next send's inputs to
the last receive's output with ``x, _ = jax.lax.optimization_barrier((x, received.x))``. A
send that would overwrite a half whose data is still unread waits, and after
``JAX_EP_TIMEOUT_S`` traps naming the peer. The halves declare no side effects: XLA may merge
two identical pairs into one and drops a pair whose received values nothing reads, like any
unused call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep import api
from jax_ep import fp8 as _fp8
from jax_ep._types import (
    LL_LAYOUTS,
    LL_RECORDS,
    LowLatencyConfig,
    LowLatencyHandle,
    LowLatencyOutput,
)


def _backend(config: LowLatencyConfig):
    return api._backend_module(config.backend)


def _config(x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, ue8m0, backend,
            tuning=None, layout=LL_LAYOUTS[0]):
    api._check_not_in_work_call("low_latency_dispatch")
    if layout not in LL_LAYOUTS:
        raise ValueError(f"low_latency_dispatch: layout must be one of {LL_LAYOUTS}, "
                         f"got {layout!r}")
    if isinstance(x, (tuple, list)):  # the send quantises: a pair's scales would be lost
        raise TypeError("low_latency_dispatch takes unquantised rows (bfloat16, float16 or "
                        "float32); use_fp8=True quantises them in the send")
    x, _ = api._split_x(x)
    R = api._axis_size(axis_name)
    raw_idx = topk_idx
    topk_idx = api._check_topk(topk_idx, num_experts, R, "low_latency_dispatch")
    T, H = x.shape
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens but x has {T}")
    if api._static_int("max_tokens_per_rank", max_tokens_per_rank) < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    if T > max_tokens_per_rank:
        raise ValueError(
            f"{T} tokens exceed max_tokens_per_rank={max_tokens_per_rank}: the receive blocks "
            "are sized for that many tokens from every rank")
    if use_fp8 and H % _fp8.BLOCK:
        raise ValueError(f"FP8 dispatch needs hidden divisible by {_fp8.BLOCK}, got {H}")
    resolved = api._resolve_backend(backend)
    api._check_config(tuning)
    if tuning is not None and tuning.stream:
        raise ValueError("Config.stream applies to dispatch and combine; the low-latency "
                         "calls run on the program's stream (the split send and receive "
                         "are their overlap)")
    config = LowLatencyConfig(
        num_experts=int(num_experts), num_ranks=R, num_tokens=T, hidden=H,
        num_topk=topk_idx.shape[1], max_tokens_per_rank=int(max_tokens_per_rank),
        use_fp8=bool(use_fp8), ue8m0=bool(ue8m0), axis_name=axis_name, backend=resolved,
        tuning=tuning, layout=layout)
    return x, topk_idx, config, api._num_invalid(raw_idx, num_experts)


def low_latency_buffer_size_hint(max_tokens_per_rank, hidden, num_experts, num_topk, num_ranks,
                                 dtype=jnp.bfloat16, across_nodes=False) -> int:
    """Bytes of the low-latency buffer (``jax_ep.runtime.initialize(low_latency_bytes=...)``)
    that every low-latency dispatch / combine of these per-GPU shapes needs, FP8 or not,
    backward passes included; ``dtype`` is the widest of x's and y's dtypes; ``across_nodes``:
    the EP group spans several nodes (the combine then stages the rows it sends there). The
    CUDA handlers check the same formula. Needs the native extension (not a GPU)."""
    from jax_ep import _cuda

    return _cuda.low_latency_buffer_size_hint(max_tokens_per_rank, hidden, num_experts,
                                              num_topk, num_ranks, dtype, across_nodes)


def low_latency_split_gemm_sms(op="dispatch", config=None) -> int | None:
    """The SMs to size a GEMM for that runs between a split ``*_send`` of ``op`` ("dispatch"
    or "combine") and its receive (``experts.batched_matmul(..., sm_count=)``): this GPU's SMs
    less the CTAs the split call holds (``config``'s ``num_blocks``, else the split default
    for this GPU). XLA's own GEMMs take one CTA on every SM, which the split kernel then waits
    for. None without a GPU (a GEMM there takes what it likes)."""
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    api._check_config(config)
    from jax_ep import _cuda
    from jax_ep import config as _config

    sms = _config._multiprocessors()
    if not sms:
        return None
    blocks = _config.resolve_low_latency(config, split=op, device_kind=_cuda._gpu_kind())
    return max(sms - blocks.num_blocks, 1)


def low_latency_dispatch(x, topk_idx, *, num_experts, max_tokens_per_rank, axis_name,
                         use_fp8=True, ue8m0=False, backend="auto", config=None,
                         layout="blocks") -> LowLatencyOutput:
    """Send each (token, k) pair to its expert's block. x: [T, H] bf16/f16/f32, T <= M.

    With ``use_fp8`` the tokens are quantised (one scale per 128 channels) before sending and
    arrive as e4m3 data + float32 scales; then no gradient flows back to ``x``. ``config``: a
    ``jax_ep.Config`` (its ``num_blocks``), kept by the handle for the combine. ``layout``:
    ``"blocks"`` (``[L, R*M, H]``), ``"expert_major"`` (the used rows packed by local
    expert, ``[R*M*min(K, L), H]``) or ``"records"`` (each token once, ``[R*M, H]``, the
    packed rows by index; module docstring).
    """
    x, topk_idx, config, num_invalid = _config(x, topk_idx, num_experts, max_tokens_per_rank,
                                               axis_name, use_fp8, ue8m0, backend, config,
                                               layout)
    return _ll_dispatch(config, x, topk_idx)._replace(num_invalid=num_invalid)


def low_latency_dispatch_send(x, topk_idx, *, num_experts, max_tokens_per_rank, axis_name,
                              use_fp8=True, ue8m0=False, backend="auto", config=None,
                              layout="blocks"):
    """First half of ``low_latency_dispatch`` (not differentiable): returns a pending pytree."""
    x, topk_idx, config, num_invalid = _config(x, topk_idx, num_experts, max_tokens_per_rank,
                                               axis_name, use_fp8, ue8m0, backend, config,
                                               layout)
    return _Pending(_backend(config).low_latency_send(x, topk_idx, config), config, num_invalid)


def low_latency_dispatch_receive(pending) -> LowLatencyOutput:
    """Second half: the rows as they arrived and were laid out (on CUDA, the program waits
    here for the send's kernel)."""
    api._check_not_in_work_call("low_latency_dispatch_receive")
    out = _backend(pending.config).low_latency_receive(pending.arrays, pending.config)
    return out._replace(num_invalid=pending.num_invalid)


def low_latency_combine(y, topk_weights, handle: LowLatencyHandle):
    """[L, R*M, H] (expert_major and records: [P, H]) expert outputs -> [T, H]:
    sum_k topk_weights[t, k] * row(t, k).

    Order and rounding (both backends): every rank sums its own experts' rows of a token in k
    order, weighted, in float32, and rounds that partial to y's dtype (it crosses the wire
    once per (token, rank) instead of once per (token, k)); the token's owner adds the
    partials in rank order in float32 and rounds to y's dtype.
    """
    _check_combine(y, topk_weights, handle)
    return _ll_combine(y, topk_weights.astype(jnp.float32), handle)


def low_latency_combine_send(y, topk_weights, handle: LowLatencyHandle):
    """First half of ``low_latency_combine`` (not differentiable): the gates enter here, at
    the expert ranks, which read every owner's weights."""
    _check_combine(y, topk_weights, handle)
    return _Pending(_backend(handle.config).low_latency_combine_send(
        y, topk_weights.astype(jnp.float32), handle), handle.config)


def low_latency_combine_receive(pending, handle: LowLatencyHandle):
    """Second half: the owner's sums of the partial rows (on CUDA, the program waits here for
    the send's kernel)."""
    api._check_not_in_work_call("low_latency_combine_receive")
    return _backend(handle.config).low_latency_combine_receive(pending.arrays, handle)


@jax.tree_util.register_pytree_node_class
class _Pending:
    """Arrays in flight between a send and its receive, plus the static config (and, for a
    dispatch, the count of invalid ids its output reports)."""

    def __init__(self, arrays, config, num_invalid=None):
        self.arrays, self.config, self.num_invalid = arrays, config, num_invalid

    def tree_flatten(self):
        return (self.arrays, self.num_invalid), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        return cls(children[0], config, children[1])


def _check_combine(y, topk_weights, handle):
    api._check_not_in_work_call("low_latency_combine")
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle)}")
    c = handle.config
    want = c.rows_shape
    if y.ndim != len(want) + 1 or y.shape[:-1] != want:
        dims = ", ".join(str(d) for d in want)
        layout = "expert_major" if c.packed else c.layout  # records: the packed rows too
        raise ValueError(f"y must be [{dims}, hidden] (the dispatch's {layout} rows), "
                         f"got shape {y.shape}")
    if y.dtype not in api._FLOAT_DTYPES:
        raise TypeError(f"y must be bfloat16, float16 or float32, got {y.dtype}")
    if topk_weights is None:
        raise TypeError("topk_weights is required: the [tokens, top-k] gate weights")
    if topk_weights.shape != (c.num_tokens, c.num_topk):
        raise ValueError(f"topk_weights must be {(c.num_tokens, c.num_topk)}, "
                         f"got {topk_weights.shape}")


# ----------------------------------------------------------------------------- autodiff

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch(config, x, topk_idx):
    return _backend(config).low_latency_dispatch(x, topk_idx, config)


def _ll_dispatch_fwd(config, x, topk_idx):
    out = _ll_dispatch(config, x, topk_idx)
    return out, out.handle


def _ll_dispatch_bwd(config, handle, g):
    if config.use_fp8:
        return None, None  # quantised on the way: no gradient to x
    ones = jnp.ones((config.num_tokens, config.num_topk), jnp.float32)
    g_rows = _records_to_rows(g.x, handle) if config.layout == LL_RECORDS else g.x
    return _backend(config).low_latency_combine(g_rows, ones, handle), None


def _records_to_rows(g_records, handle):
    """A records dispatch's cotangent [R*M, H] as packed rows for the combine: each record's
    on the first packed row that reads it, zero on the others (the combine sums a token's
    rows here with weight 1: exactly the record's cotangent)."""
    rec = handle.record_rows()
    P, RM = rec.shape[0], g_records.shape[0]
    row = jnp.arange(P, dtype=jnp.int32)
    slot = jnp.where(rec >= 0, rec, RM)
    first = jnp.full((RM + 1,), P, jnp.int32).at[slot].min(row)
    is_first = (rec >= 0) & (first[slot] == row)
    rows = g_records[jnp.clip(rec, 0, RM - 1)]
    return jnp.where(is_first[:, None], rows, jnp.zeros((), g_records.dtype))


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


@jax.custom_vjp
def _ll_combine(y, topk_weights, handle):
    return _backend(handle.config).low_latency_combine(y, topk_weights, handle)


def _ll_combine_fwd(y, topk_weights, handle):
    return _ll_combine(y, topk_weights, handle), (y, topk_weights, handle)


def _ll_combine_bwd(residuals, g):
    y, topk_weights, handle = residuals
    backend = _backend(handle.config)
    K = handle.config.num_topk
    # unused rows of a cached dispatch are unspecified on CUDA (maybe NaN bits): mask them
    used = (handle.src_rank >= 0)[..., None]
    g_rows = jnp.where(used, backend.low_latency_cached_dispatch(g.astype(y.dtype), handle),
                       jnp.zeros((), y.dtype))  # [L, RM, H]
    w_rows = jnp.where(used, backend.low_latency_cached_dispatch(topk_weights, handle),
                       0.0)  # [L, RM, K]
    k_onehot = handle.src_k[..., None] == jnp.arange(K)
    row_w = jnp.sum(jnp.where(k_onehot, w_rows, 0.0), axis=-1)
    dy = (g_rows.astype(jnp.float32) * row_w[..., None]).astype(y.dtype)
    dot = jnp.sum(g_rows.astype(jnp.float32) * y.astype(jnp.float32), axis=-1)  # [L, RM]
    ones = jnp.ones_like(topk_weights)
    d_weights = backend.low_latency_combine(jnp.where(k_onehot, dot[..., None], 0.0), ones,
                                            handle)
    return dy, d_weights, None


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)
