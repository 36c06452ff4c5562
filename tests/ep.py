"""Run a per-device function over an expert-parallel mesh of R devices, NumPy in and out."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ep"


def mesh(num_ranks):
    devices = jax.devices()
    if len(devices) < num_ranks:
        raise RuntimeError(f"need {num_ranks} devices, have {len(devices)}")
    return jax.make_mesh((num_ranks,), (AXIS,), devices=devices[:num_ranks],
                         axis_types=(jax.sharding.AxisType.Auto,))


def run(fn, num_ranks, *args, jit=True):
    """args: arrays shaped [R, ...] (slice r goes to rank r) or None.

    fn gets the per-rank slices and returns a pytree; every leaf comes back stacked as [R, ...].
    """
    m = mesh(num_ranks)

    def per_device(*local):
        out = fn(*[None if a is None else a[0] for a in local])
        return jax.tree.map(lambda a: a[None], out)

    f = jax.shard_map(per_device, mesh=m, in_specs=tuple(P(AXIS) for _ in args), out_specs=P(AXIS))
    if jit:
        f = jax.jit(f)
    sharding = NamedSharding(m, P(AXIS))
    placed = [None if a is None else jax.device_put(np.asarray(a), sharding) for a in args]
    return jax.tree.map(np.asarray, f(*placed))
