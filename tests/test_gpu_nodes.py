"""Jobs over several nodes, on one host: virtual nodes (``runtime.initialize(node_size=G)``)
stand for hosts, so the kernels map the PEs of their own node only and reach every other PE
through NVSHMEM puts, as they would over the network. On two GPUs each GPU is a node (2 x 1);
with 4 or 8 ranks, nodes of 2 (2 x 2, 4 x 2; ranks may share GPUs with ``--gpus``).

- The low-latency calls across nodes: the whole job as one EP group (the low-latency tests of
  test_gpu.py, run here), and a group with one rank per node on a two-axis mesh.
- The normal mode inside a node, a data axis across nodes; and across nodes (the whole job as
  one EP group, and a group with one rank per node): the node exchange by puts, then NVLink
  inside the node, against the reference (its combine adds the same per-node partials).

Run on its own (a process may start NVSHMEM once):

    python -m jax_ep.launch -n 4 [--gpus 2] -m pytest -q tests/test_gpu_nodes.py

or as two launcher invocations sharing a coordinator (the multi-host form; see
``python -m jax_ep.launch --help`` and tests/test_gpu_multihost.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpu as g  # starts jax.distributed under the launcher; its helpers

W = jax.device_count() if g._skip is None else 0
NODE_SIZE = 1 if W == 2 else 2  # nodes of one GPU on two GPUs, of two ranks otherwise
NODES = W // NODE_SIZE


def _reason():
    if g._skip is not None:
        return g._skip
    if W not in (2, 4, 8):
        return f"needs 2, 4 or 8 ranks, have {W}"
    return None


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"node tests: {_reason()}")

# The low-latency tests of the GPU suite, on one EP axis over the whole job: across the nodes.
from test_gpu import (  # noqa: E402, F401
    test_low_latency_combine_dtypes_and_cached_dispatch,
    test_low_latency_consecutive_calls,
    test_low_latency_drops_duplicate_experts,
    test_low_latency_gradients_match_reference,
    test_low_latency_interleaved_split_calls,
    test_low_latency_matches_reference,
    test_low_latency_packed_layouts_gradients_match_reference,
    test_low_latency_packed_layouts_match_reference,
    test_low_latency_repeated_programs_are_bit_identical,
    test_low_latency_wide_rows_match_reference,
)

import jax_ep  # noqa: E402

DATA, EXPERT = g.DATA, g.EXPERT
# (data, expert): each EP group is one node; (expert, data): each group has a rank on every node
INSIDE = ((DATA, EXPERT), (NODES, NODE_SIZE))
ACROSS = ((EXPERT, DATA), (NODES, NODE_SIZE))


@pytest.fixture(scope="module", autouse=True)
def runtime():
    if _reason() is not None:
        yield
        return
    from jax_ep import runtime as rt

    if rt._generation > 0:
        pytest.skip("another module started the runtime in this process: run this one alone")
    E = g.LL_E_PER_RANK * W
    ll_bytes = max(
        2 * jax_ep.low_latency_buffer_size_hint(g.LL_M, g.LL_H, E, g.LL_K, W, jnp.float32,
                                                across_nodes=True),
        jax_ep.low_latency_buffer_size_hint(g.LL_WIDE_M, g.LL_WIDE_H, E, g.LL_K, W,
                                            across_nodes=True))
    rt.initialize(1 << 28, low_latency_bytes=ll_bytes, node_size=NODE_SIZE)
    yield
    rt.finalize()


def test_topology_names_the_virtual_nodes():
    from jax_ep import runtime as rt

    topology = rt.topology()
    assert topology.nodes == tuple(r // NODE_SIZE for r in range(W))
    assert topology.virtual and topology.num_nodes == NODES


def _inputs(seed, T, H, K, E):
    W = jax.device_count()
    rng = np.random.default_rng(seed)
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    return x, idx, rng.random((W, T, K)).astype(np.float32)


def _needs_node_groups():
    if NODE_SIZE == 1:
        pytest.skip("nodes of one GPU: an EP group inside a node has one rank")


@pytest.mark.parametrize("capacity", [None, 24], ids=["no_drops", "capacity_drops"])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_ep_inside_a_node_matches_reference(layout, capacity):
    _needs_node_groups()
    names, shape = INSIDE
    T, H, K, E = 40, 256, 4, 8
    x, idx, w = _inputs(3, T, H, K, E)

    def fn(backend, x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=EXPERT, layout=layout,
                              capacity=capacity, backend=backend)
        weights = out.topk_weights if layout == "expert_major" else None
        back = jax_ep.combine(out.x.astype(jnp.float32) * 2, out.handle, weights=weights)
        ll = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                         axis_name=EXPERT, use_fp8=False, backend=backend)
        return out, back, ll

    (out, back, ll), (out_r, back_r, ll_r) = g.both_2d(fn, names, shape, x, idx, w)
    if capacity is not None:  # rows past the capacity are dropped and counted, not lost
        assert int(np.asarray(out_r.num_dropped).sum()) > 0
    g.assert_trees_equal(out, out_r)
    g.assert_sums_close(back, back_r, jnp.float32)
    used = np.asarray(ll_r.handle.src_rank) >= 0
    g.assert_trees_equal(g._ll_used(ll, used), g._ll_used(ll_r, used))


def _moe_inputs(seed, R, T=16, H=64, F=48):
    """x [W, T, H], the router [W, H, E] and the experts' weights [R, L, ...] of E = 4 R."""
    E, L = 4 * R, 4
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    router = np.broadcast_to(np.asarray(jax.random.normal(k1, (H, E))), (W, H, E)).copy()
    w_in = np.asarray(jax.random.normal(k2, (E, H, F)) / np.sqrt(H)).reshape(R, L, H, F)
    w_out = np.asarray(jax.random.normal(k3, (E, F, H)) / np.sqrt(F)).reshape(R, L, F, H)
    return np.asarray(jax.random.normal(k4, (W, T, H))), router, w_in, w_out


