"""GPU suite: the CUDA backend against the reference backend on the same inputs.

Run on every GPU of a host, one process per GPU (the README's GPU test command):

    python -m jax_ep.launch -n 2 -m pytest -q tests/test_gpu.py

Data movement must be bit-identical; combine sums must match to float32 rounding (the same
order; XLA may fuse the reference's multiply-add differently). Without GPUs, or when not
started by the launcher, every test here is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

LAUNCHED = "JAX_EP_RANK" in os.environ


def _gpu_reason():
    if not LAUNCHED:
        return ("GPU suite: start it with "
                "`python -m jax_ep.launch -n <gpus> -m pytest tests/test_gpu.py`")
    try:
        if jax.default_backend() != "gpu":
            return "GPU suite: JAX has no GPU backend here"
    except RuntimeError as e:
        return f"GPU suite: {e}"
    from jax_ep import _native

    module, why = _native.load()
    return None if module is not None else f"GPU suite: {why}"


if LAUNCHED:
    from jax_ep import launch

    launch.init_distributed()
_skip = _gpu_reason()
pytestmark = pytest.mark.skipif(_skip is not None, reason=_skip or "")

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402

import oracle  # noqa: E402
from ep import AXIS, SHARED_GPUS, run  # noqa: E402
from test_reference import make_inputs  # noqa: E402

# A test whose CUDA program holds XLA collectives of its own (psum, pmean: NCCL) cannot run
# where ranks share a GPU (`jax_ep.launch --gpus`): NCCL refuses two ranks on one device.
needs_nccl = pytest.mark.skipif(
    SHARED_GPUS, reason="the program holds XLA collectives (NCCL), which refuse two ranks on "
    "one GPU (jax_ep.launch --gpus): run it with a GPU per rank")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    if _skip is not None:
        yield
        return
    from jax_ep import runtime as rt

    R = jax.device_count()
    E = LL_E_PER_RANK * R
    ll_bytes = max(2 * jax_ep.low_latency_buffer_size_hint(LL_M, LL_H, E, LL_K, R, jnp.float32),
                   jax_ep.low_latency_buffer_size_hint(LL_WIDE_M, LL_WIDE_H, E, LL_K, R),
                   int(os.environ.get("JAX_EP_LL_BUFFER_BYTES", 0)))
    rt.initialize(int(os.environ.get("JAX_EP_BUFFER_BYTES", 1 << 30)), low_latency_bytes=ll_bytes)
    yield
    rt.finalize()


# Largest low-latency shapes of this suite (the low-latency buffer is sized for them).
LL_M, LL_H, LL_E_PER_RANK, LL_K = 64, 512, 8, 8
LL_WIDE_M, LL_WIDE_H = 48, 7168  # test_low_latency_wide_rows_match_reference (bf16)


def num_ranks():
    return jax.device_count()


def both(fn, *args, axis_type="Auto"):
    """Run fn(backend, *per_rank_args) with the CUDA and the reference backend (the CUDA one on
    a mesh whose axis is of `axis_type`)."""
    R = num_ranks()
    cuda = run(lambda *a: fn("cuda", *a), R, *args, axis_type=axis_type)
    # On shared GPUs the reference's collectives cannot use NCCL: it runs on this process's
    # host devices instead (conftest gives it R of them).
    ref_devices = jax.local_devices(backend="cpu")[:R] if SHARED_GPUS else None
    ref = run(lambda *a: fn("reference", *a), R, *args, devices=ref_devices)
    return cuda, ref


def assert_trees_equal(got, want, fp8_steps=False):
    """Bit for bit. fp8_steps: e4m3 codes may be one step apart in a few elements (two, or 1
    in 10^4), where one side was quantised by XLA:GPU's ops (see jax_ep.fp8)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == jnp.float8_e4m3fn:
            a, b = a.view(np.uint8), b.view(np.uint8)
            if fp8_steps and a.shape == b.shape and a.size:
                step = np.abs(a.astype(np.int32) - b.astype(np.int32))
                off = int(np.count_nonzero(step))
                assert step.max() <= 1 and off <= max(2, a.size // 10_000), (step.max(), off)
                continue
        np.testing.assert_array_equal(a, b)


def assert_sums_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    assert np.mean(got == want) > 0.99, "combine differs from the reference beyond rounding"


@pytest.mark.parametrize("T, per_rank, K", [
    (300, 12, 6),     # one block
    (5000, 12, 6),    # a cluster of several blocks
    (4100, 32, 8),    # top-8, a warp past the tokens' end
    (1000, 12, 9),    # top-9
    (20000, 4, 6),    # the largest cluster, each thread several tokens
    (700, 8192, 6),   # counts past 48 KB of shared memory
])
def test_layout_matches_reference(T, per_rank, K):
    R = num_ranks()
    E = per_rank * R
    _, idx, _ = make_inputs(np.random.default_rng(T), R, T, 8, K, E, "random", 0.2)
    idx[:, ::7, 0] = E + 3  # out of range: no expert, as -1

    def fn(backend, idx):
        return jax_ep.get_dispatch_layout(idx, E, axis_name=AXIS, backend=backend)

    assert_trees_equal(*both(fn, idx))


def test_layouts_between_fusions_match_reference():
    # The layout target is command-buffer compatible: XLA may record these calls and the
    # fusions between them into one CUDA graph (launched without programmatic serialization)
    R = num_ranks()
    E = 16 * R
    _, idx, _ = make_inputs(np.random.default_rng(5), R, 4096, 8, 8, E, "random", 0.1)

    def fn(backend, idx):
        outs = []
        for shift in range(6):
            moved = jnp.where(idx >= 0, (idx + shift * 3) % E, idx)  # a fusion before each
            outs.append(jax_ep.get_dispatch_layout(moved, E, axis_name=AXIS, backend=backend))
        return outs

    assert_trees_equal(*both(fn, idx))


CASES = [
    # T, H, K, experts per rank, routing, mask, dtype, capacity factor
    (64, 256, 4, 3, "random", 0.0, jnp.bfloat16, None),
    (96, 129, 8, 4, "random", 0.25, jnp.bfloat16, None),  # odd hidden: unaligned rows
    (50, 72, 2, 5, "random", 0.1, jnp.float32, None),
    (64, 256, 3, 4, "one_expert", 0.0, jnp.bfloat16, None),
    (128, 512, 8, 8, "random", 0.0, jnp.bfloat16, 0.5),  # capacity overflow
    (64, 256, 3, 4, "one_expert", 0.0, jnp.bfloat16, 0.3),  # one expert, overflow
    (40, 1, 2, 2, "random", 0.2, jnp.float32, None),  # one column: scalar paths only
    (37, 3, 4, 3, "random", 0.1, jnp.float32, 0.5),  # tiny odd rows, overflow
    (48, 24, 2, 2, "random", 0.0, jnp.float16, None),
]


@pytest.fixture(params=["pull", "fused", "copy"])
def dispatch_mode(request, monkeypatch):
    """JAX_EP_DISPATCH and the combine it comes with (rank_major): "pull" with the pull combine,
    "fused" with the default one (push), "copy" with the copy engines'."""
    monkeypatch.setenv("JAX_EP_DISPATCH", request.param)
    monkeypatch.setenv("JAX_EP_COMBINE", {"fused": "push"}.get(request.param, request.param))
    return request.param


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("T,H,K,per_rank,kind,mask,dtype,cap", CASES)
def test_dispatch_combine_match_reference(T, H, K, per_rank, kind, mask, dtype, cap, layout,
                                          dispatch_mode):
    R = num_ranks()
    E = per_rank * R
    rng = np.random.default_rng(T * 31 + H + K)
    x, idx, w = make_inputs(rng, R, T, H, K, E, kind, mask)
    x = np.asarray(jnp.asarray(x, dtype))
    pairs = K if layout == "expert_major" else 1
    capacity = None if cap is None else max(1, int(cap * T * pairs))
    alignment = 4 if layout == "expert_major" else 1
    C = capacity or jax_ep.default_capacity(T, R, K, per_rank, layout, alignment)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, C, H)), dtype))
    row_w = rng.random((R, C)).astype(np.float32)
    g = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), dtype))

    out = _check_dispatch_combine(x, idx, w, y, row_w, g, dtype, num_experts=E,
                                  capacity=capacity, layout=layout, expert_alignment=alignment)
    if cap is not None:
        assert np.asarray(out.num_dropped).sum() > 0


def _check_dispatch_combine(x, idx, w, y, row_w, g, dtype, **dispatch_args):
    """Dispatch, combine (weighted and plain), the cached dispatch of combine's backward and
    the weighted backward itself against the reference; returns the CUDA dispatch's output."""
    def fn(backend, x, idx, w, y, row_w, g):
        out = jax_ep.dispatch(x, idx, w, axis_name=AXIS, backend=backend, **dispatch_args)
        back = jax_ep.combine(y, out.handle, weights=row_w)
        plain = jax_ep.combine(out.x, out.handle)
        module = jax_ep.api._backend_module(backend)
        rows = module.cached_dispatch(g, out.handle)
        dy, d_weights = module.combine_backward(g, y, row_w, out.handle)
        return out, back, plain, rows, dy, d_weights

    (out, back, plain, rows, dy, dw), (out_r, back_r, plain_r, rows_r, dy_r, dw_r) = both(
        fn, x, idx, w, y, row_w, g)
    assert_trees_equal(out, out_r)
    assert_trees_equal(rows, rows_r)
    assert_trees_equal(dy, dy_r)  # w * g rounded once: exact
    # <g, y> per row in float32: the summation order differs
    np.testing.assert_allclose(dw, dw_r, rtol=1e-4, atol=1e-3 * np.sqrt(y.shape[-1]))
    assert_sums_close(back, back_r, dtype)
    assert_sums_close(plain, plain_r, dtype)
    return out


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_out_of_range_expert_ids_are_ignored(layout, dispatch_mode):
    """Under jit the ids cannot be validated: the kernels must treat them as -1, as the
    reference does, and never address memory with them."""
    R = num_ranks()
    T, H, K, E = 48, 136, 4, 3 * R
    rng = np.random.default_rng(11)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.1)
    junk = rng.choice(np.array([-7, -2, E, E + 1, 1 << 20, -(1 << 20)], np.int32), idx.shape)
    idx = np.where(rng.random(idx.shape) < 0.3, junk, idx).astype(np.int32)
    y = rng.standard_normal((R, R * T * K, H)).astype(np.float32)

    def fn(backend, x, idx, w, y):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout=layout,
                              backend=backend)
        return out, jax_ep.combine(y[:out.x.shape[0]], out.handle, weights=out.topk_weights
                                   if layout == "expert_major" else None)

    (out, back), (out_r, back_r) = both(fn, x, idx, w, y)
    assert_trees_equal(out, out_r)
    assert_sums_close(back, back_r, jnp.float32)


