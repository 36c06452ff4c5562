"""jax_ep.nnx.MoE: forward and gradients against the dense oracle, inside a model under
nnx.jit, training with optax, and the optional-dependency contract."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="flax not installed (pip install jax_ep[flax])")

from jax_ep import moe  # noqa: E402
from jax_ep.nnx import MoE  # noqa: E402

from ep import AXIS, mesh  # noqa: E402

LB = 0.1


def experts_split(array, m):
    want = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(AXIS))
    return array.sharding.is_equivalent_to(want, array.ndim)


def ep_moe(R, *, shared_ffn=None, axis_type="Auto", **kw):
    return MoE(8, 6, 2 * R, top_k=2, shared_ffn=shared_ffn, axis_name=AXIS,
               mesh=mesh(R, axis_type=axis_type), backend="reference",
               router_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(R), **kw)


# Explicit: jax.make_mesh's default axis type from jax 0.7, x replicated or split by batch
@pytest.mark.parametrize("shared_ffn,axis_type,x_spec", [
    (None, "Auto", None), (4, "Auto", None), (4, "Explicit", None), (None, "Explicit", AXIS)])
def test_forward_and_grads_match_dense(shared_ffn, axis_type, x_spec):
    R = 4
    if axis_type == "Explicit" and not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    layer = ep_moe(R, shared_ffn=shared_ffn, axis_type=axis_type)
    m = mesh(R, axis_type=axis_type)
    assert experts_split(layer.w_gate[...], m)
    assert layer.router[...].sharding.is_fully_replicated
    x = jax.random.normal(jax.random.key(1), (R, 3, 8))  # [batch, seq, H]: 3 tokens per rank
    target = jax.random.normal(jax.random.key(2), x.shape)
    if x_spec is not None:
        x = jax.device_put(x, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(x_spec)))

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum((y - target) ** 2) + LB * aux.load_balancing_loss, (y, aux)

    with jax.set_mesh(m) if axis_type == "Explicit" else contextlib.nullcontext():
        (got_loss, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
    if axis_type == "Explicit":  # y leaves split as x came in
        spec = jax.sharding.PartitionSpec(x_spec)
        assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(m, spec), y.ndim)

    def dense(params, x):
        y, aux = moe.dense_moe_layer(x.reshape(-1, 8), params, top_k=2)
        y = y.reshape(x.shape)
        return jnp.sum((y - target) ** 2) + LB * aux.load_balancing_loss, (y, aux)

    # the oracle on one device, from plain copies (not the mesh's Explicit-typed arrays)
    params = jax.tree.map(np.asarray, layer.moe_params())
    (want_loss, (want_y, want_aux)), want = jax.value_and_grad(dense, has_aux=True)(
        params, np.asarray(x))
    assert y.shape == x.shape
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_array_equal(aux.tokens_per_expert, want_aux.tokens_per_expert)
    np.testing.assert_allclose(aux.load_balancing_loss, want_aux.load_balancing_loss, rtol=1e-5)
    for name in moe.MoEParams._fields:
        if getattr(params, name) is None:
            assert getattr(layer, name) is None
            continue
        np.testing.assert_allclose(grads[name][...], getattr(want, name), rtol=2e-4, atol=2e-5,
                                   err_msg=f"d loss / d {name}")


def test_decode_matches_dense_and_the_layer():
    """MoE.decode (the low-latency calls, float32 on the wire here): the dense layer's output
    and gradients, and the same as calling the module."""
    R = 2
    layer = ep_moe(R, shared_ffn=4)
    x = jax.random.normal(jax.random.key(3), (R * 3, 8))
    target = jax.random.normal(jax.random.key(4), x.shape)

    def loss(layer, x):
        y, _ = layer.decode(x, use_fp8=False, max_tokens_per_rank=4)
        return jnp.sum((y - target) ** 2), y

    (got_loss, y), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
    params = jax.tree.map(np.asarray, layer.moe_params())

    def dense(params, x):
        y, _ = moe.dense_moe_layer(x, params, top_k=2)
        return jnp.sum((y - target) ** 2), y

    (want_loss, want_y), want = jax.value_and_grad(dense, has_aux=True)(params, np.asarray(x))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x)[0])(layer, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name in moe.MoEParams._fields:
        np.testing.assert_allclose(grads[name][...], getattr(want, name), rtol=2e-4, atol=2e-5,
                                   err_msg=f"d loss / d {name}")


class Model(nnx.Module):
    """in-projection -> residual MoE -> out-projection: a regression model on random tokens."""

    def __init__(self, H, R, rngs):
        self.inp = nnx.Linear(H, H, rngs=rngs)
        self.moe = MoE(H, 16, 2 * R, top_k=2, shared_ffn=8, axis_name=AXIS,
                       backend="reference", rngs=rngs)
        self.out = nnx.Linear(H, H, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        y, aux = self.moe(h)
        return self.out(h + y), aux


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_trains_inside_a_model_under_nnx_jit(axis_type):
    optax = pytest.importorskip("optax", reason="optax not installed")
    if axis_type == "Explicit" and not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    R, T, H = 4, 8, 8
    m = mesh(R, axis_type=axis_type)
    with jax.set_mesh(m):  # no mesh= given: the module takes the current one
        model = Model(H, R, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    key = jax.random.key(3)
    x = jax.random.normal(key, (R * T, H))
    w = jax.random.normal(jax.random.fold_in(key, 1), (H, H)) / np.sqrt(H)
    target = jnp.tanh(x @ w)

    @nnx.jit
    def step(model, opt, x, target):
        def loss_fn(model):
            y, aux = model(x)
            return jnp.mean((y - target) ** 2) + 0.01 * aux.load_balancing_loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    with jax.set_mesh(m):
        losses = [float(step(model, opt, x, target)) for _ in range(8)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    assert experts_split(model.moe.w_gate[...], m)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs a mesh"):
        MoE(8, 6, 8, top_k=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divisible"):
        MoE(8, 6, 6, top_k=2, axis_name=AXIS, mesh=mesh(4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not an axis"):
        MoE(8, 6, 8, top_k=2, axis_name="experts", mesh=mesh(4), rngs=nnx.Rngs(0))


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)


def test_import_jax_ep_does_not_import_flax_and_missing_flax_is_explained():
    run = _python("import sys, jax_ep; assert 'flax' not in sys.modules, 'flax imported'")
    assert run.returncode == 0, run.stderr
    run = _python("import sys; sys.modules['flax'] = None; import jax_ep.nnx")
    assert run.returncode != 0 and "pip install jax_ep[flax]" in run.stderr, run.stderr


def test_token_axes_run_one_ep_group_per_data_index():
    """On a (data=2, ep=4) mesh with token_axes=("data", "ep"): each data index's tokens go
    through its own EP group; outputs and grads equal the dense layer's, the counts cover
    both groups and the losses are the groups' mean."""
    m = jax.make_mesh((2, 4), ("data", AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layer = MoE(8, 6, 8, top_k=2, axis_name=AXIS, mesh=m, backend="reference",
                token_axes=("data", AXIS), router_init=nnx.initializers.normal(1.0),
                rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (16, 8))  # 2 tokens per device
    target = jax.random.normal(jax.random.key(5), x.shape)

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum((y - target) ** 2), (y, aux)

    (got_loss, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
    params = layer.moe_params()

    def dense(params, x):
        y, _ = moe.dense_moe_layer(x, params, top_k=2)
        return jnp.sum((y - target) ** 2), y

    (want_loss, want_y), want = jax.value_and_grad(dense, has_aux=True)(params, x)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(grads[name][...], getattr(want, name), rtol=2e-4, atol=2e-5,
                                   err_msg=f"d loss / d {name}")
    halves = [moe.dense_moe_layer(x[g * 8:(g + 1) * 8], params, top_k=2)[1] for g in (0, 1)]
    np.testing.assert_array_equal(aux.tokens_per_expert, halves[0].tokens_per_expert
                                  + halves[1].tokens_per_expert)
    np.testing.assert_allclose(aux.load_balancing_loss, (halves[0].load_balancing_loss
                                                         + halves[1].load_balancing_loss) / 2,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="token_axes"):
        MoE(8, 6, 8, top_k=2, axis_name=AXIS, mesh=m, token_axes=("data",), rngs=nnx.Rngs(0))
