"""GPU smoke run of the runtime and the layout target across processes (not a pytest module).

    python -m jax_ep.launch -n 2 tests/gpu_smoke_runtime.py [--finalize-at-exit]

Every process joins NVSHMEM through ``jax_ep.runtime.initialize()``, then the layout target
runs under jit + shard_map over a mesh of every GPU of every process and is checked against
NumPy; finally the layout kernel's time per call at DeepSeek-V3 shapes is printed.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from jax_ep import launch

launch.init_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep import _native, runtime  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_native_build import numpy_layout, random_topk  # noqa: E402


def layout_call(num_tokens, num_experts, num_ranks, side_effect=False):
    return jax.ffi.ffi_call(
        "jax_ep_layout",
        (jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_)),
        has_side_effect=side_effect)


def check_sharded_layout(mesh, num_tokens=512, num_topk=8, num_experts=64):
    R = mesh.size
    rng = np.random.default_rng(1234)  # the same global input on every process
    topk_global = random_topk(rng, R * num_tokens, num_topk, num_experts)
    sharding = NamedSharding(mesh, P("ep"))
    topk = jax.make_array_from_callback(topk_global.shape, sharding, lambda i: topk_global[i])
    call = layout_call(num_tokens, num_experts, R)

    def per_device(t):
        return call(t, num_experts=np.int64(num_experts), num_ranks=np.int64(R))

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("ep"),
                               out_specs=(P("ep"), P("ep"), P("ep"))))
    outs = fn(topk)
    for r in range(R):
        want = numpy_layout(topk_global[r * num_tokens:(r + 1) * num_tokens], num_experts, R)
        for out, w, rows in zip(outs, want, (R, num_experts, num_tokens)):
            for shard in out.addressable_shards:
                if shard.index[0].start == r * rows:
                    np.testing.assert_array_equal(np.asarray(shard.data), w)
                    break
    print(f"sharded layout over {R} GPUs matches NumPy", flush=True)


def time_layout(num_tokens=4096, num_topk=8, num_experts=256, num_ranks=8, calls=200):
    rng = np.random.default_rng(7)
    topk = jax.device_put(random_topk(rng, num_tokens, num_topk, num_experts),
                          jax.local_devices()[0])
    call = layout_call(num_tokens, num_experts, num_ranks, side_effect=True)
    attrs = dict(num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))

    def many(t):
        return [call(t, **attrs) for _ in range(calls)][-1]

    fn = jax.jit(many)
    jax.block_until_ready(fn(topk))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(topk))
        best = min(best, (time.perf_counter() - start) / calls)
    print(f"layout T={num_tokens} K={num_topk} E={num_experts} R={num_ranks}: "
          f"{best * 1e6:.1f} us per call ({calls} calls in one jit, best of 5)", flush=True)


def main():
    rank, world = jax.process_index(), jax.process_count()
    runtime.initialize()
    runtime.initialize()  # a second call with the same size is a no-op
    module, _ = _native.load()
    print(f"process {rank} of {world}: NVSHMEM {module.nvshmem_version()}, PE "
          f"{module.rank()} of {module.num_ranks()}, buffer {runtime.buffer_bytes()} bytes, "
          f"device {jax.local_devices()[0]}", flush=True)
    assert module.rank() == rank and module.num_ranks() == world
    assert runtime.buffer_bytes() == runtime.default_buffer_bytes()

    mesh = Mesh(np.array(jax.devices()), ("ep",))
    check_sharded_layout(mesh)
    time_layout()
    if "--finalize-at-exit" in sys.argv:
        print("OK (finalize left to atexit)", flush=True)
        return
    runtime.finalize()
    runtime.finalize()  # idempotent
    assert not runtime.is_initialized()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
