"""Public API: layout, dispatch and combine with their autodiff rules, backend-agnostic.

Everything here runs per device inside ``jax.shard_map`` over the expert-parallel mesh axis
whose name the caller passes. Arguments are validated at trace time; the numbers travel
to the chosen backend (``jax_ep.reference`` or the CUDA kernels), which share one contract.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import config as _config
from jax_ep import fp8 as _fp8
from jax_ep import reference as _reference
from jax_ep._mesh import axis_stride, traced_platform, vary_alike
from jax_ep._types import (
    EXPERT_MAJOR,
    LAYOUTS,
    RANK_MAJOR,
    SOURCE_SLOTS,
    DispatchConfig,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    default_capacity,
)
from jax_ep.config import Config

BACKENDS = ("auto", "reference", "cuda")
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------- backends

def _cuda_module():
    from jax_ep import _cuda  # imported lazily: needs nothing on CPU-only installs

    return _cuda


def cuda_available() -> tuple[bool, str]:
    """Whether the CUDA backend can run here, and why not."""
    try:
        cuda = _cuda_module()
    except ImportError as e:  # pragma: no cover - depends on the install
        return False, f"jax_ep CUDA backend could not be imported: {e}"
    return cuda.is_available()


def _resolve_backend(name: str) -> str:
    """"auto": the CUDA kernels where they can run and the mesh being traced (if any) is of
    GPUs, else the reference (e.g. a program on the host's devices in a GPU process).
    "cuda" is taken as asked, on any mesh (a program lowered for CUDA elsewhere)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return name
    ok, why = cuda_available()
    if name == "cuda" and not ok:
        raise RuntimeError(f"backend='cuda' cannot run: {why}")
    if name == "auto" and traced_platform() not in (None, "gpu"):
        return "reference"
    return "cuda" if ok else "reference"


def _backend_module(name: str):
    if name not in ("cuda", "reference"):  # a config built outside the public calls: "auto"
        name = _resolve_backend(name)
    return _cuda_module() if name == "cuda" else _reference


# ----------------------------------------------------------------------------- validation

def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except (NameError, ValueError) as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mesh axis: call jax_ep inside "
            "jax.shard_map over the expert-parallel axis") from e


def _check_config(config):
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a jax_ep.Config or None, got {type(config).__name__}")
    return config


def stream_calls_supported() -> bool:
    """Whether this jax wraps a function as a call on another XLA stream (``Config.stream``):
    ``jax.experimental.compute_on``'s functional form, ``compute_on2`` in jax 0.10,
    ``compute_on(f, compute_type=, out_memory_spaces=)`` from 0.11."""
    return _functional_compute_on() is not None


def _functional_compute_on():
    from jax.experimental import compute_on as module

    functional = getattr(module, "compute_on2", None)
    if functional is None and "out_memory_spaces" in inspect.signature(
            module.compute_on).parameters:
        functional = module.compute_on
    return functional


def on_stream(fn, stream: int = 1):
    """fn as an async call on XLA's GPU stream ``stream`` (>= 1): work of the program that needs
    nothing from a jax_ep call, which XLA then runs beside that call.

    XLA's scheduler starts such a call before the program's-stream work it may overlap, so a
    jax_ep call left on the program's stream runs beside fn. The other way round (the jax_ep
    call on a stream with ``Config.stream``, the work on the program's stream) overlaps only
    where the scheduler happens to start the call before the work: on 2×H100 it did for the
    dispatch and not for the combine (an independent 189 µs matmul and a 206 µs combine took
    326 µs per call with the matmul on stream 1, 421 with the combine on stream 1;
    benchmarks/RESULTS.md). fn must hold no XLA collective (XLA gives those no stream inside
    such a call) and no jax_ep call (a ValueError: they share one workspace with the calls
    beside them; ``Config.stream`` puts jax_ep's calls on a stream), and its stream should
    not be one jax_ep's calls use, or the two queue behind each other. Inside ``shard_map``
    fn's array inputs are typed as varying over every mesh axis any of them varies over,
    before the call (no data moves), so the gradient of an input that is the same on every
    device is summed over the mesh outside the call. Needs jax >= 0.10
    (``stream_calls_supported()``); off the GPU, XLA runs fn inline.
    """
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 1:
        raise ValueError(f"on_stream needs a stream number >= 1, got {stream!r}")
    if not callable(fn):
        raise TypeError(f"on_stream wraps a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def work(*args, **kwargs):  # traced inside the stream call: no jax_ep call may be in it
        _work_calls.depth = getattr(_work_calls, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _work_calls.depth -= 1

    call = _stream_call(work, stream)

    @functools.wraps(fn)
    def on_stream_call(*args, **kwargs):
        # Inside shard_map an input the same on every device (a replicated weight) that meets
        # varying ones is cast to vary, and the transpose of that cast sums its cotangent over
        # the mesh; cast here, before the call, that sum (an all-reduce) stays outside it: XLA
        # aborts on a collective inside a stream call. Inputs all alike keep their types.
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [i for i, v in enumerate(leaves) if _is_array(v)]
        for i, v in zip(arrays, vary_alike(*[leaves[i] for i in arrays])):
            leaves[i] = v
        args, kwargs = jax.tree.unflatten(tree, leaves)
        return call(*args, **kwargs)

    return on_stream_call


def _is_array(value) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic)) or hasattr(value, "aval")


