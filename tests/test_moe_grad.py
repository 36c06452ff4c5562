"""A full MoE block (router, top-k, dispatch, experts, combine) against a dense oracle."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe

from ep import AXIS, mesh


def make_params(key, H, F, E):
    k1, k2, k3 = jax.random.split(key, 3)
    return dict(
        router=jax.random.normal(k1, (H, E), jnp.float32),
        w_in=jax.random.normal(k2, (E, H, F), jnp.float32) / np.sqrt(H),
        w_out=jax.random.normal(k3, (E, F, H), jnp.float32) / np.sqrt(F),
    )


def ep_loss_fn(R, top_k, layout, capacity=None, alignment=1, axis_type="Auto"):
    m = mesh(R, axis_type=axis_type)
    specs = dict(router=P(), w_in=P(AXIS), w_out=P(AXIS))

    @jax.jit
    @partial(jax.shard_map, mesh=m, in_specs=(specs, P(AXIS), P(AXIS)), out_specs=(P(), P()))
    def loss(params, x, target):
        out, dropped = moe.moe_block(x, params["router"], params["w_in"], params["w_out"],
                                     top_k=top_k, axis_name=AXIS, layout=layout,
                                     capacity=capacity, expert_alignment=alignment,
                                     backend="reference")
        return (jax.lax.psum(jnp.sum((out - target) ** 2), AXIS),
                jax.lax.psum(dropped, AXIS))

    def place(params, x, target):
        put = lambda a, s: jax.device_put(a, NamedSharding(m, s))  # noqa: E731
        return ({k: put(v, specs[k]) for k, v in params.items()}, put(x, P(AXIS)),
                put(target, P(AXIS)))

    return loss, place


def dense_loss(params, x, target, top_k):
    out = moe.dense_moe_block(x, params["router"], params["w_in"], params["w_out"], top_k=top_k)
    return jnp.sum((out - target) ** 2)


@pytest.mark.parametrize("layout,alignment", [("expert_major", 1), ("expert_major", 8),
                                              ("rank_major", 1), ("source_slots", 1)])
@pytest.mark.parametrize("R,E,top_k", [(2, 6, 2), (4, 12, 3), (8, 16, 4)])
def test_moe_forward_and_grad_match_dense(R, E, top_k, layout, alignment):
    _check_against_dense(R, E, top_k, layout, alignment)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_moe_forward_and_grad_on_explicit_mesh_axes_match_dense(layout):
    """jax.make_mesh's default axis type (jax 0.7 on), under the mesh context that explicit
    sharding asks of programs: the same values and gradients."""
    if not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    with jax.set_mesh(mesh(4, axis_type="Explicit")):
        _check_against_dense(4, 12, 3, layout, 1, axis_type="Explicit")


def _check_against_dense(R, E, top_k, layout, alignment, axis_type="Auto"):
    T, H, F = 8, 12, 10
    key = jax.random.key(R * 10 + top_k)
    params = make_params(key, H, F, E)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    target = jax.random.normal(jax.random.fold_in(key, 2), (R * T, H), jnp.float32)
    loss, place = ep_loss_fn(R, top_k, layout, alignment=alignment, axis_type=axis_type)
    args = place(params, x, target)

    (got_loss, dropped) = loss(*args)
    want_loss = dense_loss(params, x, target, top_k)
    assert int(dropped) == 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)

    got = jax.grad(lambda p, x: loss(p, x, args[2])[0], argnums=(0, 1))(args[0], args[1])
    want = jax.grad(dense_loss, argnums=(0, 1))(params, x, target, top_k)
    for name in params:
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=2e-4, atol=2e-5,
                                   err_msg=f"d loss / d {name}")
    np.testing.assert_allclose(got[1], want[1], rtol=2e-4, atol=2e-5, err_msg="d loss / d x")


def test_dropped_rows_contribute_zero_and_are_counted():
    R, E, top_k, T, H, F = 4, 8, 2, 16, 8, 6
    key = jax.random.key(0)
    params = make_params(key, H, F, E)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    target = jnp.zeros_like(x)
    small, place = ep_loss_fn(R, top_k, "expert_major", capacity=12)
    full, _ = ep_loss_fn(R, top_k, "expert_major")
    args = place(params, x, target)
    loss_small, dropped = small(*args)
    loss_full, none = full(*args)
    assert int(dropped) > 0 and int(none) == 0
    assert float(loss_small) < float(loss_full)  # fewer expert outputs reach the tokens
    grads = jax.grad(lambda p: small(p, args[1], args[2])[0])(args[0])
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def fd_loss(x, idx, w, E, m):
    """sum(combine(sin(rows) * w_row^2, weights=w_row)^2) over all ranks: nonlinear in x and w."""

    def per_rank(x, idx, w):
        o = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, axis_name=AXIS,
                            layout="expert_major", backend="reference")
        y = jnp.sin(o.x) * (o.topk_weights ** 2)[:, None]
        out = jax_ep.combine(y, o.handle, weights=o.topk_weights)
        return jax.lax.psum(jnp.sum(out ** 2), AXIS)

    return jax.shard_map(per_rank, mesh=m, in_specs=(P(AXIS),) * 3, out_specs=P())(x, idx, w)


def test_dispatch_and_combine_grads_against_finite_differences():
    R, T, H, K, E = 2, 5, 4, 2, 4
    rng = np.random.default_rng(1)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(R)]).astype(np.int32)
    w = (rng.random((R, T, K)) + 0.5).astype(np.float32)
    # float32 end to end (the contract's accumulation type): central differences
    m = mesh(R)
    sh = NamedSharding(m, P(AXIS))
    put = lambda a: jax.device_put(jnp.asarray(a), sh)  # noqa: E731
    loss = jax.jit(lambda x, w: fd_loss(x, put(idx), w, E, m))
    grads = jax.grad(loss, argnums=(0, 1))(put(x), put(w))
    eps = 1e-2
    for which, arr in enumerate((x, w)):
        for pos in [(0, 0, 0), (1, 3, 1), (0, 4, 1)]:
            d = np.zeros_like(arr)
            d[pos] = eps
            plus, minus = [x, w], [x, w]
            plus[which], minus[which] = arr + d, arr - d
            numeric = (loss(*map(put, plus)) - loss(*map(put, minus))) / (2 * eps)
            np.testing.assert_allclose(np.asarray(grads[which])[pos], numeric, rtol=2e-3,
                                       atol=1e-3)

