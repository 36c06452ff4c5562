"""moe_layer (router, dispatch, SwiGLU experts, combine, shared expert, aux losses) against a
dense one-device oracle and a direct NumPy computation of the router statistics."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import moe

from ep import AXIS, mesh

LB, Z = 0.3, 0.01  # aux-loss coefficients in the test loss: their gradients are checked too


def make_params(key, H, F, E, S=None):
    k = jax.random.split(key, 7)
    shared = ()
    if S:
        shared = (jax.random.normal(k[4], (H, S)) / np.sqrt(H),
                  jax.random.normal(k[5], (H, S)) / np.sqrt(H),
                  jax.random.normal(k[6], (S, H)) / np.sqrt(S))
    return moe.MoEParams(jax.random.normal(k[0], (H, E)),
                         jax.random.normal(k[1], (E, H, F)) / np.sqrt(H),
                         jax.random.normal(k[2], (E, H, F)) / np.sqrt(H),
                         jax.random.normal(k[3], (E, F, H)) / np.sqrt(F), *shared)


def ep_fns(R, params, layer_fn=moe.moe_layer, **kw):
    """(forward: (params, x) -> (y, aux); value_and_grad: (params, x, target) ->
    ((loss, (y, aux)), (d params, d x)); place), each one compiled program."""
    m = mesh(R)
    specs = params.partition_specs(AXIS)
    layer = partial(layer_fn, axis_name=AXIS, backend="reference", **kw)

    @partial(jax.shard_map, mesh=m, in_specs=(specs, P(AXIS)), out_specs=(P(AXIS), P()))
    def forward(params, x):
        return layer(x, params)

    @partial(jax.shard_map, mesh=m, in_specs=(specs, P(AXIS), P(AXIS)),
             out_specs=(P(), (P(AXIS), P())))
    def loss(params, x, target):
        y, aux = layer(x, params)
        err = jax.lax.psum(jnp.sum((y.astype(jnp.float32) - target) ** 2), AXIS)
        return err + LB * aux.load_balancing_loss + Z * aux.router_z_loss, (y, aux)

    def place(params, *arrays):
        put = lambda a, s: jax.device_put(a, NamedSharding(m, s))  # noqa: E731
        return (jax.tree.map(put, params, specs), *(put(a, P(AXIS)) for a in arrays))

    return (jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)),
            place)


@partial(jax.jit, static_argnames=("top_k", "renormalize"))
@partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
def dense_value_and_grad(params, x, target, **kw):
    y, aux = moe.dense_moe_layer(x, params, **kw)
    err = jnp.sum((y.astype(jnp.float32) - target) ** 2)
    return err + LB * aux.load_balancing_loss + Z * aux.router_z_loss, (y, aux)


def assert_grads_close(params, got, want):
    """(d params, d x) of the EP layer against the dense layer's."""
    for name in params._fields:
        if getattr(params, name) is None:
            continue
        np.testing.assert_allclose(getattr(got[0], name), getattr(want[0], name), rtol=2e-4,
                                   atol=2e-5, err_msg=f"d loss / d {name}")
    np.testing.assert_allclose(got[1], want[1], rtol=2e-4, atol=2e-5, err_msg="d loss / d x")


