"""Expert parallelism across processes on the CPU, as across hosts: under ``python -m
jax_ep.launch`` on the CPU every process's host devices join one jax.distributed job
(``tests/conftest.py``), so these meshes span the processes and the reference backend's
collectives cross between them (Gloo). ``tests/test_launch.py`` runs this file so (2 processes
of 2 devices); alone it skips.

Every process passes the same global NumPy inputs (fixed seeds) and compares the global results
with the NumPy oracle or the dense one-device MoE.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_low_latency import test_low_latency_combine_matches_oracle as ll_combine_case
from test_low_latency import test_low_latency_dispatch_matches_oracle as ll_dispatch_case
from test_moe_layer import make_params

import jax_ep
from jax_ep import moe

import oracle
from ep import AXIS, fetch, put, run
from test_reference import assert_matches_oracle, dispatch_all, make_inputs
from test_reference import test_combine_matches_oracle as combine_case

pytestmark = pytest.mark.skipif(
    "JAX_EP_RANK" not in os.environ or os.environ.get("JAX_PLATFORMS") != "cpu",
    reason="run under the launcher on the CPU (tests/test_launch.py does)")


def ranks():
    return jax.device_count()


def test_one_job_spans_the_processes():
    n = int(os.environ["JAX_EP_WORLD_SIZE"])
    assert jax.process_count() == n > 1
    assert jax.device_count() == n * jax.local_device_count()
    R = ranks()
    values = np.arange(R, dtype=np.float32)[:, None] + 1
    total = run(lambda v: jax.lax.psum(v, AXIS), R, values)
    np.testing.assert_array_equal(total, np.full((R, 1), values.sum(), np.float32))


@pytest.mark.parametrize("layout", ["rank_major", "expert_major", "source_slots"])
def test_dispatch_across_processes_matches_oracle(layout):
    R, T, H, K, E = ranks(), 7, 11, 5, 6 * ranks()
    x, idx, w = make_inputs(np.random.default_rng(5), R, T, H, K, E, "random", 0.15)
    out = dispatch_all(x, idx, w, E, layout=layout)
    C = jax_ep.default_capacity(T, R, K, E // R, layout, 1)
    want, send_slot = oracle.dispatch(x, idx, w, E, C, layout, 1)
    assert_matches_oracle(out, want, send_slot)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major", "source_slots"])
def test_combine_across_processes_matches_oracle(layout):
    combine_case(ranks(), 6, 4, 8, 4 * ranks(), None, layout)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_dispatch_across_processes_matches_oracle(use_fp8):
    ll_dispatch_case(ranks(), 3, 4, 128, 8, 6 * ranks(), "random", 0.1, use_fp8)


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_combine_across_processes_matches_oracle(split):
    if ranks() != 4:
        pytest.skip("the case is written for 4 ranks")
    ll_combine_case(split, np.float32)


# The two multi-host arrangements of a (data, expert) mesh: EP inside each process with data
# parallel across the processes (a row of the mesh is one process's devices), and EP across
# the processes (a row holds one device of each).
@pytest.mark.parametrize("ep_across", [False, True])
def test_moe_layer_with_a_data_axis_across_processes_matches_dense(ep_across):
    n, local = jax.process_count(), jax.local_device_count()
    by_process = np.array(jax.devices()).reshape(n, local)
    grid = by_process.T if ep_across else by_process  # [data, expert]
    D, R = grid.shape
    m = jax.sharding.Mesh(grid, ("data", "expert"))
    T, H, F, E, top_k, S = 5, 8, 6, 4 * R, 2, 4
    key = jax.random.key(7 + ep_across)
    params = jax.tree.map(np.asarray, make_params(key, H, F, E, S))
    rng = np.random.default_rng(8)
    x = rng.standard_normal((D * R * T, H)).astype(np.float32)
    target = rng.standard_normal((D * R * T, H)).astype(np.float32)
    specs = params.partition_specs("expert")
    tokens = P(("data", "expert"))

    @jax.jit
    @partial(jax.shard_map, mesh=m, in_specs=(specs, tokens, tokens),
             out_specs=(P(), tokens))
    def loss(params, x, target):
        y, _ = moe.moe_layer(x, params, top_k=top_k, axis_name="expert", backend="reference")
        return jax.lax.psum(jnp.sum((y - target) ** 2), ("data", "expert")), y

    def dense_loss(params, x, target):
        y, _ = moe.dense_moe_layer(x, params, top_k=top_k)
        return jnp.sum((y - target) ** 2), y

    place = lambda a, s: put(a, NamedSharding(m, s))  # noqa: E731
    args = (jax.tree.map(place, params, specs), place(x, tokens), place(target, tokens))
    (got_loss, y), got = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(*args)
    (want_loss, want_y), want = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1),
                                                           has_aux=True))(params, x, target)
    np.testing.assert_allclose(fetch(y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fetch(got_loss), want_loss, rtol=1e-5)
    for name in params._fields:
        np.testing.assert_allclose(fetch(getattr(got[0], name)), getattr(want[0], name),
                                   rtol=2e-4, atol=2e-5, err_msg=f"d loss / d {name}")
    np.testing.assert_allclose(fetch(got[1]), want[1], rtol=2e-4, atol=2e-5,
                               err_msg="d loss / d x")