def test_too_small_buffer_is_an_error_naming_the_bytes():
    """A call that needs more symmetric memory than the runtime has fails before any kernel
    runs (on every rank alike, so later calls still work), saying how much it needs; the
    hint covers it."""
    import re

    from jax_ep import _cuda
    from jax_ep import runtime as rt
    from jax_ep._types import DispatchConfig, DispatchHandle

    R, have = num_ranks(), rt.buffer_bytes()
    H, C = 4096, 8
    T = have // (4 * H) + 64  # cached dispatch stages T float32 rows: more than the buffer
    config = DispatchConfig(num_experts=R, num_ranks=R, num_tokens=T, hidden=H, num_topk=1,
                            capacity=C, axis_name=AXIS, backend="cuda")

    def fn(unused):
        handle = DispatchHandle(topk_idx=jnp.zeros((T, 1), jnp.int32),
                                send_slot=jnp.full((T, R), -1, jnp.int32), src_rank=unused,
                                src_token=unused, src_k=unused, num_received=jnp.int32(0),
                                pair_row=jnp.full((1,), -1, jnp.int32), config=config)
        return _cuda.cached_dispatch(jnp.zeros((T, H), jnp.float32), handle)

    with pytest.raises(Exception, match="needs a symmetric buffer of") as info:
        run(fn, R, np.full((R, C), -1, np.int32))
    needed = int(re.search(r"buffer of (\d+) bytes", str(info.value)).group(1))
    assert have < needed <= _cuda.buffer_size_hint(T, H, 1, R, R, capacity=C, dtype=jnp.float32)
    test_layout_matches_reference(300, 12, 6)  # the runtime still works


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_fp8_dispatch_matches_reference(layout, dispatch_mode):
    R = num_ranks()
    T, H, K, E = 80, 512, 4, 4 * R
    x, idx, w = make_inputs(np.random.default_rng(9), R, T, H, K, E, "random", 0.1)
    data, scales = oracle.quantize_fp8(x)  # the same pair on both sides

    def fn(backend, data, scales, idx, w):
        return jax_ep.dispatch((data, scales), idx, w, num_experts=E, axis_name=AXIS,
                               layout=layout, backend=backend)

    assert_trees_equal(*both(fn, data, scales, idx, w))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_fp8_kernel_matches_reference(dtype, ue8m0):
    """jax_ep.quantize_fp8's CUDA kernel bit for bit against the stated arithmetic (the NumPy
    oracle, each float32 step correctly rounded), plain and under jax.vmap: DeepSeek-V3's
    hidden size and one block of 128, rows from 1e-4 to 1e3 in scale, an all-zero block, rows
    of a single channel. XLA's ops (the reference backend) on the same rows: the same scales,
    codes at most one e4m3 step off in a handful of elements."""
    R = num_ranks()
    rng = np.random.default_rng(31)
    for T, H in ((37, 7168), (3, 128)):
        x = rng.standard_normal((R, T, H)) * 10.0 ** rng.uniform(-4, 3, (R, T, 1))
        x[:, 0, :128] = 0.0
        x[:, -1, :] = 0.0
        x[:, -1, H // 2] = -3.0
        x = np.asarray(jnp.asarray(x, dtype))
        pairs = np.stack([x, np.asarray(jnp.asarray(-2.0 * x.astype(np.float32), dtype))], 1)

        def fn(backend, x, pairs):
            return (jax_ep.quantize_fp8(x, ue8m0=ue8m0, backend=backend),
                    jax.vmap(lambda x: jax_ep.quantize_fp8(x, ue8m0=ue8m0, backend=backend))(
                        pairs))  # batched: one more leading dimension

        cuda, ref = both(fn, x, pairs)
        want = (oracle.quantize_fp8(x, ue8m0), oracle.quantize_fp8(pairs, ue8m0))
        assert_trees_equal(cuda, want)
        assert_trees_equal(ref, want, fp8_steps=True)


@pytest.mark.parametrize("layout,dtype,H", [
    ("rank_major", jnp.bfloat16, 7168), ("rank_major", jnp.float32, 512),
    ("expert_major", jnp.bfloat16, 512), ("source_slots", jnp.bfloat16, 7168)])
def test_dispatch_use_fp8_matches_reference(layout, dtype, H, dispatch_mode):
    """dispatch(x, use_fp8=True): the rows quantised on the way (rank_major's lean push) or
    by the quantize kernel first (every other path), bit for bit against the reference
    dispatching the oracle's quantised pair; DeepSeek-V3's 7168 channels span two work
    items."""
    R = num_ranks()
    T, K, E = 64, 4, 4 * R
    x, idx, w = make_inputs(np.random.default_rng(H + 7), R, T, H, K, E, "random", 0.1)
    x = np.asarray(jnp.asarray(x * 30.0, dtype))
    data, scales = oracle.quantize_fp8(x)

    def fn(backend, x, data, scales, idx, w):
        if backend == "cuda":
            return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout=layout,
                                   use_fp8=True, backend=backend)
        return jax_ep.dispatch((data, scales), idx, w, num_experts=E, axis_name=AXIS,
                               layout=layout, backend=backend)

    assert_trees_equal(*both(fn, x, data, scales, idx, w))


def test_quantize_fp8_kernel_gradient_is_the_reference():
    """The kernel's VJP is that of XLA's ops at the same x, for given cotangents of the data
    and the scales, to a few ulps: the two programs are compiled apart, and XLA may fuse (and
    contract multiply-adds) differently in each (2 ulps seen on one H200 shared by two
    ranks). Each block's largest element is left out: there x / scale is 448 up to the last
    bit of the reciprocal, on clip's boundary, where the gradient of XLA's ops itself turns on
    that bit."""
    R = num_ranks()
    rng = np.random.default_rng(32)
    x = rng.standard_normal((R, 16, 256)).astype(np.float32)
    g_data = np.asarray(jnp.asarray(rng.standard_normal((R, 16, 256)), jnp.float8_e4m3fn))
    g_scales = rng.standard_normal((R, 16, 2)).astype(np.float32)

    def fn(backend, x, g_data, g_scales):
        _, vjp = jax.vjp(lambda x: jax_ep.quantize_fp8(x, backend=backend), x)
        return vjp((g_data, g_scales))[0]

    got, want = both(fn, x, g_data, g_scales)
    blocks = np.abs(x).reshape(R, 16, 2, 128)
    interior = (blocks < blocks.max(-1, keepdims=True)).reshape(x.shape)
    np.testing.assert_array_max_ulp(np.asarray(got)[interior], np.asarray(want)[interior], 4)


@pytest.mark.parametrize("H,fp8", [(7168, False), (7168, True), (2100, False)])
def test_wide_rows_match_reference(H, fp8):
    """Rows wider than one work item of the SM pushes (kPieceBytes, 4 KB): DeepSeek-V3's
    14 KB BF16 rows (four pieces, the last 2 KB), its 7 KB FP8 rows (two, the scales with the
    first) and 4200-byte rows (two, not 16-byte aligned), at the default dispatch."""
    R = num_ranks()
    T, K, E = 64, 8, 4 * R
    rng = np.random.default_rng(H + fp8)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.05)
    if fp8:
        def fn(backend, data, scales, idx, w):
            return jax_ep.dispatch((data, scales), idx, w, num_experts=E, axis_name=AXIS,
                                   backend=backend)

        assert_trees_equal(*both(fn, *oracle.quantize_fp8(x), idx, w))  # one pair for both
        return
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    C = jax_ep.default_capacity(T, R, K, 4, "rank_major", 1)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, C, H)), jnp.bfloat16))
    row_w = rng.random((R, C)).astype(np.float32)
    g = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16))
    _check_dispatch_combine(x, idx, w, y, row_w, g, jnp.bfloat16, num_experts=E)


@pytest.mark.parametrize("fp8", [False, True])
def test_copy_dispatch_in_many_chunks_matches_reference(fp8, monkeypatch):
    """The copy-engine paths with ~40 transfers per peer, the last one partial, in one cached
    CUDA graph per call."""
    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    monkeypatch.setenv("JAX_EP_COMBINE", "copy")
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "0.05")
    R = num_ranks()
    T, H, K, E = 1000, 1024, 6, 8 * R
    x, idx, w = make_inputs(np.random.default_rng(21), R, T, H, K, E, "random", 0.1)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    data, scales = oracle.quantize_fp8(x)  # FP8: the same pair on both sides

    def fn(backend, x, data, scales, idx, w):
        xin = (data, scales) if fp8 else x
        out = jax_ep.dispatch(xin, idx, w, num_experts=E, axis_name=AXIS, backend=backend)
        return out, jax_ep.combine(out.x.astype(jnp.float32), out.handle)

    (out, back), (out_r, back_r) = both(fn, x, data, scales, idx, w)
    assert_trees_equal(out, out_r)
    assert_sums_close(back, back_r, jnp.float32)


def test_copy_paths_follow_changing_inputs(monkeypatch):
    """The cached copy graphs with new source addresses: several inputs of one shape, more
    than a shape keeps graphs for, so that later calls update a graph in place."""
    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    monkeypatch.setenv("JAX_EP_COMBINE", "copy")
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "0.1")
    R = num_ranks()
    T, H, K, E = 256, 512, 4, 4 * R

    def fn(backend, x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend=backend)
        return out, jax_ep.combine(out.x.astype(jnp.float32), out.handle)

    for seed in range(7):
        x, idx, w = make_inputs(np.random.default_rng(100 + seed), R, T, H, K, E, "random", 0.1)
        x = np.asarray(jnp.asarray(x, jnp.bfloat16))
        (out, back), (out_r, back_r) = both(fn, x, idx, w)
        assert_trees_equal(out, out_r)
        assert_sums_close(back, back_r, jnp.float32)


@pytest.fixture(params=["copy", "pull"])
def slots_combine(request, monkeypatch):
    """JAX_EP_COMBINE for the source_slots layout (its default is copy: y's blocks unstaged)."""
    monkeypatch.setenv("JAX_EP_COMBINE", request.param)
    return request.param


@pytest.fixture(params=["copy", "fused"])
def slots_dispatch(request, monkeypatch):
    """JAX_EP_DISPATCH for the source_slots layout: its copy engines (the default), or the SMs
    storing every row at its place in each destination (in place with the XLA windows)."""
    monkeypatch.setenv("JAX_EP_DISPATCH", request.param)
    return request.param


