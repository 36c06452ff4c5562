"""A peer that never arrives: the waiting kernels must stop with a message, not hang.

    JAX_EP_TIMEOUT_S=3 python -m jax_ep.launch -n 2 tests/gpu_timeout_probe.py [--across-nodes]

Rank 0 dispatches; rank 1 does not. Rank 0's kernel waits for rank 1, gives up after
JAX_EP_TIMEOUT_S with a message naming PE 1, and traps; the launcher then stops everyone.
--across-nodes: each rank a virtual node of its own and a low-latency dispatch, so the
arrival awaited is an NVSHMEM signal from the other node. Run by tests/test_gpu_failures.py
(not a pytest module itself).
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

from jax_ep import launch

START = time.monotonic()
launch.init_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import runtime  # noqa: E402

sys.stdout.reconfigure(line_buffering=True)

ACROSS = "--across-nodes" in sys.argv[1:]
runtime.initialize(64 << 20, low_latency_bytes=(64 << 20) if ACROSS else None, fault_exit_s=5,
                   node_size=1 if ACROSS else None)
print(f"runtime initialised at {time.monotonic() - START:.1f} s", flush=True)
R = jax.device_count()
mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
def step(x, idx):
    if ACROSS:
        return jax_ep.low_latency_dispatch(x, idx, num_experts=2 * R, max_tokens_per_rank=8,
                                           axis_name="ep", use_fp8=False, backend="cuda").x
    return jax_ep.dispatch(x, idx, num_experts=2 * R, axis_name="ep", backend="cuda").x


sharding = NamedSharding(mesh, P("ep"))
x = jax.make_array_from_callback((8 * R, 256), sharding,
                                 lambda i: jnp.ones((8, 256), jnp.bfloat16))
idx = jax.make_array_from_callback((8 * R, 2), sharding, lambda i: jnp.zeros((8, 2), jnp.int32))
# Every process compiles (multi-process compilation waits for all of them) ...
compiled = step.lower(x, idx).compile()
print(f"compiled at {time.monotonic() - START:.1f} s", flush=True)
if jax.process_index() == 0:
    # ... but only this one runs the program: its dispatch waits for PE 1, which never comes.
    try:
        jax.block_until_ready(compiled(x, idx))
        print("UNEXPECTED: the dispatch returned", flush=True)
    except Exception as e:  # the trapped kernel surfaces as an XLA runtime error
        print(f"dispatch failed as expected at {time.monotonic() - START:.1f} s: "
              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
    # Skip the interpreter's exit handlers: jax.distributed's shutdown barrier would wait for
    # rank 1, and a context whose kernel trapped cannot be torn down cleanly.
    os._exit(3)
else:
    time.sleep(60)
    os._exit(0)