def numpy_router_stats(x, router, top_k):
    """tokens per expert and E * sum_e f_e P_e, straight from the definitions."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    E = router.shape[1]
    counts = np.bincount(chosen.ravel(), minlength=E)
    f = counts / chosen.size
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    return counts, E * np.sum(f * probs.mean(0)), np.mean(lse ** 2)


CASES = [  # R, E, top_k, shared expert width, renormalize, expert_alignment, capacity factor
    (4, 8, 2, None, True, 1, None),
    (4, 8, 2, 6, True, 1, None),
    (8, 8, 3, 5, False, 4, None),
    (4, 8, 2, 6, True, 4, 8.0),  # padded expert blocks, large enough that nothing drops
]


@pytest.mark.parametrize("shared_beside", [False, True])
@pytest.mark.parametrize("R,E,top_k,S,renormalize,alignment,factor", CASES)
def test_forward_grads_and_aux_match_dense(R, E, top_k, S, renormalize, alignment, factor,
                                           shared_beside):
    if shared_beside and not S:
        pytest.skip("no shared expert")
    T, H, F = 6, 8, 10
    key = jax.random.key(R * 100 + E + top_k)
    params = make_params(key, H, F, E, S)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    target = jax.random.normal(jax.random.fold_in(key, 2), (R * T, H), jnp.float32)
    kw = dict(top_k=top_k, renormalize=renormalize)
    _, value_and_grad, place = ep_fns(R, params, expert_alignment=alignment,
                                      capacity_factor=factor, shared_beside=shared_beside, **kw)

    (loss, (y, aux)), got = value_and_grad(*place(params, x, target))
    (want_loss, (want_y, want_aux)), want = dense_value_and_grad(params, x, target, **kw)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    counts, balance, z_loss = numpy_router_stats(x, params.router, top_k)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    assert aux.tokens_per_expert.shape == (E,) and int(aux.tokens_per_expert.sum()) == R * T * top_k
    np.testing.assert_allclose(aux.load_balancing_loss, balance, rtol=1e-5)
    np.testing.assert_allclose(aux.router_z_loss, z_loss, rtol=1e-5)
    np.testing.assert_allclose(want_aux.load_balancing_loss, balance, rtol=1e-5)
    assert int(aux.num_dropped) == 0

    assert_grads_close(params, got, want)


@pytest.mark.parametrize("R,E,top_k,S,renormalize", [(4, 8, 2, None, True),
                                                     (2, 8, 3, 6, False)])
def test_decode_layer_forward_grads_and_aux_match_dense(R, E, top_k, S, renormalize):
    """decode_layer (low-latency records dispatch, grouped GEMMs reading the rows by index,
    low-latency combine) in float32 on the wire: the dense layer's values and gradients."""
    T, H, F = 6, 8, 10
    key = jax.random.key(R * 10 + E + top_k)
    params = make_params(key, H, F, E, S)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    target = jax.random.normal(jax.random.fold_in(key, 2), (R * T, H), jnp.float32)
    kw = dict(top_k=top_k, renormalize=renormalize)
    _, value_and_grad, place = ep_fns(R, params, moe.decode_layer, use_fp8=False,
                                      max_tokens_per_rank=T + 2, **kw)
    (loss, (y, aux)), got = value_and_grad(*place(params, x, target))
    (want_loss, (want_y, want_aux)), want = dense_value_and_grad(params, x, target, **kw)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_array_equal(aux.tokens_per_expert, want_aux.tokens_per_expert)
    np.testing.assert_allclose(aux.load_balancing_loss, want_aux.load_balancing_loss, rtol=1e-5)
    assert int(aux.num_dropped) == 0
    assert_grads_close(params, got, want)


def test_decode_layer_fp8_matches_dense_to_fp8_rounding():
    """FP8 on the wire (the default): the dense layer on the FP8-rounded tokens, exactly as
    far as the experts go; no gradient reaches x through them."""
    from jax_ep import fp8

    R, T, H, F, E, top_k = 2, 4, 128, 16, 8, 2
    key = jax.random.key(8)
    params = make_params(key, H, F, E, S=8)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    forward, _, place = ep_fns(R, params, moe.decode_layer, top_k=top_k)
    y, _ = forward(*place(params, x))
    rounded = fp8.dequantize_fp8(*fp8.quantize_fp8(x))
    shared = moe.shared_expert(x, params.shared_gate, params.shared_up, params.shared_down)
    no_shared = params._replace(shared_gate=None, shared_up=None, shared_down=None)
    # routed on x, the experts on the rounded rows
    idx, gates, _, _ = moe.router(x, params.router, top_k)
    every = jax.vmap(lambda e: jax.vmap(lambda r: experts_row(no_shared, e, r))(rounded))(
        jnp.arange(E))  # [E, T, H]
    picked = every[idx, jnp.arange(R * T)[:, None]]  # [T, K, H]
    want = jnp.sum(gates[..., None] * picked, axis=1) + shared
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def experts_row(params, e, row):
    h = jax.nn.silu(row @ params.w_gate[e]) * (row @ params.w_up[e])
    return h @ params.w_down[e]


