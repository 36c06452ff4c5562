"""Expert GEMMs: grouped_matmul / swiglu_mlp (every impl), the padded path, the mgpu custom_vjp.

CPU: each impl against the dense oracle and a per-group loop, forward and gradients, with an
empty group and padding rows; the mgpu custom_vjp runs on emulated kernels (same contracts as
the Pallas ones: unwritten padding rows hold NaN, dw reads whole row blocks) and the real
kernels are lowered for CUDA. GPU (sm_90 only): the real kernels against jax.lax.ragged_dot.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import experts

L, M, H, F = 4, 128, 64, 64
GROUPS = (40, 0, 50, 20)  # an empty group; rows 110..127 are padding


def _inputs(dtype=jnp.float32, groups=GROUPS, m=M, h=H, f=F, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    total = sum(groups)
    rows = jax.random.normal(k[0], (m, h), jnp.float32)
    rows = jnp.where((jnp.arange(m) < total)[:, None], rows, 0).astype(dtype)
    w_gate = (jax.random.normal(k[1], (len(groups), h, f)) * h ** -0.5).astype(dtype)
    w_up = (jax.random.normal(k[2], (len(groups), h, f)) * h ** -0.5).astype(dtype)
    w_down = (jax.random.normal(k[3], (len(groups), f, h)) * f ** -0.5).astype(dtype)
    ct = jax.random.normal(k[4], (m, h), jnp.float32).astype(dtype)
    return rows, w_gate, w_up, w_down, jnp.array(groups, jnp.int32), ct


def _expert_of_row(groups, m):
    ends = np.cumsum(groups)
    e = np.searchsorted(ends, np.arange(m), side="right")
    return np.minimum(e, len(groups) - 1), np.arange(m) < ends[-1]


def _oracle_swiglu(rows, w_gate, w_up, w_down, groups):
    """Each row through its own expert by the dense oracle; padding rows zero."""
    e, used = _expert_of_row(groups, rows.shape[0])
    every = experts.dense_swiglu(rows, w_gate, w_up, w_down)  # [M, L, H] f32
    out = jnp.take_along_axis(every, jnp.asarray(e)[:, None, None], axis=1)[:, 0]
    return jnp.where(jnp.asarray(used)[:, None], out, 0).astype(rows.dtype)


def _loop_matmul(x, w, groups):
    """Per-group Python loop oracle of grouped_matmul."""
    out, start = [], 0
    for g, size in enumerate(groups):
        out.append(jnp.dot(x[start:start + size], w[g], preferred_element_type=jnp.float32))
        start += size
    out.append(jnp.zeros((x.shape[0] - start, w.shape[2]), jnp.float32))
    return jnp.concatenate(out).astype(x.dtype)


def _vjp(f, args, ct):
    out, pullback = jax.vjp(f, *args)
    return out, pullback(ct)


def _close(a, b, tol, what=""):
    """|a - b| <= tol * max|b| elementwise."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), f"{what}: non-finite values"
    scale = max(float(np.max(np.abs(b))), 1e-6)
    np.testing.assert_allclose(a / scale, b / scale, atol=tol, rtol=0, err_msg=what)


# ----------------------------------------------------------------------------- emulated kernels


def _emu_ragged_dot(lhs, rhs, group_sizes, cfg, transpose_rhs):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    y = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes)
    keep = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(keep[:, None], y, jnp.nan).astype(lhs.dtype)  # unwritten rows


def _emu_transposed_ragged_dot(lhs, rhs, group_sizes, cfg):
    """Like the kernel: each group reads whole block_k row blocks, masks lhs by multiplying
    with 0/1 and rhs not at all."""
    bk = cfg.block_k
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    r = jnp.arange(lhs.shape[0])[None, :]
    member = (r >= starts[:, None]) & (r < ends[:, None])
    read = (r >= starts[:, None] // bk * bk) & (r < -(-ends[:, None] // bk) * bk)
    read &= (group_sizes > 0)[:, None]
    lhs_g = lhs[None].astype(jnp.float32) * member[..., None]
    rhs_g = jnp.where(read[..., None], rhs[None].astype(jnp.float32), 0)
    return jnp.einsum("gmk,gmn->gkn", lhs_g, rhs_g).astype(lhs.dtype)


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    """f32 oracles compare at 1e-5: no TF32 where a GPU runs them."""
    with jax.default_matmul_precision("highest"):
        yield


_EMULATED = experts._Kernels(_emu_ragged_dot, _emu_transposed_ragged_dot,
                             (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)))


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(experts, "_MGPU_KERNELS", _EMULATED)


