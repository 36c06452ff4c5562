"""What one execution of a jitted program costs beyond its calls, across processes.

    python -m jax_ep.launch -n 2 benchmarks/program_launch.py

The benchmarks' "µs per call" is the wall clock of one program of N chained calls over N, so
it carries the program's fixed cost F (host dispatch, the first kernel's launch, the ranks'
skew at the start, the wait for the end) once per N calls. This times chains of 1, 10 and 100
calls of a local op (no communication), of a low-latency FP8 dispatch and BF16 combine, of a
padded ``jax.lax.all_to_all`` and (``--normal``) of a normal-mode BF16 dispatch at DeepSeek-V3
shapes, fits wall = F + N·t, and records on every process the monotonic clock
(system-wide on one host) when the call was made, when it returned (enqueued) and when the
results were ready, to give the ranks' skew at each execution's start and end.
"""

from __future__ import annotations

import argparse
import os
import time

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--repeats", type=int, default=30)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--hidden", type=int, default=7168)
p.add_argument("--calls", default="1,10,100")
p.add_argument("--aligned", action="store_true",
               help="also time each execution started after a host barrier of the processes")
p.add_argument("--normal", action="store_true",
               help="also a normal-mode BF16 dispatch chain at --normal-tokens per rank")
p.add_argument("--normal-tokens", type=int, default=4096)
args = p.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep._types import LowLatencyConfig, LowLatencyHandle  # noqa: E402

from timing import build_line, ep_mesh, looped, random_routing  # noqa: E402

AXIS = "ep"


def clocks(f, a, repeats, aligned):
    """[repeats, 3] monotonic ns: called, returned, ready; after one warm-up."""
    jax.block_until_ready(f(*a))
    out = np.zeros((repeats, 3), np.int64)
    for i in range(repeats):
        if aligned:
            multihost_utils.sync_global_devices("probe")
        out[i, 0] = time.perf_counter_ns()
        r = f(*a)
        out[i, 1] = time.perf_counter_ns()
        jax.block_until_ready(r)
        out[i, 2] = time.perf_counter_ns()
    return out


def main():
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    R, T, H, K, E = jax.device_count(), args.tokens, args.hidden, 8, 256
    if jax.default_backend() == "gpu":
        from jax_ep import runtime

        runtime.initialize(
            low_latency_bytes=jax_ep.low_latency_buffer_size_hint(T, H, E, K, R))
    _, shard, smap = ep_mesh(R, AXIS)
    rng = np.random.default_rng(0)
    idx, x, w, idx_d = random_routing(rng, R, T, H, E, K, shard)
    ll = dict(num_experts=E, max_tokens_per_rank=T, axis_name=AXIS)

    def local(x, idx):
        return x[:1] * 1.0001

    def dispatch(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=True, **ll).recv_count

    def padded(x, idx):  # every rank's T rows in R equal blocks, one to each rank
        return jax.lax.all_to_all(x[: R * (T // R)].reshape(R, T // R, H), AXIS, 0, 0,
                                  tiled=True)

    # the combine alone, as bench_low_latency.py times it: one dispatch's handle and rows
    config = LowLatencyConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=H, num_topk=K,
                              max_tokens_per_rank=T, use_fp8=False, axis_name=AXIS,
                              backend=jax_ep.api._resolve_backend("auto"))

    def handle_arrays(x, idx):
        o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll)
        h = o.handle
        return (jnp.where((h.src_rank >= 0)[..., None], o.x, 0), h.topk_idx, h.send_slot,
                h.src_rank, h.src_token, h.src_k, h.recv_count, h.pair_row)

    y, *handle = jax.jit(smap(handle_arrays, in_specs=(P(AXIS),) * 2))(x, idx_d)

    def combine(y, w, *h):
        return jax_ep.low_latency_combine(y, w, LowLatencyHandle(*h, config=config))

    chains = [("local op", local, (x, idx_d)), ("LL dispatch FP8", dispatch, (x, idx_d)),
              ("LL combine BF16", combine, (y, w, *handle)), ("all_to_all", padded, (x, idx_d))]
    if args.normal:
        Tn = args.normal_tokens
        idx_n, x_n, w_n, idx_nd = random_routing(rng, R, Tn, H, E, K, shard)
        in_rank = ((idx_n.reshape(R, Tn, K) // (E // R))[..., None] == np.arange(R)).any(2)
        capacity = int(in_rank.sum((0, 1)).max())  # rows each rank receives: nothing dropped

        def normal(x, idx, w):
            return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                   capacity=capacity).num_received

        chains.append(("normal dispatch BF16", normal, (x_n, idx_nd, w_n)))
    lines = []
    for name, body, operands in chains:
        fits = []
        for mode in [False, True] if args.aligned else [False]:
            walls = {}
            for n in [int(c) for c in args.calls.split(",")]:
                f = jax.jit(smap(looped(body, n, chained=0),
                                 in_specs=(P(AXIS),) * len(operands)))
                c = clocks(f, operands, args.repeats, mode)
                every = multihost_utils.process_allgather(c)  # [P, repeats, 3]
                wall = np.median(c[:, 2] - c[:, 0]) / 1e3
                start_skew = np.median(every[:, :, 0].max(0) - every[:, :, 0].min(0)) / 1e3
                end_skew = np.median(every[:, :, 2].max(0) - every[:, :, 2].min(0)) / 1e3
                enq = np.median(c[:, 1] - c[:, 0]) / 1e3
                walls[n] = wall
                lines.append(f"| {name} | {'aligned' if mode else 'free'} | {n} | {wall:.1f} | "
                             f"{wall / n:.2f} | {enq:.1f} | {start_skew:.1f} | {end_skew:.1f} |")
            ns = sorted(walls)
            slope, icpt = np.polyfit(ns, [walls[n] for n in ns], 1)
            fits.append(f"{name} ({'aligned' if mode else 'free'}): F = {icpt:.1f} µs, "
                        f"t = {slope:.2f} µs per call")
        lines += fits
    if jax.process_index() == 0:
        print(f"\n{R}×{jax.devices()[0].device_kind}; {build_line()}")
        print("| chain | start | calls | wall µs | µs per call | enqueue µs | start skew µs | "
              "end skew µs |")
        print("|---|---|---|---|---|---|---|---|")
        for line in lines:
            print(line)


if __name__ == "__main__":
    main()
