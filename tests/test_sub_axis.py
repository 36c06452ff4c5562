"""Expert parallelism on one axis of a two-axis mesh (data x expert): every EP group (one per
data index) dispatches and combines at once over its own devices. The reference backend against
the dense one-device oracle; forward, gradients and the per-group auxiliary counts."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_moe_layer import make_params, numpy_router_stats

import jax_ep
from jax_ep import moe

DATA, EXPERT = "data", "expert"


def mesh_2d(num_data, num_experts):
    devices = jax.devices()[:num_data * num_experts]
    return jax.make_mesh((num_data, num_experts), (DATA, EXPERT), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("D,R", [(2, 2), (2, 4), (4, 2)])
def test_moe_layer_on_the_expert_axis_matches_dense(D, R):
    T, H, F, E, top_k, S = 5, 8, 6, 4 * R, 2, 4
    key = jax.random.key(D * 10 + R)
    params = make_params(key, H, F, E, S)
    x = jax.random.normal(jax.random.fold_in(key, 1), (D * R * T, H), jnp.float32)
    target = jax.random.normal(jax.random.fold_in(key, 2), (D * R * T, H), jnp.float32)
    m = mesh_2d(D, R)
    specs = params.partition_specs(EXPERT)  # experts over "expert", replicated over "data"
    tokens = P((DATA, EXPERT))  # group d holds tokens [d*R*T, (d+1)*R*T)

    @partial(jax.shard_map, mesh=m, in_specs=(specs, tokens, tokens),
             out_specs=(P(), (tokens, P(DATA))))
    def loss(params, x, target):
        y, aux = moe.moe_layer(x, params, top_k=top_k, axis_name=EXPERT, backend="reference")
        err = jax.lax.psum(jnp.sum((y - target) ** 2), (DATA, EXPERT))
        return err, (y, aux.tokens_per_expert[None])

    place = lambda a, s: jax.device_put(a, NamedSharding(m, s))  # noqa: E731
    (got_loss, (y, counts)), got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                                             has_aux=True))(
        jax.tree.map(place, params, specs), place(x, tokens), place(target, tokens))

    def dense_loss(params, x, target):
        y, _ = moe.dense_moe_layer(x, params, top_k=top_k)
        return jnp.sum((y - target) ** 2), y

    (want_loss, want_y), want = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1),
                                                           has_aux=True))(params, x, target)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name in params._fields:
        np.testing.assert_allclose(getattr(got[0], name), getattr(want[0], name), rtol=2e-4,
                                   atol=2e-5, err_msg=f"d loss / d {name}")
    np.testing.assert_allclose(got[1], want[1], rtol=2e-4, atol=2e-5, err_msg="d loss / d x")
    # the auxiliary counts are per EP group: its own tokens only
    for d in range(D):
        group = slice(d * R * T, (d + 1) * R * T)
        want_counts, _, _ = numpy_router_stats(x[group], params.router, top_k)
        np.testing.assert_array_equal(counts[d], want_counts)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major", "source_slots"])
def test_dispatch_combine_per_group_equal_one_axis_runs(layout):
    """Each data index's EP group gives exactly what a one-axis mesh of its devices gives."""
    D, R, T, H, K, E = 2, 4, 6, 8, 3, 8
    rng = np.random.default_rng(3)
    x = rng.standard_normal((D * R * T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(D * R * T)]).astype(np.int32)
    w = rng.random((D * R * T, K)).astype(np.float32)

    def per_device(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=EXPERT, layout=layout,
                              backend="reference")
        y = out.x * 2
        back = jax_ep.combine(y, out.handle, weights=out.topk_weights
                              if layout == "expert_major" else None)
        return back, out.num_received[None]

    tokens = P((DATA, EXPERT))
    m = mesh_2d(D, R)
    two_axes = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=(tokens,) * 3,
                                     out_specs=(tokens, tokens)))
    got, received = two_axes(x, idx, w)
    for d in range(D):
        group = slice(d * R * T, (d + 1) * R * T)
        one = jax.make_mesh((R,), (EXPERT,), devices=jax.devices()[d * R:(d + 1) * R],
                            axis_types=(jax.sharding.AxisType.Auto,))
        one_axis = jax.jit(jax.shard_map(per_device, mesh=one, in_specs=(P(EXPERT),) * 3,
                                         out_specs=(P(EXPERT), P(EXPERT))))
        want, want_received = one_axis(x[group], idx[group], w[group])
        np.testing.assert_array_equal(got[group], want)
        np.testing.assert_array_equal(received[d * R:(d + 1) * R], want_received)


def test_example_trains_with_a_data_parallel_axis():
    """examples/moe_layer.py on a (data=2, ep=4) mesh of fake CPU devices: the loss falls."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(example), "--data-parallel", "2", "--steps", "6",
                          "--backend", "reference"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 EP group(s) of 4" in out.stdout
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], out.stdout
