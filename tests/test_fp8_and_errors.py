"""FP8 quantisation bounds, FP8 dispatch, and trace-time validation of every argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep

import oracle
from ep import AXIS, run
from test_reference import assert_matches_oracle, make_inputs

# jax.enable_x64 is jax >= 0.8; before that it was jax.experimental.enable_x64.
enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_round_trip_error_bound(ue8m0):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 384)) * np.exp(rng.uniform(-6, 6, (64, 1)))).astype(np.float32)
    x[3, :128] = 0.0  # an all-zero block must survive
    data, scales = jax_ep.quantize_fp8(jnp.asarray(x), ue8m0=ue8m0)
    assert data.dtype == jnp.float8_e4m3fn and scales.shape == (64, 3)
    back = np.asarray(jax_ep.dequantize_fp8(data, scales))
    s = np.repeat(np.asarray(scales), 128, axis=1)
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding error 2^-4), subnormal step 2^-9
    bound = np.abs(x) * 2.0 ** -4 + s * 2.0 ** -10
    assert (np.abs(back - x) <= bound * (1 + 1e-6)).all()
    np.testing.assert_array_equal(back[3, :128], 0.0)
    if ue8m0:
        m, _ = np.frexp(np.asarray(scales))
        assert (m == 0.5).all(), "UE8M0 scales are powers of two"
    # leading axes (a low-latency dispatch's [L, R*M, H] rows): row by row the same
    blocks = jax_ep.dequantize_fp8(data.reshape(4, 16, 384), scales.reshape(4, 16, 3))
    np.testing.assert_array_equal(np.asarray(blocks).reshape(64, 384), back)
    with pytest.raises(ValueError, match="scales must be"):
        jax_ep.dequantize_fp8(data.reshape(4, 16, 384), scales)
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert 1e-3 < rel < 0.05


@pytest.mark.parametrize("layout", ["rank_major", "expert_major", "source_slots"])
def test_fp8_dispatch_moves_data_and_scales_exactly(layout):
    R, T, H, K, E = 4, 10, 256, 3, 8
    rng = np.random.default_rng(2)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    data, scales = jax.vmap(jax_ep.quantize_fp8)(jnp.asarray(x))
    data_bits = np.asarray(data).view(np.uint8)

    def fn(data, scales, idx, w):
        return jax_ep.dispatch((data, scales), idx, w, num_experts=E, axis_name=AXIS,
                               layout=layout, backend="reference")

    out = run(fn, R, data, scales, idx, w)
    C = out.x.shape[1]
    want, slot = oracle.dispatch(data_bits, idx, w, E, C, layout, x_scales=np.asarray(scales))
    bits = out._replace(x=np.asarray(out.x).view(np.uint8))
    assert_matches_oracle(bits, want, slot)
    for r in range(R):
        np.testing.assert_array_equal(out.x_scales[r], want[r]["x_scales"])


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_dispatch_use_fp8_is_dispatch_of_quantize_fp8(layout, ue8m0):
    """use_fp8 quantises on the way: the same bits as dispatching quantize_fp8's pair; no
    gradient reaches x (as with a pair), the weights' does."""
    R, T, H, K, E = 2, 12, 256, 3, 8
    x, idx, w = make_inputs(np.random.default_rng(5), R, T, H, K, E, "random", 0.2)

    def fn(x, idx, w):
        kw = dict(num_experts=E, axis_name=AXIS, layout=layout, backend="reference")
        on_the_way = jax_ep.dispatch(x, idx, w, use_fp8=True, ue8m0=ue8m0, **kw)
        pair = jax_ep.dispatch(jax_ep.quantize_fp8(x, ue8m0=ue8m0), idx, w, **kw)

        def loss(x, w):
            out = jax_ep.dispatch(x, idx, w, use_fp8=True, **kw)
            return jnp.sum(out.topk_weights * 2.0)

        return on_the_way, pair, jax.grad(loss, argnums=(0, 1))(x, w)

    on_the_way, pair, (dx, dw) = run(fn, R, x, idx, w)
    assert on_the_way.x.dtype == jnp.float8_e4m3fn
    for a, b in zip(jax.tree.leaves(on_the_way), jax.tree.leaves(pair)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == jnp.float8_e4m3fn:
            a, b = a.view(np.uint8), b.view(np.uint8)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(dx, 0.0)
    assert np.abs(dw).sum() > 0


# ------------------------------------------------------------------------ validation

def _dispatch_error(*, x=None, idx=None, w=None, R=2, **kwargs):
    T, H, K = 4, 8, 2
    x = np.ones((R, T, H), np.float32) if x is None else x
    idx = np.zeros((R, T, K), np.int32) if idx is None else idx
    w = np.ones((R, T, K), np.float32) if w is None else w
    kwargs.setdefault("num_experts", 4)
    kwargs.setdefault("backend", "reference")

    def fn(x, idx, w):
        return jax_ep.dispatch(x, idx, w, axis_name=AXIS, **kwargs).x

    run(fn, R, x, idx, w)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=np.ones((2, 4, 8), np.int32)), TypeError, "bfloat16, float16 or float32"),
    (dict(x=np.ones((2, 4, 8, 3), np.float32)), ValueError, r"x must be \[tokens, hidden\]"),
    (dict(idx=np.zeros((2, 4, 2), np.float32)), TypeError, "integer"),
    (dict(idx=np.zeros((2, 5, 2), np.int32)), ValueError, "5 tokens but x has 4"),
    (dict(w=np.ones((2, 4, 3), np.float32)), ValueError, "must match topk_idx shape"),
    (dict(w=np.ones((2, 4, 2), np.int32)), TypeError, "floating point"),
    (dict(num_experts=5), ValueError, "not divisible by the expert-parallel size 2"),
    (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
    (dict(capacity=0), ValueError, "capacity must be >= 1"),
    (dict(capacity=2.5), TypeError, "capacity must be a Python or NumPy integer"),
    (dict(layout="by_token"), ValueError, "layout must be one of"),
    (dict(layout="expert_major", expert_alignment=0), ValueError, "expert_alignment must be >= 1"),
    (dict(expert_alignment=4), ValueError, "applies to layout='expert_major' only"),
    (dict(backend="tpu"), ValueError, "backend must be one of"),
    (dict(use_fp8=True), ValueError, "use_fp8 needs hidden divisible by 128"),
    (dict(ue8m0=True), ValueError, "ue8m0 applies with use_fp8=True only"),
])
def test_bad_dispatch_arguments_fail_at_trace_time(kwargs, error, match):
    with pytest.raises(error, match=match):
        _dispatch_error(**kwargs)


