"""Shared by the benchmarks: placing global inputs, and timing calls as XLA runs them."""

from __future__ import annotations

import time

import jax
import numpy as np


def put(array, sharding):
    """A global NumPy array (identical on every process) placed with `sharding`."""
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def looped(body, calls, chained=0):
    """A function running `calls` calls of body(*a) -> scalar in one jax.lax.fori_loop.

    Argument `chained` carries a zero-weighted dependency from each call to the next, so XLA
    can neither hoist the calls out of the loop nor overlap them.
    """

    def run(*a):
        def step(_, carried):
            operands = list(a)
            operands[chained] = carried
            s = body(*operands)
            return carried + (s * 0).astype(carried.dtype)

        return jax.lax.fori_loop(0, calls, step, a[chained])[:1]

    return run


def seconds_per_call(f, *a, calls, repeats):
    """Median over `repeats` of (time of f(*a)) / calls, after one warm-up (compilation)."""
    jax.block_until_ready(f(*a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))
