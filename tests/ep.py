"""Run a per-device function over an expert-parallel mesh of R devices, NumPy in and out.

Works in one process (CPU fake devices, or several local GPUs) and across processes (one per
GPU, started by ``jax_ep.launch``): every process passes the same global NumPy inputs and gets
the same global NumPy outputs.
"""

from __future__ import annotations

import itertools
import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ep"
# Set by ``jax_ep.launch --gpus G`` with fewer GPUs than processes: NCCL refuses two ranks on one
# GPU, so outputs are gathered through jax.distributed's key-value store instead.
SHARED_GPUS = os.environ.get("JAX_EP_SHARED_GPUS") == "1"
_KV_TIMEOUT_MS = 120_000
_fetch_ids = itertools.count()


def mesh(num_ranks, devices=None, axis_type="Auto"):
    """axis_type: "Auto", or "Explicit" (jax.make_mesh's default from jax 0.7 on)."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < num_ranks:
        raise RuntimeError(f"need {num_ranks} devices, have {len(devices)}")
    return jax.make_mesh((num_ranks,), (AXIS,), devices=devices[:num_ranks],
                         axis_types=(getattr(jax.sharding.AxisType, axis_type),))


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
    if SHARED_GPUS:
        return _gather_over_kv_store(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _gather_over_kv_store(array):
    """Every process posts its shards; every process assembles the whole array (no NCCL)."""
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"jax_ep_tests/fetch/{next(_fetch_ids)}"
    me = jax.process_index()
    shards = [(s.index, np.asarray(s.data)) for s in array.addressable_shards]
    client.key_value_set_bytes(f"{key}/{me}", pickle.dumps(shards))
    out = np.empty(array.shape, array.dtype)
    for p in range(jax.process_count()):
        for index, data in pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{p}",
                                                                            _KV_TIMEOUT_MS)):
            out[index] = data
    client.wait_at_barrier(key, _KV_TIMEOUT_MS)  # every process has read every post
    client.key_value_delete(f"{key}/{me}")
    return out


def run(fn, num_ranks, *args, jit=True, devices=None, axis_type="Auto"):
    """args: arrays shaped [R, ...] (slice r goes to rank r).

    fn gets the per-rank slices and returns a pytree; every leaf comes back stacked as [R, ...].
    devices: the mesh's devices (default: all of the default backend's); axis_type: the mesh
    axis's type (``mesh``).
    """
    m = mesh(num_ranks, devices, axis_type)

    def per_device(*local):
        out = fn(*[a[0] for a in local])
        return jax.tree.map(lambda a: a[None], out)

    f = jax.shard_map(per_device, mesh=m, in_specs=tuple(P(AXIS) for _ in args), out_specs=P(AXIS))
    if jit:
        f = jax.jit(f)
    sharding = NamedSharding(m, P(AXIS))
    return jax.tree.map(fetch, f(*[put(a, sharding) for a in args]))