def test_bad_fp8_inputs():
    R, T, H = 2, 4, 256

    def attempt(data, scales):
        def fn(data, scales, idx):
            return jax_ep.dispatch((data, scales), idx, num_experts=2, axis_name=AXIS,
                                   backend="reference").x

        run(fn, R, data, scales, np.zeros((R, T, 1), np.int32))

    good = np.zeros((R, T, H), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        attempt(np.zeros((R, T, H), np.float32), np.ones((R, T, 2), np.float32))
    with pytest.raises(ValueError, match="FP8 scales must be float32"):
        attempt(good, np.ones((R, T, 3), np.float32))
    with pytest.raises(ValueError, match="hidden divisible by 128"):
        attempt(np.zeros((R, T, 100), jnp.float8_e4m3fn), np.ones((R, T, 1), np.float32))

    def quantise_a_pair(data, scales, idx):
        return jax_ep.dispatch((data, scales), idx, num_experts=2, axis_name=AXIS,
                               use_fp8=True, backend="reference").x

    with pytest.raises(ValueError, match="use_fp8 quantises x itself"):
        run(quantise_a_pair, R, good, np.ones((R, T, 2), np.float32),
            np.zeros((R, T, 1), np.int32))


def test_bad_combine_arguments():
    R, T, H, K, E = 2, 4, 8, 2, 4
    x, idx, w = make_inputs(np.random.default_rng(0), R, T, H, K, E)

    def attempt(make_y, weights=None, handle=True):
        def fn(x, idx, w):
            o = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend="reference")
            return jax_ep.combine(make_y(o), o.handle if handle else (1, 2), weights=weights)

        run(fn, R, x, idx, w)

    with pytest.raises(ValueError, match=r"y must be \[capacity=8, hidden\]"):
        attempt(lambda o: o.x[:3])
    with pytest.raises(TypeError, match="y must be bfloat16"):
        attempt(lambda o: o.x.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"weights must be \[capacity=8\]"):
        attempt(lambda o: o.x, weights=jnp.ones((3,)))
    with pytest.raises(TypeError, match="DispatchHandle"):
        attempt(lambda o: o.x, handle=False)


def test_out_of_range_ids_are_reported_when_concrete():
    idx = np.array([[0, 3], [4, -1]], np.int32)
    with pytest.raises(ValueError, match=r"1 ids outside \[-1, 4\)"):
        jax_ep.get_dispatch_layout(idx, 4, num_ranks=2, backend="reference")
    got = jax_ep.get_dispatch_layout(np.array([[0, 3], [2, -1]], np.int32), 4, num_ranks=2,
                                     backend="reference")
    np.testing.assert_array_equal(got.num_tokens_per_rank, [1, 2])
    np.testing.assert_array_equal(got.num_tokens_per_expert, [1, 0, 1, 1])


