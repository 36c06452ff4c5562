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
    """A function running `calls` calls of body(*a) -> scalar, unrolled in one program.

    Argument `chained` carries a zero-weighted dependency from each call to the next, so XLA
    can neither hoist the calls nor overlap them. The loop is unrolled in Python rather than
    a `fori_loop`: XLA:GPU reads a while loop's predicate back to the host every iteration,
    which would add tens of microseconds of loop overhead to every call.
    """

    def run(*a):
        operands = list(a)
        for _ in range(calls):
            s = body(*operands)
            carried = operands[chained]
            operands[chained] = carried + (s * 0).astype(carried.dtype)
        return operands[chained][:1]

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
