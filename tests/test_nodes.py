"""An EP axis across nodes, on CPU: how the API finds the ranks per node from the runtime's
topology (and refuses groups that are not whole blocks of a node), and the reference combine's
order across nodes (each node's ranks first, that partial rounded, then the nodes). The CUDA
paths across nodes are compared with the reference in tests/test_gpu_nodes.py."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import api
from jax_ep import runtime as rt

AXIS, DATA = "ep", "data"


@pytest.fixture
def nodes(monkeypatch):
    """nodes(tuple): the runtime's topology as if initialised over these nodes."""
    def set_nodes(of):
        monkeypatch.setattr(rt, "topology", lambda: rt.Topology(nodes=tuple(of), virtual=True))

    return set_nodes


def _node_size_in(mesh_shape, names, axis):
    """api.axis_node_size of `axis`, traced inside shard_map over a mesh of that shape."""
    m = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:int(np.prod(mesh_shape))],
                      axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    seen = []

    @partial(jax.shard_map, mesh=m, in_specs=P(names), out_specs=P(names))
    def f(x):
        seen.append(api.axis_node_size(axis, jax.lax.axis_size(axis)))
        return x

    jax.jit(f).trace(np.zeros(int(np.prod(mesh_shape)), np.float32))
    return seen[0]


def test_node_size_follows_the_topology_and_the_mesh(nodes):
    nodes((0, 0, 1, 1))
    assert _node_size_in((4,), (AXIS,), AXIS) == 2  # one axis: two ranks per node
    # (data, ep): each EP group is one node; (ep, data): one rank of each node
    assert _node_size_in((2, 2), (DATA, AXIS), AXIS) is None
    assert _node_size_in((2, 2), (AXIS, DATA), AXIS) == 1
    nodes((0, 0, 0, 0))
    assert _node_size_in((4,), (AXIS,), AXIS) is None


def test_a_group_that_is_not_whole_blocks_of_nodes_is_refused(nodes):
    nodes((0, 1, 0, 1))
    with pytest.raises(ValueError, match="blocks of the same number of consecutive ranks"):
        _node_size_in((4,), (AXIS,), AXIS)