def _assert_grads_close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_ep_inside_a_node_gradients_match_reference():
    _needs_node_groups()
    names, shape = INSIDE
    x, router, w_in, w_out = _moe_inputs(7, NODE_SIZE)
    e = g._ep_index(names, shape)
    with jax.default_matmul_precision("float32"):
        _assert_grads_close(*g.both_2d(g.moe_grads(top_k=2, axis_name=EXPERT), names, shape,
                                       x, router, w_in[e], w_out[e]))


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_with_a_rank_on_every_node_matches_reference(fp8):
    """A two-axis mesh whose EP groups take one rank of every node (every peer off-node)."""
    names, shape = ACROSS
    T, M, H, K = 24, 32, 256, 4
    R = NODES
    E = 4 * R
    x, idx, w = _inputs(11, T, H, K, E)
    rng = np.random.default_rng(12)
    y = np.asarray(jnp.asarray(rng.standard_normal((W, E // R, R * M, H)), jnp.bfloat16))

    def fn(backend, x, idx, w, y):
        return g.ll_round_trip(x, idx, w, y, num_experts=E, max_tokens_per_rank=M,
                               axis_name=EXPERT, use_fp8=fp8, backend=backend)

    g.assert_ll_round_trip(*g.both_2d(fn, names, shape, x, idx, w, y))


# ----------------------------------------------------------------------------- normal mode

def _normal_mode_calls(layout, capacity, fp8, axis_name):
    """fn(backend, *sent, idx, w, y, row_w, g): dispatch, weighted and plain combines, the
    cached dispatch of the combine's backward and that backward. sent: x, or with fp8 the
    oracle's (data, scales), the same pair on both sides (where ranks share GPUs the reference
    runs on the CPU, where jax_ep.quantize_fp8's default would still pick the CUDA kernel)."""
    def fn(backend, *args):
        *sent, idx, w, y, row_w, g = args
        E = NUM_EXPERTS
        sent = tuple(sent) if fp8 else sent[0]
        out = jax_ep.dispatch(sent, idx, w, num_experts=E, axis_name=axis_name, layout=layout,
                              capacity=capacity, expert_alignment=ALIGN.get(layout, 1),
                              backend=backend)
        back = jax_ep.combine(y, out.handle, weights=row_w)
        plain = jax_ep.combine(out.x.astype(jnp.bfloat16) if fp8 else out.x, out.handle)
        module = jax_ep.api._backend_module(backend)
        rows = module.cached_dispatch(g, out.handle)
        dy, d_weights = module.combine_backward(g, y, row_w, out.handle)
        h = out.handle
        return (out._replace(handle=None),
                (h.src_rank, h.src_token, h.src_k, h.num_received, h.pair_row),
                back, plain, rows, dy, d_weights)

    return fn


NUM_EXPERTS = 4 * W
ALIGN = {"expert_major": 4}


@pytest.mark.parametrize("fp8,capacity", [(False, None), (True, None), (False, 0.6)],
                         ids=["bf16", "fp8", "capacity_drops"])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("mesh", ["whole_job", "rank_per_node"])
def test_normal_mode_across_nodes_matches_reference(mesh, layout, fp8, capacity):
    """The hierarchical dispatch and combine (node exchange by puts, then NVLink inside the
    node) against the reference, whose combine adds the same per-node partials."""
    T, H, K = 40, 256, 4
    E = NUM_EXPERTS
    R = W if mesh == "whole_job" else NODES
    pairs = K if layout == "expert_major" else 1
    C = None if capacity is None else int(capacity * T * pairs)
    rng = np.random.default_rng(17 + len(layout))
    x, idx, w = _inputs(19, T, H, K, E)
    idx = np.where(rng.random(idx.shape) < 0.1, -1, idx).astype(np.int32)
    C_full = C or jax_ep.default_capacity(T, R, K, E // R, layout, ALIGN.get(layout, 1))
    y = np.asarray(jnp.asarray(rng.standard_normal((W, C_full, H)), jnp.bfloat16))
    row_w = rng.random((W, C_full)).astype(np.float32)
    g_out = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    args = (*(g.oracle.quantize_fp8(x) if fp8 else (x,)), idx, w, y, row_w, g_out)
    if mesh == "whole_job":
        got, want = g.both(_normal_mode_calls(layout, C, fp8, g.AXIS), *args)
    else:
        got, want = g.both_2d(_normal_mode_calls(layout, C, fp8, EXPERT), *ACROSS, *args)
    (out, handle, back, plain, rows, dy, dw), (out_r, handle_r, back_r, plain_r, rows_r, dy_r,
                                               dw_r) = got, want
    if C is not None:
        assert int(np.asarray(out_r.num_dropped).sum()) > 0
    g.assert_trees_equal(out, out_r)
    g.assert_trees_equal(handle, handle_r)
    g.assert_trees_equal(rows, rows_r)
    g.assert_trees_equal(dy, dy_r)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-4, atol=1e-3 * np.sqrt(H))
    g.assert_sums_close(back, back_r, jnp.bfloat16)
    g.assert_sums_close(plain, plain_r, jnp.bfloat16)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_normal_mode_across_nodes_gradients_match_reference(layout):
    x, router, w_in, w_out = _moe_inputs(9, W)
    with jax.default_matmul_precision("float32"):
        _assert_grads_close(*g.both(g.moe_grads(top_k=2, axis_name=g.AXIS, layout=layout), x,
                                    router, w_in, w_out))


def test_source_slots_across_nodes_is_refused():
    T, H, K, E = 8, 128, 2, 2 * W
    x, idx, w = _inputs(5, T, H, K, E)

    def fn(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=g.AXIS,
                               layout="source_slots", backend="cuda").x

    with pytest.raises(ValueError, match="source_slots.*inside a node"):
        g.run(fn, W, x, idx, w)