@pytest.mark.parametrize("T,H,K,per_rank,kind,mask,dtype", [
    c[:7] for c in CASES if c[7] is None] + [(200, 7168 // 8, 8, 8, "random", 0.05, jnp.bfloat16)])
def test_source_slots_match_reference(T, H, K, per_rank, kind, mask, dtype, slots_combine,
                                      slots_dispatch):
    """source_slots: the rows of every (source, token) in their fixed place, moved by the copy
    engines or by the SMs; combine through both data paths."""
    R = num_ranks()
    E = per_rank * R
    rng = np.random.default_rng(T * 17 + H + K)
    x, idx, w = make_inputs(rng, R, T, H, K, E, kind, mask)
    x = np.asarray(jnp.asarray(x, dtype))
    y = np.asarray(jnp.asarray(rng.standard_normal((R, R * T, H)), dtype))
    row_w = rng.random((R, R * T)).astype(np.float32)
    g = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), dtype))

    _check_dispatch_combine(x, idx, w, y, row_w, g, dtype, num_experts=E, layout="source_slots")


@pytest.mark.parametrize("fp8,junk", [(False, False), (True, True), (True, False),
                                      (False, True)])
def test_source_slots_in_many_chunks(fp8, junk, slots_combine, monkeypatch):
    """source_slots with ~40 transfers per peer (the last partial), FP8 rows with their scales,
    out-of-range ids (treated as -1), and repeated calls of one program."""
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "0.05")
    R = num_ranks()
    T, H, K, E = 1000, 1024, 6, 8 * R
    rng = np.random.default_rng(23)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.1)
    if junk:
        bad = rng.choice(np.array([-7, -2, E, E + 1, 1 << 20], np.int32), idx.shape)
        idx = np.where(rng.random(idx.shape) < 0.2, bad, idx).astype(np.int32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    # row weights from the host: a sum over out.topk_weights would be reduced in another
    # order by the reference's host devices (shared GPUs) than on the GPU
    row_w = rng.random((R, R * T)).astype(np.float32)

    data, scales = oracle.quantize_fp8(x)  # FP8: the same pair on both sides

    def fn(backend, x, data, scales, idx, w, row_w):
        xin = (data, scales) if fp8 else x
        out = jax_ep.dispatch(xin, idx, w, num_experts=E, axis_name=AXIS, layout="source_slots",
                              backend=backend)
        rows = jnp.asarray(out.x, jnp.float32)
        return out, jax_ep.combine(rows, out.handle, weights=row_w)

    (out, back), (out_r, back_r) = both(fn, x, data, scales, idx, w, row_w)
    assert_trees_equal(out, out_r)
    assert_sums_close(back, back_r, jnp.float32)
    assert int(np.asarray(out.num_received).min()) > 0

    def again(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout="source_slots",
                              backend="cuda")
        return out.x, jax_ep.combine(out.x, out.handle)

    _assert_repeats_identical(again, R, (x, idx, w), 20)


def _assert_repeats_identical(fn, R, arrays, repeats):
    """Runs the per-rank fn(*arrays) `repeats` times as one compiled program and asserts every
    result is bit-identical to the first."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ep import fetch, mesh, put

    m = mesh(R)
    f = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda v: v[None], fn(*[v[0] for v in a])),
                              mesh=m, in_specs=(P(AXIS),) * len(arrays), out_specs=P(AXIS)))
    sh = NamedSharding(m, P(AXIS))
    args = [put(a, sh) for a in arrays]
    first = jax.tree.map(fetch, f(*args))
    outs = [f(*args) for _ in range(repeats)]
    for o in outs:
        assert_trees_equal(jax.tree.map(fetch, o), first)


def test_repeated_calls_are_bit_identical(dispatch_mode):
    R = num_ranks()
    T, H, K, E = 128, 384, 8, 8 * R
    rng = np.random.default_rng(1)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.05)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))

    def fn(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend="cuda")
        return out.x, jax_ep.combine(out.x, out.handle)

    _assert_repeats_identical(fn, R, (x, idx, w), 100)


def stream_case(seed):
    """(E, x, idx, w, m) of the stream tests: rows of two pieces (1792 BF16 channels), and an
    independent [H, 256] matmul's weight per rank; skips where jax has no stream calls."""
    if not jax_ep.api.stream_calls_supported():
        pytest.skip(f"jax {jax.__version__} has no functional compute_on (stream calls)")
    R = num_ranks()
    T, H, K, E = 64, 1792, 8, 8 * R
    rng = np.random.default_rng(seed)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.05)
    m = rng.standard_normal((R, H, 256)).astype(np.float32) / np.sqrt(H)
    return E, x, idx, w, m


def test_calls_on_a_second_stream_match_reference():
    """Config(stream=1): two dispatches with nothing between them (one stream keeps them
    apart), a matmul beside them on the main stream, their combines and the backward of all,
    against the reference; rows of two pieces."""
    E, x, idx, w, m = stream_case(11)
    side = jax_ep.Config(stream=1)

    def fn(backend, x, idx, w, m):
        def loss(x, w):
            kw = dict(num_experts=E, axis_name=AXIS, backend=backend, config=side)
            a = jax_ep.dispatch(x, idx, w, **kw)
            b = jax_ep.dispatch(jnp.sin(x), idx[:, ::-1], w, **kw)
            beside = jnp.dot(x, m)
            ya = jax_ep.combine(jnp.tanh(a.x) * jnp.sum(a.topk_weights, 1)[:, None], a.handle)
            yb = jax_ep.combine(b.x * 2, b.handle)
            return jnp.sum(ya * yb) + jnp.sum(jnp.cos(beside))

        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    with jax.default_matmul_precision("float32"):
        got, want = both(fn, x, idx, w, m)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@needs_nccl
def test_work_on_a_second_stream_beside_the_calls_matches_reference():
    """jax_ep.on_stream: matmuls (and their backward) on XLA's stream 1 beside a dispatch and
    a combine on the program's stream, one with a weight the same on every rank (a shared
    expert's: its gradient's sum over the ranks stays out of the stream call); values and
    gradients against the reference."""
    E, x, idx, w, m = stream_case(12)

    def fn(backend, x, idx, w, m):
        def loss(x, w, m):
            out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend=backend)
            shared = jax.lax.pmean(m, AXIS)  # the same on every rank
            beside = jax_ep.on_stream(
                lambda a, b, c: jnp.cos(jnp.dot(a, b)) + jnp.sin(jnp.dot(a, c)))(x, m, shared)
            y = jax_ep.combine(jnp.tanh(out.x) * jnp.sum(out.topk_weights, 1)[:, None],
                               out.handle)
            return jnp.sum(y * y) + jnp.sum(beside)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, m)

    with jax.default_matmul_precision("float32"):
        got, want = both(fn, x, idx, w, m)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@needs_nccl
def test_work_on_a_stream_differentiated_outside_shard_map():
    """jax_ep.on_stream's work in a loss differentiated from outside shard_map (jax.grad of a
    shard_map'd loss, as a training step is usually written): the work's forward and backward
    land in two manual computations, the backward taking the forward's float32 residuals; a
    shared (replicated) weight among its inputs. Against the reference."""
    from functools import partial

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ep import fetch, mesh, put

    E, x, idx, w, m = stream_case(13)
    R = num_ranks()
    s = np.asarray(m[0][:, :64])  # the same on every rank

    def shared_ffn(a, b):  # float32 residuals, as a SwiGLU's
        h = jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)
        return (jax.nn.silu(h) * h).astype(a.dtype)

    def grads(backend, devices):
        ep_mesh = mesh(R, devices)

        @partial(jax.shard_map, mesh=ep_mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
                 out_specs=P())
        def loss(x, idx, w, s):
            x, idx, w = x[0], idx[0], w[0]
            out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend=backend)
            beside = jax_ep.on_stream(shared_ffn)(x, s)
            y = jax_ep.combine(jnp.tanh(out.x) * jnp.sum(out.topk_weights, 1)[:, None],
                               out.handle)
            total = jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(beside.astype(jnp.float32))
            return jax.lax.psum(total, AXIS)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))
        split, whole = NamedSharding(ep_mesh, P(AXIS)), NamedSharding(ep_mesh, P())
        args = [put(a, split) for a in (x, idx, w)] + [put(s, whole)]
        return jax.tree.map(fetch, step(*args))

    ref_devices = jax.local_devices(backend="cpu")[:R] if SHARED_GPUS else None
    with jax.default_matmul_precision("float32"):
        got, want = grads("cuda", None), grads("reference", ref_devices)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


def moe_grads(**block):
    """fn(backend, x, router, w_in, w_out): the gradients of a loss of one moe_block (with
    `block`'s arguments) with respect to all four."""

    def fn(backend, x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            out, _ = moe.moe_block(x, router, w_in, w_out, backend=backend, **block)
            return jnp.sum(jnp.sin(out))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w_in, w_out)

    return fn


@pytest.mark.parametrize("layout,copy", [("expert_major", False), ("rank_major", False),
                                         ("rank_major", True), ("source_slots", True),
                                         ("source_slots", False)])
def test_moe_gradients_match_reference(layout, copy, monkeypatch):
    if copy:  # both backward passes run through the copy-engine paths too
        monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
        monkeypatch.setenv("JAX_EP_COMBINE", "copy")
    elif layout == "source_slots":  # its dispatch always copies; the combine here by pull
        monkeypatch.setenv("JAX_EP_COMBINE", "pull")
    R = num_ranks()
    T, H, F, E, top_k = 32, 64, 48, 4 * R, 2
    key = jax.random.key(5)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    router = np.asarray(jax.random.normal(k1, (H, E)))
    w_in = np.asarray(jax.random.normal(k2, (E, H, F)) / np.sqrt(H))
    w_out = np.asarray(jax.random.normal(k3, (E, F, H)) / np.sqrt(F))
    x = np.asarray(jax.random.normal(k4, (R, T, H)))
    L = E // R
    w_in_r, w_out_r = w_in.reshape(R, L, H, F), w_out.reshape(R, L, F, H)
    router_r = np.broadcast_to(router, (R, H, E)).copy()

    fn = moe_grads(top_k=top_k, axis_name=AXIS, layout=layout)

    # Full float32 matmuls: the reference may run on the host (shared GPUs), where XLA never
    # uses TF32 as it may on the GPU.
    with jax.default_matmul_precision("float32"):
        got, want = both(fn, x, router_r, w_in_r, w_out_r)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="this jax has no explicit sharding")