# How many on_stream functions are being traced on this thread.
_work_calls = threading.local()


def _check_not_in_work_call(op: str):
    """A jax_ep call inside ``on_stream``'s function would run beside the process's other
    jax_ep calls on the program's stream, in the one symmetric workspace they share."""
    if getattr(_work_calls, "depth", 0):
        raise ValueError(
            f"{op} inside a jax_ep.on_stream function: jax_ep's calls share one workspace and "
            "must not run beside each other; put them on a stream with "
            "config=jax_ep.Config(stream=n) instead")


def _stream_call(fn, n: int):
    compute_on = _functional_compute_on()
    if compute_on is None:
        raise NotImplementedError(
            f"a call on another XLA stream needs jax >= 0.10 (jax.experimental.compute_on's "
            f"functional form); this is jax {jax.__version__}")
    return compute_on(compute_type=f"gpu_stream:{n}",
                      out_memory_spaces=jax.memory.Space.Device)(_unmarked_inside(fn))


def _unmarked_inside(fn):
    """fn traced without a compute type of its own. jax marks every operation traced inside a
    stream call with the stream (and as not inlineable), a legacy of its ``compute_on`` context
    manager; XLA drops those marks from the call's own operations, but a marked nested call (a
    jitted function such as ``jax.nn.silu``, in the forward pass or its transpose) becomes an
    async call of its own inside the first, which no stream reaches: the program fails to
    build ("No ExecutionStreamId found for call-start"). Unmarked, XLA inlines it."""
    try:
        from jax._src import config as jax_config

        context = jax_config.compute_on_context_manager
    except (ImportError, AttributeError):  # a jax without the mark
        return fn

    @functools.wraps(fn)
    def unmarked(*args, **kwargs):
        previous = context.swap_local(None)
        try:
            return fn(*args, **kwargs)
        finally:
            context.set_local(previous)

    return unmarked


def _on_stream(config: DispatchConfig, fn):
    """fn as XLA runs it: inline on the program's stream, or with ``Config.stream`` n >= 1 as
    an async call on XLA's GPU stream n, so that independent work runs beside it. The
    reference backend stays inline: its XLA collectives cannot run in such a call."""
    n = _config.stream(config.tuning)
    if n == 0 or config.backend != "cuda":
        return fn
    return _stream_call(fn, n)