def test_dispatch_outside_shard_map_is_a_clear_error():
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jax_ep.dispatch(jnp.ones((4, 8)), jnp.zeros((4, 2), jnp.int32), num_experts=4,
                        axis_name="ep", backend="reference")


def test_cuda_backend_request_without_gpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the CUDA backend may legitimately run")

    def fn(x, idx):
        return jax_ep.dispatch(x, idx, num_experts=2, axis_name=AXIS, backend="cuda").x

    with pytest.raises(RuntimeError, match="backend='cuda' cannot run"):
        run(fn, 2, np.ones((2, 4, 8), np.float32), np.zeros((2, 4, 1), np.int32))


def test_wide_traced_ids_out_of_range_count_as_no_expert():
    """int64 ids are narrowed to int32 for the kernels: an id past int32 must not wrap into a
    valid expert (2**32 + 1 would become expert 1)."""
    R, T, H, K, E = 2, 2, 4, 1, 4
    with enable_x64(True):
        def fn(x, idx):
            return jax_ep.dispatch(x, idx, num_experts=E, axis_name=AXIS,
                                   backend="reference").tokens_per_expert

        wide = np.full((R, T, K), 2 ** 32 + 1, np.int64)
        np.testing.assert_array_equal(run(fn, R, np.ones((R, T, H), np.float32), wide), 0)
        fine = np.full((R, T, K), 1, np.int64)
        got = run(fn, R, np.ones((R, T, H), np.float32), fine)
        np.testing.assert_array_equal(got, [[0, R * T], [0, 0]])


def test_layout_needs_a_positive_rank_count():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        jax_ep.get_dispatch_layout(np.zeros((2, 1), np.int32), 4, num_ranks=0,
                                   backend="reference")


def test_low_latency_calls_take_no_stream():
    R, T, H, K = 2, 4, 128, 2

    def fn(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, num_experts=4, axis_name=AXIS,
                                           max_tokens_per_rank=T, use_fp8=False,
                                           backend="reference",
                                           config=jax_ep.Config(stream=1)).x

    with pytest.raises(ValueError, match="Config.stream applies to dispatch and combine"):
        run(fn, R, np.ones((R, T, H), np.float32), np.zeros((R, T, K), np.int32))


def test_auto_takes_the_reference_on_a_mesh_of_host_devices(monkeypatch):
    """In a process whose CUDA backend runs, a program on the host's devices (an oracle, a CPU
    mesh) gets the reference from "auto", not custom calls the host platform lacks."""
    from jax_ep import api
    from jax_ep._mesh import traced_platform

    R, T, H, K, E = 2, 8, 256, 2, 4
    host = jax.devices("cpu")[:R]
    if len(host) < R:
        pytest.skip(f"needs {R} host devices")

    def on_host(fn, *args):
        return run(fn, R, *args, devices=host)

    seen = []
    on_host(lambda a: (seen.append(traced_platform()), a)[1], np.zeros((R, 1), np.float32))
    if seen[0] is None:
        pytest.skip("this jax's abstract mesh does not name its devices' platform")
    x, idx, w = make_inputs(np.random.default_rng(5), R, T, H, K, E, "random", 0.0)

    def fn(backend):
        def call(x, idx, w):
            data, scales = jax_ep.quantize_fp8(x, backend=backend)
            out = jax_ep.dispatch((data, scales), idx, w, num_experts=E, axis_name=AXIS,
                                  backend=backend)
            return data, scales, out.x
        return call

    want = on_host(fn("reference"), x, idx, w)
    monkeypatch.setattr(api, "cuda_available", lambda: (True, ""))  # as in a GPU process
    got = on_host(fn("auto"), x, idx, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_config_naming_auto_takes_the_backend_auto_resolves_to():
    # handles and configs built outside the public calls (benchmarks, saved handles) may keep
    # "auto": it must mean what it means in the public calls, never silently the reference
    from jax_ep import api

    resolved = api._resolve_backend("auto")
    assert api._backend_module("auto") is api._backend_module(resolved)
    # a backend's own name is taken as it is: "cuda" lowers where the extension cannot run
    assert api._backend_module("cuda") is api._cuda_module()
    assert api._backend_module("reference") is api._reference
    with pytest.raises(ValueError, match="backend must be one of"):
        api._backend_module("tpu")