# ----------------------------------------------------------------------------- grouped_matmul


def _assert_matches_loop(f, x, w, ct, ct_loop):
    """f(x, w) and its VJP (cotangent ct) against the per-group loop's (cotangent ct_loop);
    padding rows come out zero in the result and in dx. Returns dw."""
    got, (dx, dw) = _vjp(f, (x, w), ct)
    want, (dx_w, dw_w) = _vjp(lambda x, w: _loop_matmul(x, w, GROUPS), (x, w), ct_loop)
    _close(got, want, 1e-5)
    _close(dx, dx_w, 1e-5)
    _close(dw, dw_w, 1e-5)
    assert not np.any(np.asarray(got[sum(GROUPS):]))
    assert not np.any(np.asarray(dx[sum(GROUPS):]))
    return dw


@pytest.mark.parametrize("impl", ["ragged_dot", "auto"])
def test_grouped_matmul_matches_loop(impl):
    x, w, _, _, gs, _ = _inputs()
    ct = jax.random.normal(jax.random.key(7), (M, F))
    f = functools.partial(experts.grouped_matmul, group_sizes=gs, impl=impl)
    dw = _assert_matches_loop(f, x, w, ct, ct)
    assert not np.any(np.asarray(dw[1]))  # the empty group


def test_grouped_matmul_mgpu_vjp_emulated(emulated):
    x, w, _, _, gs, _ = _inputs()
    ct = jax.random.normal(jax.random.key(7), (M, F))
    ct_nan = ct.at[sum(GROUPS):].set(jnp.nan)  # padding-row cotangents must not leak into dw
    f = jax.jit(functools.partial(experts.grouped_matmul, group_sizes=gs, impl="mgpu"))
    _assert_matches_loop(f, x, w, ct_nan, ct)


def test_auto_is_ragged_dot_off_hopper():
    x, w, _, _, _, _ = _inputs(jnp.bfloat16)
    assert experts._choose("auto", x, w)[0] == ("mgpu" if experts._is_hopper_gpu()
                                                else "ragged_dot")
    assert experts._choose("auto", x.astype(jnp.float32), w.astype(jnp.float32))[0] == (
        "ragged_dot")
    with pytest.raises(ValueError, match="impl must be"):
        experts.grouped_matmul(x, w, jnp.array(GROUPS), impl="nope")
    with pytest.raises(ValueError, match="cannot take"):
        experts.grouped_matmul(x[:100], w, jnp.array(GROUPS), impl="mgpu")


def test_select_configs():
    c = experts.select_configs(40960, 7168, 2048)
    assert c.fwd == experts.TUNED_CONFIGS[("fwd", 7168, 2048)]
    for kind, cfg in c._asdict().items():
        assert experts.config_fits(kind, cfg, 40960, 7168, 2048)
    assert experts.select_configs(100, 64, 64) is None  # rows not a multiple of 64
    assert experts.select_configs(128, 64, 96) is None
    c = experts.select_configs(192, 64, 128)
    assert c.fwd.block_m == 64 and c.dx.block_n == 64 and c.dw.block_n == 128
    big = experts.GemmConfig(256, 256, 128, 6, 1)  # far over shared memory
    assert not experts.config_fits("fwd", big, 4096, 4096, 4096)
    over = {("fwd", 64, 128): experts.GemmConfig(64, 128, 64, 2, 1)}
    assert experts.select_configs(192, 64, 128, overrides=over).fwd == over[("fwd", 64, 128)]


# ----------------------------------------------------------------------------- swiglu_mlp


def _swiglu_grads(f, dtype=jnp.float32, ct_padding=None):
    rows, wg, wu, wd, gs, ct = _inputs(dtype)
    if ct_padding is not None:
        ct = ct.at[sum(GROUPS):].set(ct_padding)
    return _vjp(lambda *a: f(*a, gs), (rows, wg, wu, wd), ct)