def _static_int(name, value):
    """A static size given as an integer (a float such as 2.5 must not be truncated)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python or NumPy integer, got {value!r}") from None


def _check_topk(topk_idx, num_experts, num_ranks, what="dispatch"):
    if topk_idx.ndim != 2:
        raise ValueError(f"{what}: topk_idx must be [tokens, top_k], got shape {topk_idx.shape}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"{what}: topk_idx must be an integer array, got {topk_idx.dtype}")
    if _static_int("num_experts", num_experts) < 1:
        raise ValueError(f"{what}: num_experts must be >= 1, got {num_experts}")
    if num_experts % num_ranks:
        raise ValueError(
            f"{what}: num_experts={num_experts} is not divisible by the expert-parallel size "
            f"{num_ranks}")
    if not isinstance(topk_idx, jax.core.Tracer):
        ids = np.asarray(topk_idx)
        bad = (ids < -1) | (ids >= num_experts)
        if bad.any():
            raise ValueError(
                f"{what}: topk_idx holds {int(bad.sum())} ids outside [-1, {num_experts}) "
                f"(e.g. {int(ids[bad][0])}); -1 means 'no expert'")
    if topk_idx.dtype != jnp.int32:  # other widths must neither wrap nor clip into experts
        topk_idx = jnp.where(_invalid(topk_idx, num_experts) | (_widened(topk_idx) < 0), -1,
                             topk_idx)
    return topk_idx.astype(jnp.int32)


def _widened(ids):
    """ids in a type that holds them and num_experts (compared without wrapping)."""
    ids = jnp.asarray(ids)
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        return ids.astype(jnp.promote_types(ids.dtype, jnp.uint32))
    return ids.astype(jnp.promote_types(ids.dtype, jnp.int32))


def _invalid(topk_idx, num_experts):
    """Mask of the ids outside [-1, num_experts)."""
    ids = _widened(topk_idx)
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        return ids >= num_experts
    return (ids < -1) | (ids >= num_experts)


def _num_invalid(topk_idx, num_experts):
    """[] int32: entries of topk_idx outside [-1, num_experts)."""
    return jnp.sum(_invalid(topk_idx, num_experts), dtype=jnp.int32)


def _split_x(x):
    """x is an array, or an FP8 pair (e4m3 data [T, H], float32 scales [T, H/128])."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError("an FP8 input is a pair (data, scales)")
        data, scales = x
        if data.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"FP8 data must be float8_e4m3fn, got {data.dtype}")
        if data.ndim != 2 or data.shape[1] % _fp8.BLOCK:
            raise ValueError(
                f"FP8 data must be [tokens, hidden] with hidden divisible by {_fp8.BLOCK}, "
                f"got {data.shape}")
        want = (data.shape[0], data.shape[1] // _fp8.BLOCK)
        if scales.shape != want or scales.dtype != jnp.float32:
            raise ValueError(
                f"FP8 scales must be float32 {want}, got {scales.dtype} {scales.shape}")
        return data, scales
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {x.shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32 (or an FP8 pair), got {x.dtype}")
    return x, None


# ----------------------------------------------------------------------------- nodes

def axis_node_size(axis_name, num_ranks) -> int | None:
    """Ranks of the EP axis per node where its groups span nodes (``runtime.topology()``, with
    the processes listed in mesh order), else None. Every group must be whole nodes' worth of
    consecutive ranks, G per node."""
    from jax_ep import runtime

    topology = runtime.topology()
    if topology is None or topology.num_nodes == 1:
        return None
    nodes, stride = topology.nodes, axis_stride(axis_name, num_ranks)
    sizes = set()
    for base in range(len(nodes)):
        if (base // stride) % num_ranks or base + (num_ranks - 1) * stride >= len(nodes):
            continue
        of = [nodes[base + r * stride] for r in range(num_ranks)]
        G = next((r for r in range(1, num_ranks) if of[r] != of[0]), num_ranks)
        blocks = [of[i:i + G] for i in range(0, num_ranks, G)]
        if (num_ranks % G or any(len(set(b)) != 1 for b in blocks)
                or len({b[0] for b in blocks}) != len(blocks)):
            raise ValueError(
                f"the expert-parallel axis {axis_name!r} runs over the nodes {of}: across nodes "
                "every group must be blocks of the same number of consecutive ranks per node")
        sizes.add(G)
    if len(sizes) != 1:
        raise ValueError(f"the groups of the expert-parallel axis {axis_name!r} have "
                         f"{sorted(sizes)} ranks per node: they must all have the same")
    G = sizes.pop()
    return None if G == num_ranks else G


def buffer_size_hint(num_tokens, hidden, num_topk, num_experts, num_ranks, capacity=None,
                     dtype=jnp.bfloat16, layout=RANK_MAJOR, fp8=False, alignment=1,
                     config=None, node_size=None) -> int:
    """Bytes of the symmetric buffer (``jax_ep.runtime.initialize(buffer_bytes)``) that every
    dispatch / combine of these per-GPU shapes needs, backward passes included; ``node_size``:
    the EP axis spans nodes of that many of its ranks. The CUDA handlers check the same
    formula. Needs the native extension (not a GPU)."""
    return _cuda_module().buffer_size_hint(
        num_tokens, hidden, num_topk, num_experts, num_ranks, capacity=capacity, dtype=dtype,
        layout=layout, fp8=fp8, alignment=alignment, config=config, node_size=node_size)


# ----------------------------------------------------------------------------- layout

def get_dispatch_layout(topk_idx, num_experts, *, axis_name=None, num_ranks=None,
                        backend="auto") -> DispatchLayout:
    """Tokens per rank, (token, k) pairs per expert and the token-in-rank mask.

    Needs no communication. ``num_ranks`` defaults to the size of ``axis_name``.
    """
    if num_ranks is None:
        if axis_name is None:
            raise ValueError("get_dispatch_layout needs axis_name or num_ranks")
        num_ranks = _axis_size(axis_name)
    if int(num_ranks) < 1:
        raise ValueError(f"get_dispatch_layout: num_ranks must be >= 1, got {num_ranks}")
    topk_idx = _check_topk(topk_idx, num_experts, num_ranks, "get_dispatch_layout")
    module = _backend_module(_resolve_backend(backend))
    return module.layout(topk_idx, num_experts=int(num_experts), num_ranks=int(num_ranks))


# ----------------------------------------------------------------------------- dispatch

def dispatch(x, topk_idx, topk_weights=None, *, num_experts, axis_name, capacity=None,
             layout=RANK_MAJOR, expert_alignment=1, use_fp8=False, ue8m0=False,
             backend="auto", config=None) -> DispatchOutput:
    """Send each token to the ranks holding its experts. See ``jax_ep._types`` for the layout.

    Args:
      x: [T, H] bfloat16/float16/float32 tokens, or an FP8 pair from ``quantize_fp8``.
      topk_idx: [T, K] integer global expert ids; -1 means no expert.
      topk_weights: [T, K] gate weights (float32 on the wire); defaults to ones.
      num_experts: total experts E, divisible by the size R of ``axis_name``.
      axis_name: the expert-parallel mesh axis (rank r holds experts [r*E/R, (r+1)*E/R)).
      capacity: rows of every output (static); default: the worst case, nothing dropped.
      layout: ``"rank_major"`` (deduplicated per rank, DeepEP's), ``"expert_major"`` or
        ``"source_slots"`` (rank_major's rows at fixed slots ``s*T + t``; capacity ``R*T``).
      expert_alignment: expert_major only: each group is padded to a multiple of this.
      use_fp8: quantise x on the way: the rows arrive as e4m3 data + float32 scales, the
        same bits as ``dispatch(quantize_fp8(x, ue8m0=ue8m0), ...)``; the CUDA backend's
        default path quantises in its send kernel, the others first (one kernel). As with an
        FP8 pair, no gradient flows back to x.
      ue8m0: with ``use_fp8``, every scale a power of two.
      backend: ``"auto"`` (the CUDA kernels where the extension runs and the mesh is of
        GPUs, else the reference), ``"reference"`` or ``"cuda"``.
      config: a ``jax_ep.Config`` (data paths, CTAs) for the CUDA kernels; the handle keeps it
        for the combine and both backward passes. None: the environment's overrides and the
        measured defaults (``jax_ep.config``).
    """
    _check_not_in_work_call("dispatch")
    data, scales = _split_x(x)
    if use_fp8 and scales is not None:
        raise ValueError("dispatch: use_fp8 quantises x itself; pass the unquantised rows, "
                         "not an FP8 pair")
    if use_fp8 and data.shape[1] % _fp8.BLOCK:
        raise ValueError(f"dispatch: use_fp8 needs hidden divisible by {_fp8.BLOCK}, got "
                         f"{data.shape}")
    if ue8m0 and not use_fp8:
        raise ValueError("dispatch: ue8m0 applies with use_fp8=True only")
    num_ranks = _axis_size(axis_name)
    raw_idx = topk_idx
    topk_idx = _check_topk(topk_idx, num_experts, num_ranks)
    T, H = data.shape
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens but x has {T}")
    K = topk_idx.shape[1]
    if topk_weights is None:
        topk_weights = jnp.ones((T, K), jnp.float32)
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights shape {topk_weights.shape} must match topk_idx shape {topk_idx.shape}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if _static_int("expert_alignment", expert_alignment) < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
    if layout != EXPERT_MAJOR and expert_alignment != 1:
        raise ValueError("expert_alignment applies to layout='expert_major' only")
    L = num_experts // num_ranks
    if (layout == SOURCE_SLOTS and capacity is not None
            and _static_int("capacity", capacity) != num_ranks * T):
        raise ValueError(
            f"layout='source_slots' has exactly num_ranks * num_tokens = {num_ranks * T} rows; "
            f"capacity must be {num_ranks * T} (or None), got {capacity}")
    if capacity is None:
        capacity = default_capacity(T, num_ranks, K, L, layout, expert_alignment)
    if _static_int("capacity", capacity) < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    tuning = _check_config(config)
    node_size = axis_node_size(axis_name, num_ranks)
    if node_size is not None and layout == SOURCE_SLOTS:
        raise ValueError("layout='source_slots' needs the expert-parallel axis inside a node "
                         "(its rows move whole, by copy engines); across nodes use "
                         "'rank_major' or 'expert_major'")
    config = DispatchConfig(
        num_experts=int(num_experts), num_ranks=num_ranks, num_tokens=T, hidden=H, num_topk=K,
        capacity=int(capacity), layout=layout, alignment=int(expert_alignment),
        axis_name=axis_name, backend=_resolve_backend(backend), tuning=tuning,
        node_size=node_size, use_fp8=bool(use_fp8), ue8m0=bool(ue8m0))
    out = _dispatch(config, data, scales, topk_idx, topk_weights.astype(jnp.float32))
    return out._replace(num_invalid=_num_invalid(raw_idx, num_experts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(config, x, x_scales, topk_idx, topk_weights):
    backend = _backend_module(config.backend)
    return _on_stream(config, functools.partial(backend.dispatch, config=config))(
        x, x_scales, topk_idx, topk_weights)


def _dispatch_fwd(config, x, x_scales, topk_idx, topk_weights):
    out = _dispatch(config, x, x_scales, topk_idx, topk_weights)
    return out, (out.handle, out.topk_idx)


def _dispatch_bwd(config, residuals, g):
    handle, recv_topk_idx = residuals
    combine = _on_stream(config, _backend_module(config.backend).combine)
    # d x: every received row's gradient summed back onto its token (a combine).
    if g.x.dtype == jnp.float8_e4m3fn:
        dx = None  # quantised input: no gradient flows to FP8 data or its scales
    else:
        dx = combine(g.x, None, handle)
    # d topk_weights: one received entry per (token, k); route it back with a combine of
    # float32 columns (all other contributions are exactly zero).
    g_w = g.topk_weights.astype(jnp.float32)
    if config.layout == EXPERT_MAJOR:
        columns = jnp.arange(config.num_topk)[None, :] == handle.src_k[:, None]
        g_rows = jnp.where(columns, g_w[:, None], 0.0)
    else:
        g_rows = jnp.where(recv_topk_idx >= 0, g_w, 0.0)
    d_weights = combine(g_rows, None, handle)
    return dx, None, None, d_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ----------------------------------------------------------------------------- combine

def combine(y, handle: DispatchHandle, weights=None, config=None):
    """Sum the expert outputs of each token back on its source rank, in source order.

    Args:
      y: [C, H] rows laid out as ``dispatch`` returned them (bfloat16/float16/float32).
      handle: the ``handle`` of that dispatch.
      weights: optional [C] per-row weights (e.g. ``out.topk_weights`` of an expert_major
        dispatch); rows are summed unweighted when omitted.
      config: a ``jax_ep.Config`` for this combine and its backward (default: the one the
        dispatch was given).

    Returns [T, H] in y's dtype: ``sum_rows w * y`` accumulated in float32 in the contract's
    fixed order (ranks ascending for rank_major and source_slots, k ascending for
    expert_major).
    """
    _check_not_in_work_call("combine")
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle of a dispatch, got {type(handle)}")
    if config is not None:
        handle = dataclasses.replace(
            handle, config=dataclasses.replace(handle.config, tuning=_check_config(config)))
    config = handle.config
    C = config.capacity
    if y.ndim != 2 or y.shape[0] != C:
        raise ValueError(f"y must be [capacity={C}, hidden], got shape {y.shape}")
    if y.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"y must be bfloat16, float16 or float32, got {y.dtype}")
    if weights is not None:
        if weights.shape != (C,):
            raise ValueError(f"weights must be [capacity={C}], got shape {weights.shape}")
        weights = weights.astype(jnp.float32)
    return _combine(y, weights, handle)


@jax.custom_vjp
def _combine(y, weights, handle):
    combine = _backend_module(handle.config.backend).combine
    return _on_stream(handle.config, combine)(y, weights, handle)


def _combine_fwd(y, weights, handle):
    return _combine(y, weights, handle), (y, weights, handle)


def _combine_bwd(residuals, g):
    y, weights, handle = residuals
    # Each row's gradient is its token's output gradient (a dispatch along the same handle),
    # times the row's weight; the weight's is that gradient's dot product with the row.
    backward = _backend_module(handle.config.backend).combine_backward
    dy, d_weights = _on_stream(handle.config, backward)(
        g.astype(y.dtype), y, weights, handle)
    return dy, d_weights, None


_combine.defvjp(_combine_fwd, _combine_bwd)
