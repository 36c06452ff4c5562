"""Jobs over several nodes, on one host: virtual nodes of 2 ranks (``runtime.initialize(
node_size=2)``) stand for hosts. The kernels reach the PEs of their own node only, so expert
parallelism inside a node with a data axis across nodes runs (against the reference backend on
the same mesh), and a call whose EP group leaves its node fails, naming the peer.

Run on its own, with 4 ranks (a process may start NVSHMEM once):

    python -m jax_ep.launch -n 4 [--gpus 1] -m pytest -q tests/test_gpu_nodes.py

or as two launcher invocations of 2 processes each, sharing a coordinator (the multi-host form;
see ``python -m jax_ep.launch --help``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpu as g  # starts jax.distributed under the launcher; its helpers

NODE_SIZE = 2


def _reason():
    if g._skip is not None:
        return g._skip
    if jax.device_count() != 2 * NODE_SIZE:
        return f"needs {2 * NODE_SIZE} ranks (2 nodes of {NODE_SIZE}), have {jax.device_count()}"
    return None


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"node tests: {_reason()}")

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402

DATA, EXPERT = g.DATA, g.EXPERT
# (data, expert): each EP group is a node's 2 ranks; (expert, data): each group spans both
INSIDE = ((DATA, EXPERT), (2, NODE_SIZE))
ACROSS = ((EXPERT, DATA), (NODE_SIZE, 2))


@pytest.fixture(scope="module", autouse=True)
def runtime():
    if _reason() is not None:
        yield
        return
    from jax_ep import runtime as rt

    if rt._generation > 0:
        pytest.skip("another module started the runtime in this process: run this one alone")
    rt.initialize(1 << 28, low_latency_bytes=1 << 26, node_size=NODE_SIZE)
    yield
    rt.finalize()


def test_topology_names_the_virtual_nodes():
    from jax_ep import runtime as rt

    topology = rt.topology()
    assert topology.nodes == (0, 0, 1, 1) and topology.virtual and topology.num_nodes == 2


def _inputs(seed, T, H, K, E):
    W = jax.device_count()
    rng = np.random.default_rng(seed)
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    return x, idx, rng.random((W, T, K)).astype(np.float32)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_ep_inside_a_node_matches_reference(layout):
    names, shape = INSIDE
    T, H, K, E = 40, 256, 4, 8
    x, idx, w = _inputs(3, T, H, K, E)

    def fn(backend, x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=EXPERT, layout=layout,
                              backend=backend)
        weights = out.topk_weights if layout == "expert_major" else None
        back = jax_ep.combine(out.x.astype(jnp.float32) * 2, out.handle, weights=weights)
        ll = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                         axis_name=EXPERT, use_fp8=False, backend=backend)
        return out, back, ll

    (out, back, ll), (out_r, back_r, ll_r) = g.both_2d(fn, names, shape, x, idx, w)
    g.assert_trees_equal(out, out_r)
    g.assert_sums_close(back, back_r, jnp.float32)
    used = np.asarray(ll_r.handle.src_rank) >= 0
    g.assert_trees_equal(g._ll_used(ll, used), g._ll_used(ll_r, used))


def test_ep_inside_a_node_gradients_match_reference():
    names, shape = INSIDE
    W, R = jax.device_count(), NODE_SIZE
    T, H, F, E = 16, 64, 48, 4 * R
    L = E // R
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    router = np.broadcast_to(np.asarray(jax.random.normal(k1, (H, E))), (W, H, E)).copy()
    w_in = np.asarray(jax.random.normal(k2, (E, H, F)) / np.sqrt(H)).reshape(R, L, H, F)
    w_out = np.asarray(jax.random.normal(k3, (E, F, H)) / np.sqrt(F)).reshape(R, L, F, H)
    x = np.asarray(jax.random.normal(k4, (W, T, H)))
    e = g._ep_index(names, shape)

    def fn(backend, x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            out, _ = moe.moe_block(x, router, w_in, w_out, top_k=2, axis_name=EXPERT,
                                   backend=backend)
            return jnp.sum(jnp.sin(out))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w_in, w_out)

    with jax.default_matmul_precision("float32"):
        got, want = g.both_2d(fn, names, shape, x, router, w_in[e], w_out[e])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("call", ["dispatch", "low_latency"])
def test_a_group_across_nodes_fails_naming_the_peer(call):
    names, shape = ACROSS
    T, H, K, E = 8, 128, 2, 4
    x, idx, w = _inputs(5, T, H, K, E)

    def fn(x, idx, w):
        if call == "dispatch":
            return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=EXPERT, backend="cuda").x
        return jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                           axis_name=EXPERT, use_fp8=False, backend="cuda").x

    # rank r's group is {r % 2, r % 2 + 2}: its peer is on the other node
    me = jax.process_index()
    peer, node = (me + 2) % 4, 1 - me // 2
    with pytest.raises(Exception, match=rf"PE {peer} of this call's expert-parallel group is "
                                        rf"on node {node}, PE {me} on node {me // 2}"):
        g.run_2d(fn, names, shape, x, idx, w)
    # JAX keeps each device's last side-effect token and blocks on it at exit, where an error
    # aborts the job: a call that succeeds replaces the failed one's
    g.run_2d(fn, *INSIDE, x, idx, w)