def _combine_on(R, x, idx, y, layout):
    """Dispatch x, then combine rows that all hold this rank's y: out [R, T, H] (float32)."""
    m = jax.make_mesh((R,), (AXIS,), devices=jax.devices()[:R],
                      axis_types=(jax.sharding.AxisType.Auto,))

    @jax.jit
    @partial(jax.shard_map, mesh=m, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
    def f(x, idx, y):
        out = jax_ep.dispatch(x, idx, num_experts=4 * R, axis_name=AXIS, layout=layout,
                              backend="reference")
        rows = jnp.where((out.handle.src_rank >= 0)[:, None], y, jnp.zeros((), y.dtype))
        return jax_ep.combine(rows, out.handle)

    place = lambda a: jax.device_put(a, NamedSharding(m, P(AXIS)))  # noqa: E731
    return np.asarray(f(place(x), place(idx), place(y)).astype(jnp.float32))


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_the_reference_combine_adds_rounded_node_partials(nodes, layout):
    """Rank 0's token has an expert on ranks 0, 1 (node 0) and 2 (node 1), whose rows hold 1,
    3u/4 and 3u/4 (u = 2^-8, half a bfloat16 ulp at 1). In one sum, 1 + 3u/2 rounds up to
    1 + 2u; across nodes, node 0's 1 + 3u/4 rounds to 1, and so does 1 + 3u/4."""
    R, L, H = 4, 4, 8
    x = np.zeros((R * 1, H), np.float32)
    idx = np.full((R * 1, 3), -1, np.int32)
    idx[0] = [0 * L, 1 * L, 2 * L]
    u = 2.0 ** -8
    y = np.asarray(jnp.asarray(np.array([1.0, 0.75 * u, 0.75 * u, 0.0])[:, None]
                               * np.ones((R, H)), jnp.bfloat16))
    nodes((0, 0, 0, 0))
    np.testing.assert_array_equal(_combine_on(R, x, idx, y, layout)[0], np.float32(1 + 2 * u))
    nodes((0, 0, 1, 1))
    np.testing.assert_array_equal(_combine_on(R, x, idx, y, layout)[0], np.float32(1.0))


# ----------------------------------------------------------------------------- the CUDA path's
# reordering, on CPU: its two native stages emulated in pure JAX (the node exchange from an
# all_gather, the node-local stage from the reference's layout builders over the node's ranks),
# the rest (`_cuda._nodes_dispatch`: the contract's order and capacity from the stage's rows)
# as it runs on GPUs.

def _emulated_node_send(x, x_scales, topk_idx, topk_weights, config):
    """jax_ep_node_send: block s = the tokens of the rank with this local index on node s, ids
    of this node's experts made relative to it (-1 elsewhere)."""
    R, G = config.num_ranks, config.node_size
    per_node = config.num_experts // (R // G)
    me = jax.lax.axis_index(config.axis_name)
    node = me // G
    same_index = me % G + G * jnp.arange(R // G)  # the rank of this local index on each node
    gather = lambda a: jax.lax.all_gather(a, config.axis_name)[same_index]  # noqa: E731
    rows, ids, weights = gather(x), gather(topk_idx), gather(topk_weights)  # [N, T, ...]
    here = (ids >= node * per_node) & (ids < (node + 1) * per_node)
    rel = jnp.where(here, ids - node * per_node, -1)
    present = jnp.any(here, axis=-1)[..., None]
    scales = None if x_scales is None else jnp.where(present, gather(x_scales), 0)
    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    return (flat(jnp.where(present, rows, 0)), None if scales is None else flat(scales),
            flat(rel), flat(jnp.where(here, weights, 0.0)))


def _emulated_stage(x, x_scales, topk_idx, topk_weights, config):
    """The node-local stage: the reference's layout of what this rank receives from the G
    ranks of its node."""
    from jax_ep import reference

    G, L = config.num_ranks, config.num_local_experts
    me = jax.lax.axis_index(config.axis_name)
    first = me // G * G
    take = lambda a: jax.lax.dynamic_slice_in_dim(  # noqa: E731
        jax.lax.all_gather(a, config.axis_name), first, G)
    ids = take(topk_idx)  # [G(source), N*T, K]
    mine = (ids >= 0) & (ids // L == me % G)
    local = jnp.where(mine, ids % L, -1)
    weights = jnp.where(mine, take(topk_weights), 0.0)
    scales = None if x_scales is None else take(x_scales)
    build = reference._expert_major if config.layout == "expert_major" else reference._rank_major
    out, _ = build(take(x), scales, local, weights, config)
    handle = jax_ep.DispatchHandle(
        topk_idx=topk_idx, send_slot=jnp.zeros((1,), jnp.int32), src_rank=out.pop("src_rank"),
        src_token=out.pop("src_token"), src_k=out.pop("src_k"),
        num_received=out["num_received"], pair_row=jnp.zeros((1,), jnp.int32), config=config)
    return jax_ep.DispatchOutput(handle=handle, **out)


@pytest.mark.parametrize("capacity", [None, 0.6], ids=["no_drops", "drops"])
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("R,G", [(4, 2), (8, 2), (8, 4), (4, 1)])
def test_the_cuda_reordering_across_nodes_matches_the_reference(monkeypatch, R, G, layout,
                                                                 capacity):
    from jax_ep import _cuda, reference
    from jax_ep._types import DispatchConfig, default_capacity

    monkeypatch.setattr(_cuda, "_node_send", _emulated_node_send)
    real = _cuda.dispatch
    monkeypatch.setattr(_cuda, "dispatch", lambda *a: (
        _emulated_stage(*a) if a[-1].within_node else real(*a)))
    T, H, K, E = 12, 16, 4, 4 * R
    align = 4 if layout == "expert_major" else 1
    pairs = K if layout == "expert_major" else 1
    C = (default_capacity(T, R, K, E // R, layout, align) if capacity is None
         else int(capacity * T * pairs))
    config = DispatchConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=H, num_topk=K,
                            capacity=C, layout=layout, alignment=align, axis_name=AXIS,
                            backend="reference", node_size=G)
    rng = np.random.default_rng(R * 10 + G)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    idx = np.where(rng.random(idx.shape) < 0.1, -1, idx).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    m = jax.make_mesh((R,), (AXIS,), devices=jax.devices()[:R],
                      axis_types=(jax.sharding.AxisType.Auto,))

    def run(f):
        @jax.jit
        @partial(jax.shard_map, mesh=m, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
        def g(x, idx, w):
            out = f(x, None, idx, w, config)
            h = out.handle
            keep = (out.x, out.topk_idx, out.topk_weights, out.tokens_per_expert,
                    out.group_sizes, out.num_received, out.num_dropped, h.src_rank,
                    h.src_token, h.src_k, h.num_received) + (
                (h.pair_row,) if layout == "expert_major" else ())
            return jax.tree.map(lambda a: a[None], keep)

        place = lambda a: jax.device_put(a, NamedSharding(m, P(AXIS)))  # noqa: E731
        return [np.asarray(a) for a in g(place(x), place(idx), place(w))]

    got, want = run(_cuda._nodes_dispatch), run(reference.dispatch)
    if capacity is not None:
        assert want[6].sum() > 0  # rows were dropped
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _emulated_stage_combine(y, weights, handle):
    """The node-local combine: each virtual token's rows on the node's ranks, summed in the
    contract's order (expert_major: k first, rounded), each rank's terms added in rank order
    (float32), rounded to y's dtype: the node's partial."""
    config = handle.config
    G, NT, K = config.num_ranks, config.num_tokens, config.num_topk
    me = jax.lax.axis_index(config.axis_name)
    take = lambda a: jax.lax.dynamic_slice_in_dim(  # noqa: E731
        jax.lax.all_gather(a, config.axis_name), me // G * G, G)
    rows = y.astype(jnp.float32)
    if weights is not None:
        rows = rows * weights[:, None]
    rows, src_rank, src_token, src_k = (take(rows), take(handle.src_rank),
                                        take(handle.src_token), take(handle.src_k))
    total = jnp.zeros((NT,) + y.shape[1:], jnp.float32)
    for f in range(G):
        mine = src_rank[f] == me % G
        if config.layout == "expert_major":
            part = jnp.zeros_like(total)
            for k in range(K):
                at = jnp.where(mine & (src_k[f] == k), src_token[f], NT)
                part = part + jnp.zeros_like(total).at[at].set(rows[f], mode="drop")
            part = jax.lax.optimization_barrier(part.astype(y.dtype)).astype(jnp.float32)
        else:
            part = jnp.zeros_like(total).at[jnp.where(mine, src_token[f], NT)].set(
                rows[f], mode="drop")
        total = total + part
    return total.astype(y.dtype)


def _emulated_node_return(partial, node_ids, topk_idx, config):
    """jax_ep_node_return: the owner adds the partials of the nodes holding its tokens'
    experts, in node order (float32), rounded once."""
    R, G, T = config.num_ranks, config.node_size, config.num_tokens
    N, per_node = R // G, config.num_experts // (R // G)
    me = jax.lax.axis_index(config.axis_name)
    same_index = me % G + G * jnp.arange(N)
    blocks = jax.lax.all_gather(partial, config.axis_name)[same_index]  # [N, N*T, H]
    total = jnp.zeros((T,) + partial.shape[1:], jnp.float32)
    for n in range(N):
        mine = jax.lax.dynamic_slice_in_dim(blocks[n], me // G * T, T).astype(jnp.float32)
        hit = jnp.any((topk_idx >= n * per_node) & (topk_idx < (n + 1) * per_node), axis=-1)
        total = total + jnp.where(hit[:, None], mine, 0.0)
    return total.astype(partial.dtype)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("R,G", [(4, 2), (8, 4)])
def test_the_cuda_combine_across_nodes_adds_in_the_contracts_order(monkeypatch, R, G, layout):
    """The CUDA path's combine (rows back to the stage's order, the node-local combine, the
    node return), its native stages emulated, against the reference's combine: bit-equal."""
    from jax_ep import _cuda, reference
    from jax_ep._types import DispatchConfig, default_capacity

    monkeypatch.setattr(_cuda, "_node_send", _emulated_node_send)
    monkeypatch.setattr(_cuda, "_node_return", _emulated_node_return)
    real_dispatch, real_combine = _cuda.dispatch, _cuda.combine
    monkeypatch.setattr(_cuda, "dispatch", lambda *a: (
        _emulated_stage(*a) if a[-1].within_node else real_dispatch(*a)))
    monkeypatch.setattr(_cuda, "combine", lambda y, w, h: (
        _emulated_stage_combine(y, w, h) if h.config.within_node else real_combine(y, w, h)))
    T, H, K, E = 12, 16, 4, 4 * R
    align = 4 if layout == "expert_major" else 1
    C = int(0.7 * T * (K if layout == "expert_major" else 1))  # some rows dropped
    config = DispatchConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=H, num_topk=K,
                            capacity=C, layout=layout, alignment=align, axis_name=AXIS,
                            backend="reference", node_size=G)
    rng = np.random.default_rng(R + G)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    y = np.asarray(jnp.asarray(rng.standard_normal((R * C, H)), jnp.bfloat16))
    row_w = rng.random(R * C).astype(np.float32)
    m = jax.make_mesh((R,), (AXIS,), devices=jax.devices()[:R],
                      axis_types=(jax.sharding.AxisType.Auto,))
    assert default_capacity(T, R, K, E // R, layout, align) > C

    def run(backend):
        @jax.jit
        @partial(jax.shard_map, mesh=m, in_specs=(P(AXIS),) * 5, out_specs=P(AXIS))
        def g(x, idx, w, y, row_w):
            out = backend.dispatch(x, None, idx, w, config)
            return backend.combine(y, row_w, out.handle), backend.combine(y, None, out.handle)

        place = lambda a: jax.device_put(a, NamedSharding(m, P(AXIS)))  # noqa: E731
        return [np.asarray(a.astype(jnp.float32)) for a in g(*map(place, (x, idx, w, y, row_w)))]

    for got, want in zip(run(_cuda), run(reference)):
        np.testing.assert_array_equal(got, want)