def _oracle_grads(dtype=jnp.float32):
    """The oracle in float32 on the inputs rounded to dtype."""
    args = tuple(a.astype(jnp.float32) for a in _inputs(dtype))
    rows, wg, wu, wd, _, ct = args
    return _vjp(lambda *a: _oracle_swiglu(*a, GROUPS), (rows, wg, wu, wd), ct)


@pytest.mark.parametrize("impl", ["ragged_dot", "mgpu"])
def test_swiglu_mlp_matches_dense_oracle(impl, monkeypatch):
    if impl == "mgpu":
        monkeypatch.setattr(experts, "_MGPU_KERNELS", _EMULATED)
    f = jax.jit(functools.partial(experts.swiglu_mlp, impl=impl))
    got, grads = _swiglu_grads(f, ct_padding=jnp.nan if impl == "mgpu" else None)
    want, grads_w = _oracle_grads()
    _close(got, want, 1e-5)
    for name, g, gw in zip(("rows", "w_gate", "w_up", "w_down"), grads, grads_w):
        _close(g, gw, 1e-5, name)
    assert not np.any(np.asarray(got[sum(GROUPS):]))
    assert not np.any(np.asarray(grads[0][sum(GROUPS):]))
    assert not np.any(np.asarray(grads[1][1])) and not np.any(np.asarray(grads[3][1]))


def test_swiglu_mlp_bf16_mgpu_emulated(emulated):
    f = jax.jit(functools.partial(experts.swiglu_mlp, impl="mgpu"))
    got, grads = _swiglu_grads(f, jnp.bfloat16)
    want, grads_w = _oracle_grads(jnp.bfloat16)
    _close(got, want, 3e-2)
    for g, gw in zip(grads, grads_w):
        _close(g, gw, 3e-2)


def test_mgpu_path_lowers_for_cuda(monkeypatch):
    """The real Pallas kernels trace and lower for CUDA (shapes, signatures): 3 GEMMs forward,
    6 backward."""
    try:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
    except ImportError as e:  # older jax, or one without the Mosaic-GPU kernels' needs
        pytest.skip(f"jax's Mosaic-GPU ragged dot kernels cannot be imported here: {e}")

    class _Device:  # the transposed kernel asks the default device for its SM count
        core_count = 132

    class _Jax:
        def __getattr__(self, name):
            return getattr(jax, name)

        def devices(self, *a):
            return [_Device()]

    monkeypatch.setattr(trd, "jax", _Jax())
    rows, wg, wu, wd, gs, _ = _inputs(jnp.bfloat16, groups=(64, 0, 100, 30), m=256, h=128,
                                      f=128)

    def loss(*a):
        out = experts.swiglu_mlp(*a, gs, impl="mgpu")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    lowered = step.trace(rows, wg, wu, wd).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("stablehlo.custom_call @mosaic_gpu") == 9


# ----------------------------------------------------------------------------- padded path


def test_padded_round_trip_and_overflow():
    x, _, _, _, gs, _ = _inputs()
    real = jnp.array([35, 0, 50, 12], jnp.int32)  # the rest of each group is alignment
    xp, over = experts.to_padded(x, gs, 48, rows_per_expert=real)
    assert xp.shape == (L, 48, H) and int(over) == 2  # group 2 has 50 real rows
    np.testing.assert_array_equal(xp[0, :35], x[:35])
    assert not np.any(np.asarray(xp[0, 35:])) and not np.any(np.asarray(xp[1]))
    np.testing.assert_array_equal(xp[2], x[40:88])
    np.testing.assert_array_equal(xp[3, :12], x[90:102])
    back = experts.from_padded(xp, gs, M, rows_per_expert=real)
    keep = np.zeros(M, bool)
    keep[:35] = keep[40:88] = keep[90:102] = True
    np.testing.assert_array_equal(back, np.where(keep[:, None], x, 0))