def test_calls_on_explicit_mesh_axes_match_reference():
    """jax.make_mesh's default axis type (jax 0.7 on): the MoE block's gradients through the
    dispatch and combine kernels, and the low-latency round trip, on an Explicit mesh axis."""
    R = num_ranks()
    T, H, F, E, top_k = 32, 64, 48, 4 * R, 2
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    router = np.broadcast_to(np.asarray(jax.random.normal(k1, (H, E))), (R, H, E)).copy()
    w_in = np.asarray(jax.random.normal(k2, (E, H, F)) / np.sqrt(H)).reshape(R, E // R, H, F)
    w_out = np.asarray(jax.random.normal(k3, (E, F, H)) / np.sqrt(F)).reshape(R, E // R, F, H)
    x = np.asarray(jax.random.normal(k4, (R, T, H)))
    with jax.default_matmul_precision("float32"):
        got, want = both(moe_grads(top_k=top_k, axis_name=AXIS, layout="expert_major"),
                         x, router, w_in, w_out, axis_type="Explicit")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    M = 16
    x, idx, w, E = _ll_inputs(11, M, 256, "random", 0.1)
    y = np.asarray(jnp.asarray(np.random.default_rng(11).standard_normal(
        (R, E // R, R * M, 256)), jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        return ll_round_trip(x, idx, w, y, num_experts=E, max_tokens_per_rank=M, axis_name=AXIS,
                             use_fp8=True, backend=backend)

    assert_ll_round_trip(*both(fn, x, idx, w, y, axis_type="Explicit"))


# ----------------------------------------------------------------------------- low latency


def _ll_used(o, used):
    """Rows past recv_count have unspecified data on CUDA: compare the used ones only."""
    return o._replace(x=np.asarray(o.x)[used],
                      x_scales=None if o.x_scales is None else np.asarray(o.x_scales)[used])


def _ll_inputs(seed, T, H, kind, mask, junk=False, dtype=jnp.bfloat16):
    R = num_ranks()
    E, K = LL_E_PER_RANK * R, LL_K
    rng = np.random.default_rng(seed)
    x, idx, w = make_inputs(rng, R, T, H, K, E, kind, mask)
    if junk:  # out-of-range ids are treated as -1
        bad = rng.choice(np.array([-7, -2, E, E + 1, 1 << 20], np.int32), idx.shape)
        idx = np.where(rng.random(idx.shape) < 0.2, bad, idx).astype(np.int32)
    return np.asarray(jnp.asarray(x, dtype)), idx, w, E


def ll_round_trip(x, idx, w, y, **kw):
    """The fused and the split low-latency dispatch of x, and both combines of y."""
    out = jax_ep.low_latency_dispatch(x, idx, **kw)
    split = jax_ep.low_latency_dispatch_receive(jax_ep.low_latency_dispatch_send(x, idx, **kw))
    back = jax_ep.low_latency_combine(y, w, out.handle)
    back_split = jax_ep.low_latency_combine_receive(
        jax_ep.low_latency_combine_send(y, w, out.handle), out.handle)
    return out, split, back, back_split


def _ll_records_used(handle, M):
    """[R, R*M]: the records some packed row reads (a records dispatch's x rows that hold data)."""
    src_rank, src_token = np.asarray(handle.src_rank), np.asarray(handle.src_token)
    used = np.zeros((src_rank.shape[0], M * src_rank.shape[0]), bool)
    for r in range(src_rank.shape[0]):
        keep = src_rank[r] >= 0
        used[r, src_rank[r][keep] * M + src_token[r][keep]] = True
    return used


def assert_ll_round_trip(got, want):
    """ll_round_trip on CUDA against the reference: the used rows bit-equal, the sums close."""
    (out, split, back, back_split), (out_r, _, back_r, _) = got, want
    used = np.asarray(out_r.handle.src_rank) >= 0
    if out_r.handle.config.layout == "records":  # x's rows are records, the handle packed
        used = _ll_records_used(out_r.handle, out_r.handle.config.max_tokens_per_rank)
    assert_trees_equal(_ll_used(out, used), _ll_used(out_r, used), fp8_steps=True)
    assert_trees_equal(_ll_used(split, used), _ll_used(out_r, used), fp8_steps=True)
    assert_sums_close(back, back_r, jnp.bfloat16)
    assert_trees_equal(back_split, back)


@pytest.mark.parametrize("fp8", ["bf16", "fp8", "ue8m0"])
@pytest.mark.parametrize("kind,mask,T,M,junk", [
    ("random", 0.1, 64, 64, False),   # T == M
    ("one_expert", 0.0, 32, 48, False),  # every token to one expert
    ("random", 0.3, 20, 32, True),    # T < M, -1 masks and out-of-range ids
    ("random", 0.0, 1, 1, False),     # one token
])
def test_low_latency_matches_reference(kind, mask, T, M, junk, fp8):
    R = num_ranks()
    H = 256
    x, idx, w, E = _ll_inputs(T + M, T, H, kind, mask, junk)
    L = E // R
    rng = np.random.default_rng(T)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, L, R * M, H)), jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        return ll_round_trip(x, idx, w, y, num_experts=E, max_tokens_per_rank=M, axis_name=AXIS,
                             use_fp8=fp8 != "bf16", ue8m0=fp8 == "ue8m0", backend=backend)

    assert_ll_round_trip(*both(fn, x, idx, w, y))


@pytest.mark.parametrize("layout", ["expert_major", "records"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind,mask,T,M,H,junk,blocks", [
    ("random", 0.1, 64, 64, 256, False, None),     # T == M
    ("one_expert", 0.0, 32, 48, 256, False, None),  # every token to one expert
    ("random", 0.3, 20, 32, 256, True, 2),         # -1 masks, bad ids, few CTAs
    ("random", 0.1, LL_WIDE_M, LL_WIDE_M, LL_WIDE_H, False, None),  # DeepSeek-V3's rows
])
def test_low_latency_packed_layouts_match_reference(kind, mask, T, M, H, junk, blocks, fp8,
                                                    layout):
    """layout="expert_major": the used rows packed by local expert into R*M*min(K, L) rows;
    "records": each token with a pair here once (R*M rows), the handle packed alike; fused and
    split dispatch and combine against the reference (y's unused rows random)."""
    R = num_ranks()
    x, idx, w, E = _ll_inputs(T + M + 1, T, H, kind, mask, junk)
    P = R * M * min(LL_K, E // R)
    rng = np.random.default_rng(T + 1)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, P, H)), jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        return ll_round_trip(x, idx, w, y, num_experts=E, max_tokens_per_rank=M, axis_name=AXIS,
                             use_fp8=fp8, backend=backend, layout=layout,
                             config=blocks and jax_ep.Config(num_blocks=blocks))

    got, want = both(fn, x, idx, w, y)
    assert got[0].x.shape == (R, R * M if layout == "records" else P, H)
    assert_ll_round_trip(got, want)


@pytest.mark.parametrize("layout", ["expert_major", "records"])
def test_low_latency_packed_layouts_gradients_match_reference(layout):
    """The packed rows' backward passes: the combine's (a cached dispatch into packed rows)
    and the dispatch's (a combine of packed rows; records: each record's cotangent on its
    first packed row). Records reach the combine through the grouped GEMM's index."""
    from jax_ep import experts

    R = num_ranks()
    T, M, H = 16, 16, 128
    x, idx, w, E = _ll_inputs(4, T, H, "random", 0.1, dtype=np.float32)
    P = R * M * min(LL_K, E // R)
    scale = np.random.default_rng(3).standard_normal((R, P, 1)).astype(np.float32)

    def fn(backend, x, idx, w, scale):
        def loss(x, w):
            o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                            axis_name=AXIS, use_fp8=False, backend=backend,
                                            layout=layout)
            rows = (experts._gather_rows(o.x, o.handle.record_rows()) if layout == "records"
                    else o.x)
            return jnp.sum(jnp.sin(jax_ep.low_latency_combine(rows * scale, w, o.handle)))

        return jax.grad(loss, argnums=(0, 1))(x, w)

    got, want = both(fn, x, idx, w, scale)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("blocks", [2, 5])
def test_low_latency_on_few_ctas_matches_reference(blocks):
    """Few CTAs (a split call's case beside other work): each block sends many tokens (32 and
    13 of 64 here), a warp a token, and numbers a long range of pairs; fused and split, FP8."""
    T = M = LL_M
    x, idx, w, E = _ll_inputs(23, T, 256, "random", 0.1)
    L = E // num_ranks()
    rng = np.random.default_rng(blocks)
    y = np.asarray(jnp.asarray(rng.standard_normal((num_ranks(), L, num_ranks() * M, 256)),
                               jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        return ll_round_trip(x, idx, w, y, num_experts=E, max_tokens_per_rank=M, axis_name=AXIS,
                             use_fp8=True, backend=backend,
                             config=jax_ep.Config(num_blocks=blocks))

    assert_ll_round_trip(*both(fn, x, idx, w, y))


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_wide_rows_match_reference(fp8):
    """DeepSeek-V3's hidden size: the receive takes a record in several pieces of several
    16-byte loads per lane (rows of H = 256 are one piece of one load)."""
    T = M = LL_WIDE_M
    x, idx, w, E = _ll_inputs(11, T, LL_WIDE_H, "random", 0.1)

    def fn(backend, x, idx, w):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=fp8,
                  backend=backend)
        out = jax_ep.low_latency_dispatch(x, idx, **kw)
        split = jax_ep.low_latency_dispatch_receive(jax_ep.low_latency_dispatch_send(x, idx, **kw))
        # the received rows as expert outputs (FP8: the scaled values); unused rows differ
        # between the backends and must not count
        y = out.x.astype(jnp.bfloat16)
        return out, split, jax_ep.low_latency_combine(y, w, out.handle)

    (out, split, back), (out_r, split_r, back_r) = both(fn, x, idx, w)
    used = np.asarray(out_r.handle.src_rank) >= 0
    assert used.sum() > 0
    assert_trees_equal(_ll_used(out, used), _ll_used(out_r, used), fp8_steps=True)
    assert_trees_equal(_ll_used(split, used), _ll_used(out_r, used), fp8_steps=True)
    assert_sums_close(back, back_r, jnp.bfloat16)


def test_low_latency_split_repeated_matches_one_call():
    """Twelve split dispatches of wide rows in one program, each against the one-call dispatch
    of the same rows (both CUDA): a record read before all of it landed shows as a
    difference. Each round's rows wait for the round before's receive (between a send and its
    receive at most one other dispatch may start); within a round XLA orders the calls."""
    T = M = LL_WIDE_M
    x, idx, _, E = _ll_inputs(17, T, LL_WIDE_H, "random", 0.1)
    kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=False,
              backend="cuda")

    def fn(x, idx):
        outs, before = [], None
        for i in range(12):
            rows = x + jnp.asarray(i, x.dtype)  # new rows every round
            if before is not None:
                rows, _ = jax.lax.optimization_barrier((rows, before))
            one = jax_ep.low_latency_dispatch(rows, idx, **kw)
            split = jax_ep.low_latency_dispatch_receive(
                jax_ep.low_latency_dispatch_send(rows, idx, **kw))
            outs.append((one, split))
            before = jax.tree.leaves(split)[0]
        return outs

    for one, split in run(fn, num_ranks(), x, idx):
        used = np.asarray(one.handle.src_rank) >= 0
        assert used.sum() > 0
        assert_trees_equal(_ll_used(split, used), _ll_used(one, used))


def test_low_latency_wide_combines_repeated():
    """Twelve dispatch + combine rounds of wide rows in one program, the expert outputs new
    every round, each combine against the reference: a partial row summed before all of it
    landed (a piece of the round two calls before, in the same buffer half) shows as a
    difference. Each round's dispatch waits for the round before's combine."""
    T = M = LL_WIDE_M
    x, idx, w, E = _ll_inputs(19, T, LL_WIDE_H, "random", 0.1)
    # Powers of two scale every rounding exactly, so round i is round 0 times scale[i] on both
    # backends (other factors round differently in the two sums); no two rounds within two of
    # each other share a scale.
    scales = [(-1.0) ** i * 2.0 ** (i % 3) for i in range(12)]

    def fn(backend, x, idx, w):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=False,
                  backend=backend)
        backs = []
        for scale in scales:
            rows = x if not backs else jax.lax.optimization_barrier((x, backs[-1]))[0]
            out = jax_ep.low_latency_dispatch(rows, idx, **kw)
            # new expert outputs every round; unused rows differ between the backends and are
            # never read
            y = out.x * jnp.asarray(scale, out.x.dtype)
            backs.append(jax_ep.low_latency_combine(y, w, out.handle))
        return backs

    got, want = both(fn, x, idx, w)
    for scale, back, back_r in zip(scales, got, want):
        assert_sums_close(np.asarray(back, np.float32) / scale,
                          np.asarray(back_r, np.float32) / scale, jnp.bfloat16)


def test_low_latency_drops_duplicate_experts():
    """T == M and tokens listing an expert twice: slots >= M are dropped at the source."""
    R = num_ranks()
    T = M = 16
    H, K, E = 128, LL_K, LL_E_PER_RANK * R
    rng = np.random.default_rng(8)
    x = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16))
    others = np.delete(np.arange(E), 3)
    idx = np.stack([np.stack([rng.choice(others, K, replace=False) for _ in range(T)])
                    for _ in range(R)]).astype(np.int32)
    idx[:, :, 1] = idx[:, :, 0] = 3  # expert 3 twice in every token: 2T pairs, M kept
    w = rng.random((R, T, K)).astype(np.float32)

    def fn(backend, x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                          axis_name=AXIS, use_fp8=False, backend=backend)
        return out, jax_ep.low_latency_combine(out.x, w, out.handle)

    (out, back), (out_r, back_r) = both(fn, x, idx, w)
    used = np.asarray(out_r.handle.src_rank) >= 0
    assert_trees_equal(_ll_used(out, used), _ll_used(out_r, used), fp8_steps=True)
    assert np.asarray(out.num_dropped).tolist() == [T] * R
    assert_sums_close(back, back_r, jnp.bfloat16)


