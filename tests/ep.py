"""Run a per-device function over an expert-parallel mesh of R devices, NumPy in and out.

Works in one process (CPU fake devices, or several local GPUs) and across processes (one per
GPU, started by ``jax_ep.launch``): every process passes the same global NumPy inputs and gets
the same global NumPy outputs.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ep"


def mesh(num_ranks):
    devices = jax.devices()
    if len(devices) < num_ranks:
        raise RuntimeError(f"need {num_ranks} devices, have {len(devices)}")
    return jax.make_mesh((num_ranks,), (AXIS,), devices=devices[:num_ranks],
                         axis_types=(jax.sharding.AxisType.Auto,))


def put(array, sharding):
    """Place a global NumPy array (identical on every process) with ``sharding``."""
    array = np.asarray(array)
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def fetch(array):
    """Global value of a (possibly multi-process) array, as NumPy, on every process."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def run(fn, num_ranks, *args, jit=True):
    """args: arrays shaped [R, ...] (slice r goes to rank r).

    fn gets the per-rank slices and returns a pytree; every leaf comes back stacked as [R, ...].
    """
    m = mesh(num_ranks)

    def per_device(*local):
        out = fn(*[a[0] for a in local])
        return jax.tree.map(lambda a: a[None], out)

    f = jax.shard_map(per_device, mesh=m, in_specs=tuple(P(AXIS) for _ in args), out_specs=P(AXIS))
    if jit:
        f = jax.jit(f)
    sharding = NamedSharding(m, P(AXIS))
    return jax.tree.map(fetch, f(*[put(a, sharding) for a in args]))