def test_padded_gradients_inside_shard_map_with_invariant_rows():
    """Rows JAX types as invariant over the mesh axis (here: replicated) with varying group
    sizes: the custom VJPs must still give cotangents of their inputs' types."""
    from functools import partial

    from jax.sharding import PartitionSpec as P

    R, L, M, H, F = 2, 2, 16, 8, 4
    if jax.device_count() < R:  # e.g. the GPU run on one GPU (the CPU suite has 8 devices)
        pytest.skip(f"needs {R} devices, has {jax.device_count()}")
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s), jnp.float32) * 0.3
         for s in ((R * L, H, F), (R * L, H, F), (R * L, F, H))]
    gs = jnp.asarray([[5, 6], [3, 0]], jnp.int32)

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("ep"), P("ep"), P("ep"), P("ep")),
             out_specs=P())
    def loss(x, wg, wu, wd, gs):
        y, _ = experts.swiglu_mlp_padded(x, wg, wu, wd, gs[0], capacity=8)
        return jax.lax.psum(jnp.sum(y * y), "ep")

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, *w, gs)

    def dense(x, wg, wu, wd):
        total = 0.0
        for r in range(R):
            y = experts.swiglu_mlp(x, wg[r * L:(r + 1) * L], wu[r * L:(r + 1) * L],
                                   wd[r * L:(r + 1) * L], gs[r], impl="ragged_dot")
            total = total + jnp.sum(y * y)
        return total

    want = jax.grad(dense, argnums=(0, 1))(x, *w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_padded_copies_are_transposes():
    x, _, _, _, gs, _ = _inputs()
    yp = jax.random.normal(jax.random.key(3), (L, 32, H))
    _, vjp_to = jax.vjp(lambda x: experts.to_padded(x, gs, 32)[0], x)
    _, vjp_from = jax.vjp(lambda y: experts.from_padded(y, gs, M), yp)
    (dx,) = vjp_to(yp)
    (dyp,) = vjp_from(x)
    # <to_padded(x), yp> == <x, from_padded(yp)>, and the VJPs are the other copy.
    np.testing.assert_allclose(jnp.vdot(experts.to_padded(x, gs, 32)[0], yp),
                               jnp.vdot(x, experts.from_padded(yp, gs, M)), rtol=1e-5)
    np.testing.assert_array_equal(dx, experts.from_padded(yp, gs, M))
    np.testing.assert_array_equal(dyp, experts.to_padded(x, gs, 32)[0])


@pytest.mark.parametrize("capacity", [64, 45])
def test_swiglu_mlp_padded_matches_oracle(capacity):
    rows, wg, wu, wd, gs, ct = _inputs()
    f = jax.jit(functools.partial(experts.swiglu_mlp_padded, capacity=capacity))
    (got, over), pullback = jax.vjp(lambda *a: f(*a, gs), rows, wg, wu, wd)
    grads = pullback((ct, jnp.zeros((), jnp.int32)))
    # Rows past an expert's capacity are dropped: the oracle on rows that fit.
    e, used = _expert_of_row(GROUPS, M)
    pos = np.arange(M) - (np.cumsum(GROUPS) - GROUPS)[e]
    kept = jnp.asarray(used & (pos < capacity))[:, None]
    assert int(over) == sum(max(g - capacity, 0) for g in GROUPS)
    want, grads_w = _vjp(lambda *a: jnp.where(kept, _oracle_swiglu(*a, GROUPS), 0),
                         (rows, wg, wu, wd), ct)
    _close(got, want, 1e-5)
    for g, gw in zip(grads, grads_w):
        _close(g, gw, 1e-5)


# ----------------------------------------------------------------------------- GPU (sm_90)


def _hopper_skip_reason():
    if jax.default_backend() != "gpu":
        return f"needs a GPU (default backend is {jax.default_backend()})"
    if not experts._is_hopper_gpu():
        return f"mgpu kernels need an sm_90 GPU, have {jax.devices()[0].device_kind}"
    return None


hopper = pytest.mark.skipif(_hopper_skip_reason() is not None,
                            reason=str(_hopper_skip_reason()))

# An empty group, ragged sizes not multiples of any block, 100 padding rows.
GPU_GROUPS = (300, 0, 517, 64, 1, 330, 0, 212)


def _ragged_f32(x, w, gs):
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs,
                              precision=jax.lax.Precision.HIGHEST)