@pytest.mark.parametrize("H", [136, 129])  # 16-byte rows / odd rows: vector and scalar paths
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_low_latency_combine_dtypes_and_cached_dispatch(dtype, H):
    R = num_ranks()
    T, M = 24, 32
    x, idx, w, E = _ll_inputs(3, T, H, "random", 0.2, dtype=dtype)
    L = E // R
    rng = np.random.default_rng(4)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, L, R * M, H)), dtype))
    odd = rng.standard_normal((R, T, 3)).astype(np.float32)  # 12-byte rows: unaligned paths

    def fn(backend, x, idx, w, y, odd):
        out = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                          axis_name=AXIS, use_fp8=False, backend=backend)
        mod = jax_ep.api._backend_module(backend)
        return (out, jax_ep.low_latency_combine(y, w, out.handle),
                mod.low_latency_cached_dispatch(x, out.handle),
                mod.low_latency_cached_dispatch(odd, out.handle),
                mod.low_latency_cached_dispatch(w, out.handle))

    (out, back, rows, odd_rows, w_rows), (out_r, back_r, rows_r, odd_r, w_r) = both(
        fn, x, idx, w, y, odd)
    used = np.asarray(out_r.handle.src_rank) >= 0
    assert_trees_equal(_ll_used(out, used), _ll_used(out_r, used), fp8_steps=True)
    assert_sums_close(back, back_r, dtype)
    for got, want in ((rows, rows_r), (odd_rows, odd_r), (w_rows, w_r)):
        assert_trees_equal(np.asarray(got)[used], np.asarray(want)[used])


def _after(value, *deps):
    """value, unchanged, but computed after deps (low-latency outputs or arrays): XLA cannot
    prove the added term is zero."""
    flag = jnp.bool_(False)
    for d in deps:
        probe = d.recv_count[0] if hasattr(d, "recv_count") else d.ravel()[0]
        flag = flag | (probe == 123456789)
    return value + flag.astype(value.dtype)