def test_load_balancing_loss_is_one_when_uniform():
    """A zero router gives every expert probability 1/E; with f uniform the loss is exactly 1."""
    R, T, H, F, E = 4, 8, 4, 4, 8
    params = make_params(jax.random.key(0), H, F, E)._replace(router=jnp.zeros((H, E)))
    x = jnp.ones((R * T, H))
    forward, _, place = ep_fns(R, params, top_k=E)  # every token picks every expert
    _, aux = forward(*place(params, x))
    np.testing.assert_array_equal(aux.tokens_per_expert, np.full(E, R * T))
    np.testing.assert_allclose(aux.load_balancing_loss, 1.0, rtol=1e-6)


def test_capacity_factor_drops_and_counts():
    R, T, H, F, E, top_k = 4, 16, 8, 6, 8, 2
    key = jax.random.key(3)
    # a skewed router: most tokens pick the same experts, so a small capacity overflows
    params = make_params(key, H, F, E, S=4)
    params = params._replace(router=params.router.at[:, :2].add(3.0))
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H), jnp.float32)
    full, _, place = ep_fns(R, params, top_k=top_k)
    _, small, _ = ep_fns(R, params, top_k=top_k, capacity_factor=1.0)
    args = place(params, x, jnp.zeros_like(x))
    y_full, aux_full = full(*args[:2])
    (_, (y_small, aux_small)), grads = small(*args)
    assert int(aux_full.num_dropped) == 0 and int(aux_small.num_dropped) > 0
    # capacity never changes the router's statistics
    np.testing.assert_array_equal(aux_small.tokens_per_expert, aux_full.tokens_per_expert)
    assert not np.allclose(y_small, y_full)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_bfloat16_tokens_with_float32_weights():
    R, T, H, F, E, S = 4, 4, 8, 8, 8, 4
    key = jax.random.key(5)
    params = make_params(key, H, F, E, S)
    x = jax.random.normal(jax.random.fold_in(key, 1), (R * T, H)).astype(jnp.bfloat16)
    forward, _, place = ep_fns(R, params, top_k=2)
    y, _ = forward(*place(params, x))
    # float32 oracle: XLA:CPU has no batched bf16 x bf16 -> f32 dot for a bf16 one
    want, _ = moe.dense_moe_layer(x.astype(jnp.float32), params, top_k=2)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                               rtol=3e-2, atol=3e-2)


def test_argument_errors():
    params = make_params(jax.random.key(0), 4, 4, 8)
    m = mesh(4)

    def run(**kw):
        f = jax.shard_map(partial(moe.moe_layer, axis_name=AXIS, backend="reference", **kw),
                          mesh=m, in_specs=(P(AXIS), params.partition_specs(AXIS)),
                          out_specs=(P(AXIS), P()))
        return f(jnp.ones((16, 4)), params)

    with pytest.raises(ValueError, match="capacity or capacity_factor"):
        run(top_k=2, capacity=8, capacity_factor=1.0)
    with pytest.raises(ValueError, match="router must be"):
        jax.shard_map(partial(moe.moe_layer, axis_name=AXIS, top_k=2), mesh=m,
                      in_specs=(P(AXIS), params.partition_specs(AXIS)), out_specs=(P(AXIS), P()))(
            jnp.ones((16, 4)), params._replace(router=jnp.ones((4, 6))))