@hopper
@pytest.mark.parametrize("k,n", [(256, 512), (512, 256)])
def test_gpu_mgpu_grouped_matmul_vs_ragged_dot(k, n):
    m = sum(GPU_GROUPS) + 100
    m += -m % 128
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    total = sum(GPU_GROUPS)
    x = jnp.where((jnp.arange(m) < total)[:, None], jax.random.normal(kx, (m, k)), 0)
    x = x.astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(GPU_GROUPS), k, n)) * k ** -0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.array(GPU_GROUPS, jnp.int32)
    assert experts._choose("auto", x, w)[0] == "mgpu"
    f = jax.jit(functools.partial(experts.grouped_matmul, group_sizes=gs, impl="mgpu"))
    got, (dx, dw) = _vjp(f, (x, w), ct)
    want, (dx_w, dw_w) = _vjp(lambda x, w: _ragged_f32(x, w, gs), (x.astype(jnp.float32),
                                                                 w.astype(jnp.float32)),
                              ct.astype(jnp.float32))
    assert got.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    _close(got, want, 1e-2)
    _close(dx, dx_w, 1e-2)
    _close(dw, dw_w, 1e-2)
    assert not np.any(np.asarray(got[total:].astype(jnp.float32)))
    assert not np.any(np.asarray(dx[total:].astype(jnp.float32)))
    assert not np.any(np.asarray(dw[1].astype(jnp.float32)))


@hopper
def test_gpu_mgpu_swiglu_vs_ragged_dot():
    m = 2048
    rows, wg, wu, wd, _, ct = _inputs(jnp.bfloat16, groups=GPU_GROUPS, m=m, h=256, f=128)
    gs = jnp.array(GPU_GROUPS, jnp.int32)
    args = (rows, wg, wu, wd)
    f32 = tuple(a.astype(jnp.float32) for a in args)
    got, grads = _vjp(jax.jit(lambda *a: experts.swiglu_mlp(*a, gs, impl="mgpu")), args, ct)
    want, grads_w = _vjp(jax.jit(lambda *a: experts.swiglu_mlp(*a, gs, impl="ragged_dot")),
                         f32, ct.astype(jnp.float32))
    _close(got, want, 2e-2)
    for g, gw in zip(grads, grads_w):
        _close(g, gw, 2e-2)
    assert not np.any(np.asarray(got[sum(GPU_GROUPS):].astype(jnp.float32)))


@hopper
def test_gpu_auto_uses_mgpu_kernels():
    rows, wg, wu, wd, gs, _ = _inputs(jnp.bfloat16, m=256, h=128, f=128)
    text = jax.jit(lambda *a: experts.swiglu_mlp(*a, gs)).lower(rows, wg, wu, wd).as_text()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------- batched GEMM


def test_batched_matmul_reference_matches_dense_and_checks_arguments():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    w = rng.standard_normal((3, 7, 4)).astype(np.float32)
    np.testing.assert_allclose(experts.batched_matmul(x, w, backend="reference"), x @ w,
                               rtol=1e-5, atol=1e-5)
    y = experts.batched_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                               preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"x \[L, M, K\] and w \[L, K, N\]"):
        experts.batched_matmul(x, w[:, :6])
    with pytest.raises(TypeError, match="one dtype"):
        experts.batched_matmul(x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="sm_count"):
        experts.batched_matmul(x, w, sm_count=-1)
    with pytest.raises(ValueError, match="backend"):
        experts.batched_matmul(x, w, backend="gpu")


def test_batched_matmul_lowers_to_one_call_a_gemm():
    """The CUDA path: the forward and both gradients are jax_ep_batched_matmul calls with the
    operands' transposes and the SM count as attributes (no transposed copies)."""
    x = jnp.zeros((2, 64, 128), jnp.bfloat16)
    w = jnp.zeros((2, 128, 32), jnp.bfloat16)

    def loss(x, w):
        y = experts._cuda_gemm(x, w, 100, jnp.dtype(jnp.bfloat16), True)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_ep_batched_matmul" in ln]
    assert len(calls) == 3, calls
    flags = sorted((("trans_a = true" in ln), ("trans_b = true" in ln)) for ln in calls)
    assert flags == [(False, False), (False, True), (True, False)], calls
    assert all("sm_count = 100" in ln and "tf32 = true" in ln for ln in calls), calls
    assert "stablehlo.transpose" not in text