def _ll_series(n, T=32, M=32, H=256):
    """Inputs of n low-latency calls, stacked per rank: xs, idxs, ws [R, n, ...], expert
    outputs ys [R, n, L, R*M, H], and E, M."""
    R = num_ranks()
    data = [_ll_inputs(100 + i, T, H, "random", 0.1) for i in range(n)]
    E = data[0][3]
    xs, idxs, ws = (np.stack([d[j] for d in data], 1) for j in range(3))
    rng = np.random.default_rng(7)
    ys = np.asarray(jnp.asarray(rng.standard_normal((R, n, E // R, R * M, H)), jnp.bfloat16))
    return xs, idxs, ws, ys, E, M


def _ll_chain(n, E, M, backend, xs, idxs, ws, ys):
    """n fused dispatch + combine calls, each after the previous one (XLA may reorder
    independent calls)."""
    kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
              backend=backend)
    outs, backs = [], []
    for i in range(n):
        o = jax_ep.low_latency_dispatch(xs[i], _after(idxs[i], *outs[-1:]), **kw)
        outs.append(o)
        backs.append(jax_ep.low_latency_combine(_after(ys[i], *backs[-1:]), ws[i], o.handle))
    return outs, backs, kw


def test_low_latency_headers_after_a_call_of_another_shape():
    """A dispatch reads no pair header older than itself, even where a call of another shape
    left bytes that show its number. Call a (BF16, M rows, every token to every rank) leaves
    records whose every 8-byte word is (n << 32) | 0: a header of call n naming expert 0,
    slot 0. Call n, two calls later (the same parity), has twice the max tokens, so its
    headers' section lies over those records, and masks every pair but k = 0; where a
    masked pair's header were stale it would read as expert 0's slot 0. Its handle and rows
    against the oracle."""
    from jax_ep import _native

    module = _native.load()[0]
    R = num_ranks()
    E, K = LL_E_PER_RANK * R, LL_K
    L = E // R
    M_a, H_a, M, T, H = 32, 1024, 64, 16, 128
    n = int(module.low_latency_calls()[0]) + 3  # after call a and one more
    words = np.full((R, M_a, H_a // 4), np.uint64(n) << np.uint64(32), np.uint64)
    x_a = words.view(np.uint16).view(jnp.bfloat16)
    # token t's k-th expert: on rank k % R, so every record goes to every rank
    ks = np.arange(K)
    idx_a = np.stack([np.stack([(ks % R) * L + (t + ks // R) % L for t in range(M_a)])
                      for _ in range(R)]).astype(np.int32)
    rng = np.random.default_rng(3)
    x = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16))
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0  # every token to expert 0 (rank 0), the other pairs masked

    def call(max_tokens):
        def fn(x, idx):
            o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=max_tokens,
                                            axis_name=AXIS, use_fp8=False, backend="cuda")
            return o.x, o.handle.recv_count, o.handle.src_rank, o.handle.src_token, \
                o.handle.src_k, o.handle.pair_row
        return fn

    jax.block_until_ready(run(call(M_a), R, x_a, idx_a))
    jax.block_until_ready(run(call(M), R, x, idx))
    got = run(call(M), R, x, idx)
    assert int(module.low_latency_calls()[0]) == n
    want, _ = oracle.low_latency_dispatch(x, idx, E, M)
    for i, name in enumerate(("x", "recv_count", "src_rank", "src_token", "src_k", "pair_row")):
        w = np.stack([o[name] for o in want])
        g = np.asarray(got[i])
        if name == "x":  # rows past recv_count are unspecified
            used = np.stack([o["src_rank"] for o in want]) >= 0
            g, w = g[used], w[used]
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_low_latency_combine_words_after_a_call_of_another_shape():
    """A combine reads no gate word or tag older than itself, even where a call of another
    shape left bytes that show its number. Combine a (BF16 rows of 8 KB, every token to every
    rank, one pair of weight 1 a rank) leaves partial rows whose every 8-byte word is
    (n << 32) | the bits of 2.0: a gate word of call n weighing 2, and two tags of which the
    second shows n. Combine n, two calls later (the same parity, words at the area's start),
    has 8 times the max tokens, so its gate words, tags and records lie over those rows, and
    sends every token to expert 0 only: a stale tag of a rank with no partial would add a
    stale row, a gate word read before its owner wrote it would weigh by 2. Its sums against
    the oracle."""
    from jax_ep import _native

    module = _native.load()[0]
    R = num_ranks()
    E, K = LL_E_PER_RANK * R, LL_K
    L = E // R
    M_a, H_a, M, T, H = 8, 4096, 64, 16, 128

    def call(max_tokens):
        def fn(x, idx, w, y):
            o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=max_tokens,
                                            axis_name=AXIS, use_fp8=False, backend="cuda")
            return jax_ep.low_latency_combine(y, w, o.handle)
        return fn

    rng = np.random.default_rng(5)
    x = np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16))
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0  # every token to expert 0 (rank 0), the other pairs masked
    w = rng.random((R, T, K)).astype(np.float32)
    y = np.asarray(jnp.asarray(rng.standard_normal((R, L, R * M, H)), jnp.bfloat16))
    if int(module.low_latency_calls()[1]) % 2 == 0:  # so that call a's number is even
        jax.block_until_ready(run(call(M), R, x, idx, w, y))
    n = int(module.low_latency_calls()[1]) + 3  # after call a and one more
    words = np.full((R, L, R * M_a, H_a // 4), (n << 32) | 0x40000000, np.uint64)
    y_a = words.view(np.uint16).view(jnp.bfloat16)
    ks = np.arange(K)
    # token t's k-th expert: on rank k % R, so every token has pairs at every rank
    idx_a = np.stack([np.stack([(ks % R) * L + (t + ks // R) % L for t in range(M_a)])
                      for _ in range(R)]).astype(np.int32)
    w_a = np.broadcast_to(np.where(ks < R, 1.0, 0.0), (R, M_a, K)).astype(np.float32)
    x_a = np.zeros((R, M_a, H_a), jnp.bfloat16)

    jax.block_until_ready(run(call(M_a), R, x_a, idx_a, w_a, y_a))
    jax.block_until_ready(run(call(M), R, x, idx, w, y))
    got = run(call(M), R, x, idx, w, y)
    assert int(module.low_latency_calls()[1]) == n
    assert_sums_close(got, oracle.low_latency_combine(y, w, idx, E, M), jnp.bfloat16)


def test_low_latency_consecutive_calls():
    """Six dispatch + combine calls with different data in one program (every buffer half
    reused several times)."""
    n = 6
    xs, idxs, ws, ys, E, M = _ll_series(n)

    def fn(backend, xs, idxs, ws, ys):
        return _ll_chain(n, E, M, backend, xs, idxs, ws, ys)[:2]

    got, want = both(fn, xs, idxs, ws, ys)
    for i in range(n):
        used = np.asarray(want[0][i].handle.src_rank) >= 0
        assert_trees_equal(_ll_used(got[0][i], used), _ll_used(want[0][i], used), fp8_steps=True)
        assert_sums_close(got[1][i], want[1][i], jnp.bfloat16)


def test_each_custom_call_runs_once_with_sliced_operands():
    """Operands sliced from stacked arrays and results written into bigger arrays: the pattern
    XLA:GPU's dynamic-slice fusion rewrites. It once copied our custom calls into fusions and
    kept the originals (side effects), so every kernel ran twice and two split sends in flight
    deadlocked. Counts each handler's executions in one program."""
    from jax_ep import _native

    module = _native.load()[0]
    R = num_ranks()
    n = 2
    xs, idxs, ws, ys, E, M = _ll_series(n)
    T = xs.shape[2]
    kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
              backend="cuda")

    def fn(xs, idxs, ws, ys):
        pa = jax_ep.low_latency_dispatch_send(xs[0], idxs[0], **kw)
        pb = jax_ep.low_latency_dispatch_send(xs[1], idxs[1], **kw)
        oa = jax_ep.low_latency_dispatch_receive(pa)
        ob = jax_ep.low_latency_dispatch_receive(pb)
        back = jax_ep.low_latency_combine(ys[0], ws[0], oa.handle)
        out = jax_ep.dispatch(xs[1], idxs[1], ws[1], num_experts=E, axis_name=AXIS,
                              capacity=R * T, backend="cuda")
        summed = jax_ep.combine(out.x, out.handle)
        stacked = jnp.zeros((2,) + oa.x_scales.shape, oa.x_scales.dtype)
        stacked = stacked.at[0].set(oa.x_scales).at[1].set(ob.x_scales)
        rows = jnp.zeros((3,) + summed.shape, summed.dtype).at[1].set(summed).at[2].set(back)
        return stacked, rows

    before = module.handler_calls()
    jax.block_until_ready(run(fn, R, xs, idxs, ws, ys))
    ran = {k[len("jax_ep_"):]: v - before[k] for k, v in module.handler_calls().items()
           if v != before[k]}
    assert ran == {"ll_dispatch_send": 2, "ll_dispatch_receive": 2, "ll_combine": 1,
                   "dispatch": 1, "combine": 1}, ran


def test_split_halves_merged_or_dropped_as_pairs():
    """The split halves declare no side effects, so XLA may merge identical pairs and drop a
    pair whose results nothing reads, never one half alone. One program: two identical
    dispatch pairs, a dispatch and a combine pair that nothing reads, then split calls after
    them. Results against the reference; as many receives ran as sends, the unread pairs
    not at all."""
    from jax_ep import _native

    module = _native.load()[0]
    xs, idxs, ws, ys, E, M = _ll_series(3)

    def fn(backend, xs, idxs, ws, ys):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
                  backend=backend)

        def split(x, idx):
            return jax_ep.low_latency_dispatch_receive(
                jax_ep.low_latency_dispatch_send(x, idx, **kw))

        a, b = split(xs[0], idxs[0]), split(xs[0], idxs[0])
        unread = split(xs[1], idxs[1])
        jax_ep.low_latency_combine_receive(
            jax_ep.low_latency_combine_send(ys[1], ws[1], unread.handle), unread.handle)
        c = split(xs[2], _after(idxs[2], a, b))
        back = jax_ep.low_latency_combine_receive(
            jax_ep.low_latency_combine_send(_after(ys[0], c), ws[0], a.handle), a.handle)
        return (a, b, c), back

    before = module.handler_calls()
    (outs, back), (outs_r, back_r) = both(fn, xs, idxs, ws, ys)
    ran = {k[len("jax_ep_ll_"):]: v - before.get(k, 0) for k, v in module.handler_calls().items()
           if k.startswith("jax_ep_ll_")}
    for got, want in zip(outs, outs_r):
        used = np.asarray(want.handle.src_rank) >= 0
        assert_trees_equal(_ll_used(got, used), _ll_used(want, used), fp8_steps=True)
    assert_sums_close(back, back_r, jnp.bfloat16)
    assert ran.get("dispatch_send") == ran.get("dispatch_receive") in (2, 3), ran
    assert ran.get("combine_send") == ran.get("combine_receive") == 1, ran


def test_low_latency_interleaved_split_calls():
    """Six calls with different data in one program (every buffer half reused), then the
    orders send(A), send(B), receive(A), receive(B) and send(A), send(B), receive(B),
    receive(A), for dispatch and combine (XLA may reorder independent halves: any order with
    at most two sends in flight must work)."""
    n = 6
    xs, idxs, ws, ys, E, M = _ll_series(n)

    def fn(backend, xs, idxs, ws, ys):
        # a split send must not have two other sends of its op before its receive
        outs, backs, kw = _ll_chain(n, E, M, backend, xs, idxs, ws, ys)
        # interleaved halves
        pa = jax_ep.low_latency_dispatch_send(xs[0], _after(idxs[0], outs[-1]), **kw)
        pb = jax_ep.low_latency_dispatch_send(xs[1], _after(idxs[1], outs[-1]), **kw)
        oa = jax_ep.low_latency_dispatch_receive(pa)
        ob = jax_ep.low_latency_dispatch_receive(pb)
        # at most two sends in flight: C and D are sent after A and B are received
        pc = jax_ep.low_latency_dispatch_send(xs[2], _after(idxs[2], oa, ob), **kw)
        pd = jax_ep.low_latency_dispatch_send(xs[3], _after(idxs[3], oa, ob), **kw)
        od = jax_ep.low_latency_dispatch_receive(pd)
        oc = jax_ep.low_latency_dispatch_receive(pc)
        ca = jax_ep.low_latency_combine_send(_after(ys[0], backs[-1]), ws[0], oa.handle)
        cb = jax_ep.low_latency_combine_send(_after(ys[1], backs[-1]), ws[1], ob.handle)
        bb = jax_ep.low_latency_combine_receive(cb, ob.handle)
        ba = jax_ep.low_latency_combine_receive(ca, oa.handle)
        return outs, backs, (oa, ob, oc, od), (ba, bb)

    got, want = both(fn, xs, idxs, ws, ys)
    outs, backs, inter, inter_back = got
    outs_r, backs_r, _, _ = want
    for i in range(n):
        used = np.asarray(outs_r[i].handle.src_rank) >= 0
        assert_trees_equal(_ll_used(outs[i], used), _ll_used(outs_r[i], used), fp8_steps=True)
        assert_sums_close(backs[i], backs_r[i], jnp.bfloat16)
    for i, o in enumerate(inter):
        used = np.asarray(outs_r[i].handle.src_rank) >= 0
        assert_trees_equal(_ll_used(o, used), _ll_used(outs_r[i], used), fp8_steps=True)
    for i, b in enumerate(inter_back):
        assert_sums_close(b, backs_r[i], jnp.bfloat16)


def test_low_latency_fused_calls_between_split_ones():
    """Fused calls of one op placed between a split send and receive of the other (they wait
    for the split kernel: beside it, the ranks deadlocked), and fused calls with none in
    flight (plain launches), against the reference."""
    n = 3
    xs, idxs, ws, ys, E, M = _ll_series(n)
    barrier = jax.lax.optimization_barrier

    def fn(backend, xs, idxs, ws, ys):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
                  backend=backend)
        o0 = jax_ep.low_latency_dispatch(xs[0], idxs[0], **kw)  # nothing in flight
        pending = jax_ep.low_latency_dispatch_send(xs[1], _after(idxs[1], o0), **kw)
        y0, pending = barrier((ys[0], pending))
        b0 = jax_ep.low_latency_combine(y0, ws[0], o0.handle)  # waits for the split dispatch
        b0, pending = barrier((b0, pending))
        o1 = jax_ep.low_latency_dispatch_receive(pending)
        sent = jax_ep.low_latency_combine_send(_after(ys[1], b0), ws[1], o1.handle)
        x2, sent = barrier((xs[2], sent))
        o2 = jax_ep.low_latency_dispatch(x2, _after(idxs[2], o1), **kw)  # waits for the split send
        o2, sent = barrier((o2, sent))
        b1 = jax_ep.low_latency_combine_receive(sent, o1.handle)
        b2 = jax_ep.low_latency_combine(_after(ys[2], b1), ws[2], o2.handle)  # none in flight
        return (o0, o1, o2), (b0, b1, b2)

    (outs, backs), (outs_r, backs_r) = both(fn, xs, idxs, ws, ys)
    for i in range(n):
        used = np.asarray(outs_r[i].handle.src_rank) >= 0
        assert_trees_equal(_ll_used(outs[i], used), _ll_used(outs_r[i], used), fp8_steps=True)
        assert_sums_close(backs[i], backs_r[i], jnp.bfloat16)


def test_calls_on_two_streams_in_one_program_match_reference():
    """A normal-mode dispatch and combine on XLA's stream 1 (Config.stream) and low-latency
    calls on the program's stream in one program, neither needing the other's results: each
    kernel of ours waits for those enqueued before it on the other stream (side by side, ranks
    that met them in opposite orders could each hold SMs the other's kernel waits for); values
    against the reference."""
    E, x, idx, w, _ = stream_case(12)
    xs, idxs, ws, ys, E_ll, M = _ll_series(2)
    side = jax_ep.Config(stream=1)

    def fn(backend, x, idx, w, xs, idxs, ws, ys):
        kw = dict(num_experts=E, axis_name=AXIS, backend=backend, config=side)
        ll = dict(num_experts=E_ll, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
                  backend=backend)
        a = jax_ep.dispatch(x, idx, w, **kw)
        o0 = jax_ep.low_latency_dispatch(xs[0], idxs[0], **ll)
        y = jax_ep.combine(a.x * 2, a.handle)
        b0 = jax_ep.low_latency_combine(ys[0], ws[0], o0.handle)
        o1 = jax_ep.low_latency_dispatch(xs[1], idxs[1], **ll)
        b1 = jax_ep.low_latency_combine(ys[1], ws[1], o1.handle)
        return y, (o0, o1), (b0, b1)

    (y, outs, backs), (y_r, outs_r, backs_r) = both(fn, x, idx, w, xs, idxs, ws, ys)
    assert_sums_close(y, y_r, jnp.float32)
    for i in range(2):
        used = np.asarray(outs_r[i].handle.src_rank) >= 0
        assert_trees_equal(_ll_used(outs[i], used), _ll_used(outs_r[i], used), fp8_steps=True)
        assert_sums_close(backs[i], backs_r[i], jnp.bfloat16)


def test_low_latency_pending_received_twice():
    """A pending split dispatch passed to two receives. The receives are identical pure calls:
    where XLA merges them, both return the dispatch's rows. Where it does not, each returns its
    operand's buffers, XLA copies them for at least one of the two, and that receive reports
    that the rows are not those of a send in flight (a copy may have been taken before the
    send's kernel wrote them) instead of returning them."""
    xs, idxs, _, _, E, M = _ll_series(1)
    kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=True,
              backend="cuda")

    def fn(xs, idxs):
        pending = jax_ep.low_latency_dispatch_send(xs[0], idxs[0], **kw)
        first = jax_ep.low_latency_dispatch_receive(pending)
        second = jax_ep.low_latency_dispatch_receive(pending)
        return first.recv_count, second.recv_count, first.x_scales, second.x_scales

    try:
        got = jax.block_until_ready(run(fn, num_ranks(), xs, idxs))
    except Exception as e:  # not merged: one receive refused
        assert "not those of a send in flight" in str(e), e
        from jax._src import dispatch

        dispatch.runtime_tokens.clear()  # a failed program's token would raise again at exit
        return
    once = run(lambda xs, idxs: jax_ep.low_latency_dispatch(xs[0], idxs[0], **kw).recv_count,
               num_ranks(), xs, idxs)
    np.testing.assert_array_equal(got[0], once)
    np.testing.assert_array_equal(got[1], once)
    np.testing.assert_array_equal(got[2], got[3])


def test_low_latency_repeated_programs_are_bit_identical():
    R = num_ranks()
    T, M, H = 64, 64, 512
    x, idx, w, E = _ll_inputs(1, T, H, "random", 0.05)

    def fn(x, idx, w):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        axis_name=AXIS, use_fp8=False, backend="cuda")
        return o.handle, jax_ep.low_latency_combine(o.x, w, o.handle)

    _assert_repeats_identical(fn, R, (x, idx, w), 50)


def test_low_latency_gradients_match_reference():
    R = num_ranks()
    T, M, H = 16, 16, 128
    x, idx, w, E = _ll_inputs(2, T, H, "random", 0.1, dtype=np.float32)
    L = E // R
    scale = np.random.default_rng(2).standard_normal((R, L, 1, H)).astype(np.float32)

    def fn(backend, x, idx, w, scale):
        def loss(x, w):
            o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                            axis_name=AXIS, use_fp8=False, backend=backend)
            return jnp.sum(jnp.sin(jax_ep.low_latency_combine(o.x * scale, w, o.handle)))

        return jax.grad(loss, argnums=(0, 1))(x, w)

    got, want = both(fn, x, idx, w, scale)
    for a, b in zip(got, want):
        # float32 sums in another order: an error of a few ulps of the largest term, which an
        # element that cancels to near zero shows as a large relative error (8 ranks: 1.2e-6
        # absolute on terms of ~8)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max())))


def test_low_latency_too_small_buffer_is_an_error_naming_the_bytes():
    """A call needing more than the low-latency buffer fails before any kernel runs (on every
    rank alike), naming the bytes; later calls still work."""
    import re

    from jax_ep import runtime as rt

    R = num_ranks()
    H, K, E = 4096, LL_K, LL_E_PER_RANK * R
    M = rt.low_latency_buffer_bytes() // (E * H) + 8  # E*M bf16 records: more than the buffer
    x, idx, _, _ = _ll_inputs(0, 4, H, "random", 0.0)

    def fn(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                           axis_name=AXIS, use_fp8=False, backend="cuda").x[0, 0]

    with pytest.raises(Exception, match="needs a low-latency buffer of") as info:
        run(fn, R, x, idx)
    needed = int(re.search(r"buffer of (\d+) bytes", str(info.value)).group(1))
    assert rt.low_latency_buffer_bytes() < needed <= jax_ep.low_latency_buffer_size_hint(
        M, H, E, K, R)
    test_low_latency_drops_duplicate_experts()  # the runtime still works


@needs_nccl
@pytest.mark.parametrize("dtype,factor,beside", [
    (jnp.bfloat16, None, False), (jnp.bfloat16, 1.5, False), (jnp.float32, None, False),
    (jnp.bfloat16, 1.5, True)])
def test_moe_layer_matches_reference(dtype, factor, beside):
    """moe_layer (router, dispatch, SwiGLU experts, combine, shared expert) on the kernels:
    forward and gradients equal to the reference backend's. bf16 without a capacity factor
    runs the grouped expert GEMMs (Pallas Mosaic-GPU on Hopper), with one the padded blocks;
    beside: the kernels' layer with its shared expert on stream 1 through jax_ep's sized
    GEMMs, against the reference's layer with it inline (XLA's dots): its bf16 hidden layer
    may round one ulp apart, hence the wider tolerance."""
    R = num_ranks()
    T, H, F, S, E, top_k = 64, 128, 128, 64, 4 * R, 2
    L = E // R
    key = jax.random.key(7)
    k = jax.random.split(key, 8)
    params = moe.MoEParams(
        np.asarray(jax.random.normal(k[0], (H, E))),
        *(np.asarray(jax.random.normal(ki, (E, H, F)) / np.sqrt(H)) for ki in k[1:3]),
        np.asarray(jax.random.normal(k[3], (E, F, H)) / np.sqrt(F)),
        *(np.asarray(jax.random.normal(ki, (H, S)) / np.sqrt(H)) for ki in k[4:6]),
        np.asarray(jax.random.normal(k[6], (S, H)) / np.sqrt(S)))
    per_rank = moe.MoEParams(*(
        np.broadcast_to(p, (R,) + p.shape).copy() if name not in ("w_gate", "w_up", "w_down")
        else p.reshape((R, L) + p.shape[1:]) for name, p in zip(params._fields, params)))
    x = np.asarray(jax.random.normal(k[7], (R, T, H)).astype(dtype))
    capacity = None if factor else 512  # rows a multiple of the GEMM blocks

    def fn(backend, x, *p):
        def loss(x, p):
            y, aux = moe.moe_layer(x, moe.MoEParams(*p), top_k=top_k, axis_name=AXIS,
                                   capacity=capacity, capacity_factor=factor,
                                   expert_alignment=64 if factor is None else 8,
                                   backend=backend, shared_beside=beside and backend == "cuda")
            return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux.load_balancing_loss, aux
        (value, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, p)
        return value, aux.num_dropped, grads

    with jax.default_matmul_precision("float32"):
        got, want = both(fn, x, *per_rank)
    assert int(np.asarray(got[1]).max()) == 0 and int(np.asarray(want[1]).max()) == 0
    tol = 1e-4 if dtype == jnp.float32 else 6e-2 if beside else 2e-2
    for a, b in zip(jax.tree.leaves((got[0], got[2])), jax.tree.leaves((want[0], want[2]))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tol, atol=tol)


@needs_nccl
@pytest.mark.parametrize("use_fp8", [True, False])
def test_decode_layer_matches_reference(use_fp8):
    """moe.decode_layer on the kernels (a records low-latency dispatch, the grouped kernel
    reading the rows by index, the low-latency combine) against the reference backend's
    layer: forward, and with BF16 on the wire the gradients too."""
    R = num_ranks()
    T, H, F, S, E, top_k = 32, 256, 128, 64, 8 * R, 4
    k = jax.random.split(jax.random.key(11), 8)
    params = moe.MoEParams(
        np.asarray(jax.random.normal(k[0], (H, E))),
        *(np.asarray(jax.random.normal(ki, (E, H, F)) / np.sqrt(H)) for ki in k[1:3]),
        np.asarray(jax.random.normal(k[3], (E, F, H)) / np.sqrt(F)),
        *(np.asarray(jax.random.normal(ki, (H, S)) / np.sqrt(H)) for ki in k[4:6]),
        np.asarray(jax.random.normal(k[6], (S, H)) / np.sqrt(S)))
    L = E // R
    per_rank = moe.MoEParams(*(
        np.broadcast_to(p, (R,) + p.shape).copy() if name not in ("w_gate", "w_up", "w_down")
        else p.reshape((R, L) + p.shape[1:]) for name, p in zip(params._fields, params)))
    x = np.asarray(jax.random.normal(k[7], (R, T, H)).astype(jnp.bfloat16))

    def fn(backend, x, *p):
        def loss(x, p):
            y, aux = moe.decode_layer(x, moe.MoEParams(*p), top_k=top_k, axis_name=AXIS,
                                      use_fp8=use_fp8, backend=backend)
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, aux.num_dropped)
        if use_fp8:
            return loss(x, p)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, p)

    got, want = both(fn, x, *per_rank)
    (_, (_, dropped)) = got if use_fp8 else got[0]
    assert int(np.asarray(dropped).max()) == 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


