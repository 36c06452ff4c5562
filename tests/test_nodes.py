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