def test_batched_matmul_precision_picks_tf32_or_float32():
    with jax.default_matmul_precision("tensorfloat32"):
        assert experts._tf32(None)
    assert experts._tf32("bfloat16") and experts._tf32(jax.lax.Precision.DEFAULT)
    assert not experts._tf32("highest") and not experts._tf32(jax.lax.Precision.HIGHEST)
    with jax.default_matmul_precision("float32"):
        assert not experts._tf32(None)


def test_swiglu_mlp_padded_gemm_sms_on_the_reference_is_the_einsum():
    rows, wg, wu, wd, gs, _ = _inputs()
    a = experts.swiglu_mlp_padded(rows, wg, wu, wd, gs, capacity=48)
    b = experts.swiglu_mlp_padded(rows, wg, wu, wd, gs, capacity=48, gemm_sms=100)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert int(a[1]) == int(b[1])


# ----------------------------------------------------------------------------- impl="cuda"


def test_cuda_grouped_matmul_lowers_to_the_kernel_and_checks_arguments():
    """The forward and dx are jax_ep_grouped_matmul calls (dx reads w transposed, no copy of
    it) sized alike; dw is ragged_dot's transpose. Shapes the kernel cannot take are refused,
    and an SM count for another impl."""
    x = jnp.zeros((96, 128), jnp.bfloat16)
    w = jnp.zeros((4, 128, 72), jnp.bfloat16)
    gs = jnp.array([10, 0, 50, 30], jnp.int32)

    def loss(x, w):
        return jnp.sum(experts._cuda_gmm(x, w, gs, None, 100).astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_ep_grouped_matmul" in ln]
    assert sorted("transpose_w = true" in ln for ln in calls) == [False, True], calls
    assert all("sm_count = 100" in ln for ln in calls), calls
    with pytest.raises(ValueError, match="sm_count sizes impl='cuda' only"):
        experts.grouped_matmul(x, w, gs, impl="ragged_dot", sm_count=100)
    if not experts._native_gemm_available():
        with pytest.raises(RuntimeError, match="impl='cuda' needs the CUDA extension and a GPU"):
            experts.grouped_matmul(x, w, gs, impl="cuda")
    with pytest.raises(ValueError, match="impl='cuda' cannot take"):
        experts._choose("cuda", x.astype(jnp.float32), w.astype(jnp.float32))
    with pytest.raises(ValueError, match="impl='cuda' cannot take"):
        experts._choose("cuda", x[:, :100], w[:, :100])

    # rows by index: the forward takes the index as an operand and has its rows
    index = jnp.arange(60, dtype=jnp.int32)[::-1]
    text = jax.jit(lambda x, w: experts._cuda_gmm(x, w, gs, index, 0)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_ep_grouped_matmul" in ln]
    assert len(calls) == 1 and "tensor<60xi32>" in calls[0] and "-> tensor<60x72xbf16>" in calls[0]
    with pytest.raises(ValueError, match="row_index must be a 1-D integer array"):
        experts.grouped_matmul(x, w, gs, impl="ragged_dot", row_index=index.astype(jnp.float32))


def test_grouped_matmul_row_index_is_the_gathered_rows():
    """row_index: the rows x[row_index] (an index outside x's rows reads zeros), forward and
    gradients (dx summed over the rows that read the same x row)."""
    x, w, _, _, gs, _ = _inputs()
    rng = np.random.default_rng(0)
    index = jnp.asarray(rng.integers(-2, x.shape[0] // 2 + 2, size=M), jnp.int32)
    ct = jax.random.normal(jax.random.key(7), (M, F))
    f = functools.partial(experts.grouped_matmul, group_sizes=gs, impl="ragged_dot")
    got, (dx, dw) = _vjp(lambda x, w: f(x, w, row_index=index), (x, w), ct)
    x_rows = experts._gather_rows(x, index)
    want, (dx_rows, dw_w) = _vjp(f, (x_rows, w), ct)
    _close(got, want, 1e-6)
    _close(dw, dw_w, 1e-6)
    valid = np.asarray((index >= 0) & (index < x.shape[0]))
    dx_w = np.zeros(x.shape, np.float32)
    np.add.at(dx_w, np.asarray(index)[valid], np.asarray(dx_rows)[valid])
    _close(dx, dx_w, 1e-5)
    assert not np.any(np.asarray(x_rows)[~valid])


def _gpu_skip_reason():
    if jax.default_backend() != "gpu":
        return f"needs a GPU (default backend is {jax.default_backend()})"
    if not experts._native_gemm_available():
        return "needs the CUDA extension"
    return None


gpu = pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))

# groups of a decode step (a few rows each, empty ones) and larger ones (several 64-row passes)
CUDA_GROUPS = {"decode": (3, 0, 1, 7, 16, 0, 2, 5, 17, 4), "large": (300, 0, 129, 64, 1, 65)}


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("groups,k,n", [("decode", 256, 512), ("decode", 200, 136),
                                        ("large", 512, 384), ("large", 72, 1000)])
def test_gpu_cuda_grouped_matmul_vs_ragged_dot(groups, k, n, dtype):
    """Against float32 ragged_dot: forward, dx (the kernel on w transposed), dw; K and N not
    multiples of the tiles, rows past the groups zero (ragged rows there are random)."""
    sizes = CUDA_GROUPS[groups]
    total = sum(sizes)
    m = total + 37
    kx, kw, kc = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    w = (jax.random.normal(kw, (len(sizes), k, n)) * k ** -0.5).astype(dtype)
    ct = jax.random.normal(kc, (m, n), jnp.float32).astype(dtype)
    gs = jnp.array(sizes, jnp.int32)
    # few SMs: each block takes many (group, column block) items in turn
    f = jax.jit(functools.partial(experts.grouped_matmul, group_sizes=gs, impl="cuda",
                                  sm_count=3 if groups == "decode" else None))
    got, (dx, dw) = _vjp(f, (x, w), ct)
    keep = (jnp.arange(m) < total)[:, None]
    want, (dx_w, dw_w) = _vjp(lambda x, w: _ragged_f32(x, w, gs),
                              (jnp.where(keep, x, 0).astype(jnp.float32), w.astype(jnp.float32)),
                              jnp.where(keep, ct, 0).astype(jnp.float32))
    assert got.dtype == dx.dtype == dw.dtype == dtype
    _close(got, want, 1e-2, "y")
    _close(jnp.where(keep, dx, 0), dx_w, 1e-2, "dx")
    _close(dw, dw_w, 1e-2, "dw")
    assert not np.any(np.asarray(got[total:].astype(jnp.float32)))
    assert not np.any(np.asarray(dx[total:].astype(jnp.float32)))


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("groups,k,n", [("decode", 256, 512), ("large", 72, 1000)])
def test_gpu_cuda_grouped_matmul_row_index_vs_ragged_dot(groups, k, n, dtype):
    """row_index: the kernel reads x's rows by index (repeated rows, indices outside x read as
    zeros), forward, dx (summed back onto x's rows) and dw against float32 ragged_dot on the
    gathered rows."""
    sizes = CUDA_GROUPS[groups]
    total = sum(sizes)
    p = total + 11
    x_rows = max(total // 3, 4)
    kx, kw, kc = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(kx, (x_rows, k)).astype(dtype)
    w = (jax.random.normal(kw, (len(sizes), k, n)) * k ** -0.5).astype(dtype)
    ct = jax.random.normal(kc, (p, n), jnp.float32).astype(dtype)
    gs = jnp.array(sizes, jnp.int32)
    index = jnp.asarray(np.random.default_rng(1).integers(-1, x_rows + 1, size=p), jnp.int32)
    f = jax.jit(functools.partial(experts.grouped_matmul, group_sizes=gs, impl="cuda",
                                  row_index=index, sm_count=3 if groups == "decode" else None))
    got, (dx, dw) = _vjp(f, (x, w), ct)
    keep = (jnp.arange(p) < total)[:, None]

    def want_f(x, w):
        return _ragged_f32(jnp.where(keep, experts._gather_rows(x, index), 0), w, gs)

    want, (dx_w, dw_w) = _vjp(want_f, (x.astype(jnp.float32), w.astype(jnp.float32)),
                              jnp.where(keep, ct, 0).astype(jnp.float32))
    assert got.shape == (p, n) and dx.shape == x.shape
    _close(got, want, 1e-2, "y")
    _close(dx, dx_w, 1e-2, "dx")
    _close(dw, dw_w, 1e-2, "dw")
    assert not np.any(np.asarray(got[total:].astype(jnp.float32)))
