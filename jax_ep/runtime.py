"""The communication runtime: NVSHMEM bootstrapped from jax.distributed, one process per GPU.

Call ``initialize()`` after ``jax.distributed.initialize(...)`` (``jax_ep.launch`` does that for
scripts it starts) and before the first CUDA-backend call. Process 0 creates NVSHMEM's unique id
and publishes it through jax.distributed's key-value store; every process then joins, and
allocates the symmetric communication buffer (the same size on every process).

GPU memory: XLA preallocates most of the GPU by default, while the NVSHMEM heap is allocated
outside XLA. ``initialize`` therefore sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (only if unset and
only if JAX has not created its GPU client yet); if JAX already holds the memory, lower that
fraction yourself before JAX starts, or set ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.
"""

from __future__ import annotations

import atexit
import os

from jax_ep import _native

DEFAULT_BUFFER_BYTES = 1 << 30  # enough for DeepSeek-V3 shapes on 8 GPUs at a tight capacity
_UNIQUE_ID_KEY = "jax_ep/nvshmem_unique_id"


def _set_environment_defaults():
    """NVSHMEM and XLA settings, never overriding the user's own (multicast always stays off)."""
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")


_set_environment_defaults()


def _distributed_client():
    from jax._src import distributed

    return distributed.global_state.client


def is_initialized() -> bool:
    module, _ = _native.load()
    return module is not None and module.is_initialized()


def initialize(buffer_bytes: int | None = None) -> None:
    """Join the NVSHMEM job of all JAX processes and allocate the symmetric buffer.

    Args:
      buffer_bytes: symmetric buffer per GPU; default ``JAX_EP_BUFFER_BYTES`` or 1 GiB. Calls
        that need more fail with an error naming the size they need.
    """
    import jax

    module, why = _native.load()
    if module is None:
        raise RuntimeError(why)
    if buffer_bytes is None:
        buffer_bytes = int(os.environ.get("JAX_EP_BUFFER_BYTES", DEFAULT_BUFFER_BYTES))
    local = jax.local_devices()
    if not local or local[0].platform != "gpu":
        raise RuntimeError("jax_ep.runtime.initialize needs a GPU backend "
                           f"(JAX sees {[d.platform for d in local]})")
    if len(local) != 1:
        raise RuntimeError(
            f"this process owns {len(local)} GPUs; jax_ep runs one process per GPU: start it with "
            "`python -m jax_ep.launch -n <gpus> script.py` or pass local_device_ids=[rank] to "
            "jax.distributed.initialize")
    rank, world = jax.process_index(), jax.process_count()
    client = _distributed_client()
    if world > 1 and client is None:
        raise RuntimeError(
            "call jax.distributed.initialize(...) before jax_ep.runtime.initialize()")
    if rank == 0:
        unique_id = module.create_unique_id()
        if world > 1:
            client.key_value_set_bytes(_UNIQUE_ID_KEY, unique_id)
    else:
        unique_id = client.blocking_key_value_get_bytes(_UNIQUE_ID_KEY, 120_000)
    hosts = {d.process_index: getattr(d, "slice_index", 0) for d in jax.devices()}
    single_host = os.environ.get("JAX_EP_MULTI_HOST", "0") != "1" and len(set(hosts.values())) <= 1
    device_id = local[0].local_hardware_id
    module.initialize(rank, world, int(device_id if device_id is not None else 0),
                      int(buffer_bytes), unique_id, single_host)
    _native.register()
    atexit.register(finalize)


def finalize() -> None:
    """Free the symmetric buffer and leave NVSHMEM (if jax_ep started it). Idempotent."""
    module, _ = _native.load()
    if module is not None and module.is_initialized():
        module.finalize()


def buffer_bytes() -> int:
    module, _ = _native.load()
    return module.buffer_bytes() if module is not None else 0