@needs_nccl
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_nnx_module_matches_reference(axis_type):
    """jax_ep.nnx.MoE on the kernels (global arrays over every process's GPU, nnx.jit): output
    and parameter gradients equal to the same module on the reference backend; Explicit:
    jax.make_mesh's default axis type from jax 0.7, under jax.set_mesh."""
    nnx = pytest.importorskip("flax.nnx", reason="flax not installed (pip install jax_ep[flax])")
    from jax_ep.nnx import MoE

    from ep import fetch, mesh, put

    if axis_type == "Explicit" and not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    R = num_ranks()
    T, H, F, E = 16, 64, 32, 4 * R
    m = mesh(R, axis_type=axis_type)

    def layer(backend):  # the same seed: the same parameters
        return MoE(H, F, E, top_k=2, shared_ffn=F, axis_name=AXIS, mesh=m, backend=backend,
                   router_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(5))

    sharding = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(AXIS))
    x = put(np.asarray(jax.random.normal(jax.random.key(6), (R * T, H))), sharding)

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(jnp.sin(y)) + 0.1 * aux.load_balancing_loss, (y, aux.num_dropped)

    step = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    context = jax.set_mesh(m) if axis_type == "Explicit" else contextlib.nullcontext()
    with jax.default_matmul_precision("float32"), context:
        got = step(layer("cuda"), x)
        want = step(layer("reference"), x)
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(fetch(a), fetch(b), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- EP on a sub-axis
#
# Two-axis meshes over every process, the EP axis one of them: each EP group (one per index of
# the other axis) runs its own calls at once, over its own PEs. Both axis orders: with
# (data, expert) a group's PEs are consecutive, with (expert, data) they are strided. Needs at
# least 4 ranks (`python -m jax_ep.launch -n 4 [--gpus 1] -m pytest -q tests/test_gpu.py -k
# sub_axis`); the reference backend on the same mesh is the oracle.

DATA, EXPERT = "data", "expert"


def _sub_axis_mesh(order, groups):
    """(axis names, mesh shape, EP size) of a two-axis mesh over every rank; skips below 4."""
    W = num_ranks()
    D = 2 if groups == "two" else W // 2
    if W < 4 or W % D:
        pytest.skip(f"EP on a sub-axis needs 4 or more ranks (a multiple of {D}), have {W}")
    R = W // D
    if order == "data_major":
        return (DATA, EXPERT), (D, R), R
    return (EXPERT, DATA), (R, D), R


def _ep_index(names, shape):
    """Each device's index along the EP axis, in mesh order (= process order)."""
    grid = np.indices(shape).reshape(2, -1)
    return grid[names.index(EXPERT)]


def run_2d(fn, names, shape, *args, devices=None):
    """run() on a two-axis mesh: args [W, ...] (slice i to the device at flat mesh position i),
    each leaf of fn's result stacked back as [W, ...]."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ep import fetch, put

    devices = jax.devices() if devices is None else devices
    m = jax.make_mesh(shape, names, devices=devices[:int(np.prod(shape))],
                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(names)

    def per_device(*local):
        return jax.tree.map(lambda a: a[None], fn(*[a[0] for a in local]))

    f = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=tuple(spec for _ in args),
                              out_specs=spec))
    return jax.tree.map(fetch, f(*[put(a, NamedSharding(m, spec)) for a in args]))


def both_2d(fn, names, shape, *args):
    cuda = run_2d(lambda *a: fn("cuda", *a), names, shape, *args)
    W = int(np.prod(shape))
    ref_devices = jax.local_devices(backend="cpu")[:W] if SHARED_GPUS else None
    ref = run_2d(lambda *a: fn("reference", *a), names, shape, *args, devices=ref_devices)
    return cuda, ref


@pytest.mark.parametrize("order", ["data_major", "expert_major_mesh"])
@pytest.mark.parametrize("groups", ["two", "half"])
@pytest.mark.parametrize("layout,path", [("rank_major", "fused"), ("rank_major", "pull"),
                                         ("expert_major", "fused"), ("rank_major", "copy"),
                                         ("source_slots", "copy")])
def test_sub_axis_dispatch_combine_match_reference(order, groups, layout, path):
    names, shape, R = _sub_axis_mesh(order, groups)
    W = num_ranks()
    T, H, K, E = 48, 256, 4, 4 * R
    rng = np.random.default_rng(R * 10 + len(layout))
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    idx = np.where(rng.random(idx.shape) < 0.1, -1, idx).astype(np.int32)
    w = rng.random((W, T, K)).astype(np.float32)
    tuning = jax_ep.Config(dispatch_path=path, combine_path="copy" if path == "copy" else None)

    def fn(backend, x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=EXPERT, layout=layout,
                              backend=backend, config=tuning)
        y = out.x.astype(jnp.float32) * 2 + 1
        weights = out.topk_weights if layout == "expert_major" else None
        return out, jax_ep.combine(y, out.handle, weights=weights)

    (out, back), (out_r, back_r) = both_2d(fn, names, shape, x, idx, w)
    assert_trees_equal(out, out_r)
    assert_sums_close(back, back_r, jnp.float32)


@pytest.mark.parametrize("order", ["data_major", "expert_major_mesh"])
@pytest.mark.parametrize("fp8", [False, True])
def test_sub_axis_low_latency_matches_reference(order, fp8):
    names, shape, R = _sub_axis_mesh(order, "two")
    W = num_ranks()
    T, M, H, K, E = 24, 32, 256, LL_K, LL_E_PER_RANK * R
    L = E // R
    rng = np.random.default_rng(40 + R)
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    w = rng.random((W, T, K)).astype(np.float32)
    y = np.asarray(jnp.asarray(rng.standard_normal((W, L, R * M, H)), jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=EXPERT, use_fp8=fp8,
                  backend=backend)
        out = jax_ep.low_latency_dispatch(x, idx, **kw)
        split = jax_ep.low_latency_dispatch_receive(jax_ep.low_latency_dispatch_send(x, idx, **kw))
        return out, split, jax_ep.low_latency_combine(y, w, out.handle)

    (out, split, back), (out_r, _, back_r) = both_2d(fn, names, shape, x, idx, w, y)
    used = np.asarray(out_r.handle.src_rank) >= 0
    assert_trees_equal(_ll_used(out, used), _ll_used(out_r, used), fp8_steps=True)
    assert_trees_equal(_ll_used(split, used), _ll_used(out_r, used), fp8_steps=True)
    assert_sums_close(back, back_r, jnp.bfloat16)


@pytest.mark.parametrize("order", ["data_major", "expert_major_mesh"])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_sub_axis_moe_gradients_match_reference(order, layout):
    names, shape, R = _sub_axis_mesh(order, "two")
    W = num_ranks()
    T, H, F, E, top_k = 16, 64, 48, 4 * R, 2
    L = E // R
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    router = np.asarray(jax.random.normal(k1, (H, E)))
    w_in = np.asarray(jax.random.normal(k2, (E, H, F)) / np.sqrt(H)).reshape(R, L, H, F)
    w_out = np.asarray(jax.random.normal(k3, (E, F, H)) / np.sqrt(F)).reshape(R, L, F, H)
    x = np.asarray(jax.random.normal(k4, (W, T, H)))
    e = _ep_index(names, shape)  # each device holds its EP index's experts

    fn = moe_grads(top_k=top_k, axis_name=EXPERT, layout=layout)

    with jax.default_matmul_precision("float32"):
        got, want = both_2d(fn, names, shape, x, np.broadcast_to(router, (W, H, E)).copy(),
                            w_in[e], w_out[e])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- expert GEMMs


def _close_to_dense(got, want, k):
    """Entries of a K-term dot product of unit normals are ~sqrt(K); bf16 results and TF32
    operands are good to ~2^-8 of that."""
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2,
                               atol=2e-2 * np.sqrt(k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("L,M,K,N", [(3, 320, 512, 256), (2, 37, 72, 40)])
def test_batched_matmul_and_gradients_match_dense(dtype, L, M, K, N):
    """experts.batched_matmul's cuBLASLt call (every SM, and sized for 24 and 108 SMs) and its
    gradients (the same call with transposed operands) against float64 products of the same
    rounded inputs, per rank; odd shapes take cuBLASLt's unaligned kernels."""
    from jax_ep import experts

    R = num_ranks()
    rng = np.random.default_rng(M + K)
    x = np.asarray(jnp.asarray(rng.standard_normal((R, L, M, K)), dtype))
    w = np.asarray(jnp.asarray(rng.standard_normal((R, L, K, N)), dtype))
    dy = np.asarray(jnp.asarray(rng.standard_normal((R, L, M, N)), dtype))
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    for sms in (0, 24, 108):
        def fn(x, w, dy, sms=sms):
            y, vjp = jax.vjp(lambda x, w: experts.batched_matmul(
                x, w, sm_count=sms, backend="cuda"), x, w)
            return (y,) + vjp(dy)

        y, dx, dw = run(fn, R, x, w, dy)
        assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
        _close_to_dense(y, x64 @ w64, K)
        _close_to_dense(dx, dy64 @ w64.swapaxes(-1, -2), N)
        _close_to_dense(dw, x64.swapaxes(-1, -2) @ dy64, M)
    if dtype == jnp.float32:  # precision="highest": float32 products, not TF32
        y = run(lambda x, w: experts.batched_matmul(x, w, precision="highest", backend="cuda"),
                R, x, w)
        np.testing.assert_allclose(np.asarray(y, np.float64), x64 @ w64, rtol=1e-4,
                                   atol=1e-4 * np.sqrt(K))


def test_swiglu_mlp_padded_with_sized_gemms_matches_einsums():
    """swiglu_mlp_padded(gemm_sms=108): values and gradients as with XLA's einsums, to bf16
    rounding, overflow counted alike."""
    from jax_ep import experts

    R = num_ranks()
    L, H, F, C, M = 4, 256, 128, 48, 160
    rng = np.random.default_rng(5)
    rows = np.asarray(jnp.asarray(rng.standard_normal((R, M, H)), jnp.bfloat16))
    sizes = np.tile(np.asarray([50, 30, 45, 20], np.int32), (R, 1))  # 50 > C: 2 dropped
    ws = [np.asarray(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16))
          for s in ((R, L, H, F), (R, L, H, F), (R, L, F, H))]

    def fn(rows, sizes, wg, wu, wd, gemm_sms):
        def loss(rows, wg, wu, wd):
            out, overflow = experts.swiglu_mlp_padded(rows, wg, wu, wd, sizes, capacity=C,
                                                      gemm_sms=gemm_sms)
            return jnp.sum(out.astype(jnp.float32) ** 2), (out, overflow)

        (_, (out, overflow)), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(
            rows, wg, wu, wd)
        return (out, overflow) + grads

    got = run(lambda *a: fn(*a, 108), R, rows, sizes, *ws)
    want = run(lambda *a: fn(*a, None), R, rows, sizes, *ws)
    np.testing.assert_array_equal(got[1], want[1])
    assert int(np.asarray(got[1]).ravel()[0]) == 2
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * np.abs(b).max())
